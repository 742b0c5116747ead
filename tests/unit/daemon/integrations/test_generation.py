"""The supervisor's order to end a runaway generate(), read inside the worker: `StopOrder`, the criterion of
`GenerateWatch`, the built-in eval's, and the `runaway_generate` fault — on a real tiny model, real heartbeat
files and real order files (no supervisor: the tests write the order themselves, atomically, mid-generation).

The order file is stat'ed at most every `POLL_INTERVAL_S`; the tests that write an order at a known token set
it to 0 so that the order is seen at that very token (a tiny model makes a token in about a millisecond)."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import LogitsProcessor, StoppingCriteria, StoppingCriteriaList  # noqa: E402

from hangwatch.common.protocol import GENERATE_STOP_NAME, MAX_LINE, TRUNCATED_FIELD, decode_line  # noqa: E402
from hangwatch.daemon.heartbeat import Heartbeat, NullHeartbeat  # noqa: E402
from hangwatch.daemon.integrations import generation  # noqa: E402
from hangwatch.daemon.integrations.generation import (
    GenerateWatch,
    StopOrder,
    last_truncation,  # noqa: E402
    tokenizer_of,
    truncation_report,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "examples"))
import tiny_model  # noqa: E402

MAX_NEW = 40


@pytest.fixture(scope="module")
def tok():
    return tiny_model.tokenizer()


@pytest.fixture
def model(tok):
    return tiny_model.model(tok, seed=0)


@pytest.fixture
def every_token(monkeypatch):
    monkeypatch.setattr(generation, "POLL_INTERVAL_S", 0.0)


def attempt_dir(tmp_path) -> Path:
    return tmp_path / "run" / "attempts" / "0001"


def heartbeat(tmp_path, rank: int = 0) -> Heartbeat:
    return Heartbeat(attempt_dir(tmp_path) / f"heartbeat-rank{rank}.jsonl", rank=rank)


def write_order(directory: Path, body, order: int = 1) -> None:
    """As the supervisor does: a temporary file, then a rename over the order (a new inode)."""
    text = (
        body if isinstance(body, str) else json.dumps({"order": order, "tokens": body, "issued_unix": 0, "budget_s": 1})
    )
    tmp = directory / f".{GENERATE_STOP_NAME}.tmp"
    tmp.write_text(text)
    os.replace(tmp, directory / GENERATE_STOP_NAME)


class At(StoppingCriteria):
    """The test's own criterion: runs `actions[n]` when the call has made n new tokens; never stops anything."""

    def __init__(self, actions: dict):
        self.actions, self.start, self.done = actions, None, set()

    def __call__(self, input_ids, scores=None, **kw):
        self.start = input_ids.shape[1] - 1 if self.start is None else self.start
        n = input_ids.shape[1] - self.start
        if n in self.actions and n not in self.done:
            self.done.add(n)
            self.actions[n]()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def enc_of(tok, text="question 7:"):
    return tok(text, return_tensors="pt", return_token_type_ids=False)


def generate(model, tok, enc, criteria=(), **kw):
    kw = {
        "max_new_tokens": MAX_NEW,
        "do_sample": False,
        "suppress_tokens": [tok.eos_token_id],
        "pad_token_id": tok.pad_token_id,
        **kw,
    }
    return model.generate(**enc, stopping_criteria=StoppingCriteriaList(list(criteria)), **kw)


def beats(hb: Heartbeat) -> list[dict]:
    return [decode_line(line) for line in Path(hb.path).read_bytes().splitlines()]


def truncated_lines(recs: list[dict]) -> list[dict]:
    return [r for r in recs if TRUNCATED_FIELD in r]


# ---- through GenerateWatch -------------------------------------------------------------------------


def test_without_an_order_nothing_changes(tmp_path, tok, model, every_token):
    enc = enc_of(tok)
    plain = generate(model, tok, enc)
    hb = heartbeat(tmp_path)
    watch = GenerateWatch(hb, progress_every=8, tokenizer=tok)
    watch.install(model)
    try:
        watched = generate(model, tok, enc)
    finally:
        watch.uninstall()
    assert torch.equal(plain, watched) and watched.shape[1] == enc["input_ids"].shape[1] + MAX_NEW
    assert last_truncation() is None and watch.last_truncated is None
    recs = beats(hb)
    assert not truncated_lines(recs)
    assert [r.get("tokens") for r in recs if r["event"] == "progress"] == [8, 16, 24, 32, 40]


def test_an_order_written_mid_generation_ends_it_at_the_limit(tmp_path, tok, model, every_token):
    k = 11
    enc = enc_of(tok)
    prompt_len = enc["input_ids"].shape[1]
    hb = heartbeat(tmp_path)
    watch = GenerateWatch(hb, progress_every=4, tokenizer=tok)
    watch.install(model)
    try:
        out = generate(model, tok, enc, [At({k: lambda: write_order(attempt_dir(tmp_path), k + 3, order=7)})])
    finally:
        watch.uninstall()
    assert out.shape[1] == prompt_len + k + 3
    recs = beats(hb)
    kinds = [(r["event"], r["phase"]) for r in recs]
    (line,) = truncated_lines(recs)
    at = recs.index(line)
    enter = kinds.index(("phase", "generate"))
    leave = next(i for i in range(enter + 1, len(recs)) if recs[i]["event"] == "phase")
    assert enter < at < leave and line["phase"] == "generate" and recs[leave]["phase"] != "generate"
    report = line[TRUNCATED_FIELD]
    assert {k_: report[k_] for k_ in ("order", "limit", "tokens", "prompt_tokens")} == {
        "order": 7,
        "limit": k + 3,
        "tokens": k + 3,
        "prompt_tokens": prompt_len,
    }
    assert report["prompt"] == tok.decode(out[0, :prompt_len], skip_special_tokens=True) == "question 7:"
    assert report["output_tail"] == tok.decode(out[0, prompt_len:], skip_special_tokens=True)
    assert "prompt_ids" not in report
    assert last_truncation() == report == watch.last_truncated
    # The next call of the same thread is not truncated: the order it saw at its start is not its own.
    watch.install(model)
    try:
        again = generate(model, tok, enc, max_new_tokens=6)
    finally:
        watch.uninstall()
    assert again.shape[1] == prompt_len + 6 and last_truncation() is None


def test_an_order_that_was_there_before_the_generate_began_is_not_its_order(tmp_path, tok, model, every_token):
    hb = heartbeat(tmp_path)
    write_order(attempt_dir(tmp_path), 2, order=1)
    enc = enc_of(tok)
    prompt_len = enc["input_ids"].shape[1]
    watch = GenerateWatch(hb, progress_every=8)
    watch.install(model)
    try:
        out = generate(model, tok, enc)
        assert out.shape[1] == prompt_len + MAX_NEW and last_truncation() is None
        # A new order replacing the old one while the call runs is its order.
        out = generate(model, tok, enc, [At({20: lambda: write_order(attempt_dir(tmp_path), 25, order=2)})])
    finally:
        watch.uninstall()
    assert out.shape[1] == prompt_len + 25
    assert last_truncation()["order"] == 2


@pytest.mark.parametrize(
    "bad",
    [
        '{"order": 1, "tok',
        "[]",
        '{"order": 1, "tokens": 0}',
        '{"order": 1, "tokens": true}',
        '{"order": "1", "tokens": 5}',
        '{"tokens": 5}',
        '{"order": 1, "tokens": 2.5}',
    ],
)
def test_a_partial_or_invalid_order_is_ignored_and_read_again(tmp_path, tok, model, every_token, bad):
    hb = heartbeat(tmp_path)
    enc = enc_of(tok)
    prompt_len = enc["input_ids"].shape[1]
    directory = attempt_dir(tmp_path)
    watch = GenerateWatch(hb, progress_every=8)
    watch.install(model)
    try:
        out = generate(model, tok, enc, [At({5: lambda: write_order(directory, bad)})])
        assert out.shape[1] == prompt_len + MAX_NEW and last_truncation() is None
        # Written in place (not replaced): invalid first, then completed into a valid order.
        path = directory / GENERATE_STOP_NAME

        def complete():
            with open(path, "w") as f:
                f.write(json.dumps({"order": 3, "tokens": 14}))

        out = generate(model, tok, enc, [At({5: lambda: path.write_text(bad), 10: complete})])
    finally:
        watch.uninstall()
    assert out.shape[1] == prompt_len + 14 and last_truncation()["order"] == 3


def test_a_limit_already_passed_stops_at_once(tmp_path, tok, model, every_token):
    hb = heartbeat(tmp_path)
    enc = enc_of(tok)
    prompt_len = enc["input_ids"].shape[1]
    watch = GenerateWatch(hb, progress_every=8)  # no tokenizer: the prompt's ids are reported
    watch.install(model)
    try:
        out = generate(model, tok, enc, [At({17: lambda: write_order(attempt_dir(tmp_path), 4)})])
    finally:
        watch.uninstall()
    assert out.shape[1] == prompt_len + 17
    (line,) = truncated_lines(beats(hb))
    report = line[TRUNCATED_FIELD]
    assert (report["limit"], report["tokens"]) == (4, 17)
    assert report["prompt_ids"] == enc["input_ids"][0].tolist() and "prompt" not in report


def test_every_row_of_a_batch_stops_and_row_0_is_reported(tmp_path, tok, model, every_token):
    enc = tok(
        ["question 7:", "what is 3 plus 3?"],
        return_tensors="pt",
        padding=True,
        padding_side="left",
        return_token_type_ids=False,
    )
    hb = heartbeat(tmp_path)
    watch = GenerateWatch(hb, tokenizer=tok)
    watch.install(model)
    try:
        out = generate(
            model, tok, enc, [At({6: lambda: write_order(attempt_dir(tmp_path), 9)})], return_dict_in_generate=True
        )
    finally:
        watch.uninstall()
    assert out.sequences.shape == (2, enc["input_ids"].shape[1] + 9)
    assert last_truncation()["prompt"] == "question 7:"  # row 0, its padding skipped
    assert last_truncation()["output_tail"] == tok.decode(out.sequences[0, -9:], skip_special_tokens=True)


class BrokenBeats(Heartbeat):
    def progress(self, **extra):
        raise OSError("disk full")


class BrokenTokenizer:
    def decode(self, ids, **kw):
        raise RuntimeError("cannot decode")


def test_in_the_guarded_path_errors_of_its_own_never_reach_the_users_generate(tmp_path, tok, model, every_token):
    enc = enc_of(tok)
    prompt_len = enc["input_ids"].shape[1]
    errors: list = []
    hb = BrokenBeats(attempt_dir(tmp_path) / "heartbeat-rank0.jsonl")
    watch = GenerateWatch(hb, progress_every=2, on_error=errors.append, tokenizer=BrokenTokenizer())
    watch.install(model)
    try:
        out = generate(model, tok, enc, [At({6: lambda: write_order(attempt_dir(tmp_path), 9)})])
    finally:
        watch.uninstall()
    assert out.shape[1] == prompt_len + 9  # the order still ends it; the user gets what was made
    assert [type(e).__name__ for e in errors] == ["OSError", "RuntimeError", "OSError"]  # beat, decode, report
    assert last_truncation()["tokens"] == 9 and "prompt" not in last_truncation()
    recs = beats(hb)
    assert [r["event"] for r in recs] == ["phase", "phase"]  # into generate and out: the phase lines still work


def test_unguarded_a_tokenizer_that_cannot_decode_costs_the_text_only(tmp_path, tok, model, every_token):
    enc = enc_of(tok)
    hb = heartbeat(tmp_path)
    watch = GenerateWatch(hb, tokenizer=BrokenTokenizer())
    watch.install(model)
    try:
        out = generate(model, tok, enc, [At({3: lambda: write_order(attempt_dir(tmp_path), 5)})])
    finally:
        watch.uninstall()
    assert out.shape[1] == enc["input_ids"].shape[1] + 5
    (line,) = truncated_lines(beats(hb))
    assert line[TRUNCATED_FIELD]["tokens"] == 5 and "prompt" not in line[TRUNCATED_FIELD]


def test_two_ranks_generating_in_lockstep_stop_at_the_same_token(tmp_path, tok, every_token):
    """Two ranks (own heartbeat file, own model and watch, one attempt directory) in two threads, in step at token
    K when rank 0 writes the order; a third rank reaches the order only past the limit and stops at once."""
    k, limit = 10, 15
    ranks = range(3)
    meet = threading.Barrier(3, timeout=60)
    seen = threading.Barrier(3, timeout=60)
    results, reports, errors = {}, {}, []
    models = [tiny_model.model(tok, seed=0) for _ in ranks]  # here: the seed is the process's, not a thread's

    def at_k(rank):
        def action():
            meet.wait()
            if rank == 0:
                write_order(attempt_dir(tmp_path), limit, order=4)
            seen.wait()

        return action

    def run(rank):
        try:
            model = models[rank]
            hb = heartbeat(tmp_path, rank)
            watch = GenerateWatch(hb, tokenizer=tok)
            watch.install(model)
            at = k if rank < 2 else 18  # rank 2 is 3 tokens past the limit when it first looks
            results[rank] = generate(model, tok, enc_of(tok), [At({at: at_k(rank)})])
            reports[rank] = last_truncation()
            watch.uninstall()
            hb.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
            meet.abort()
            seen.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    prompt_len = enc_of(tok)["input_ids"].shape[1]
    assert [results[r].shape[1] - prompt_len for r in ranks] == [limit, limit, 18]
    assert torch.equal(results[0], results[1])
    assert [(reports[r]["order"], reports[r]["tokens"]) for r in ranks] == [(4, limit), (4, limit), (4, 18)]
    for r in ranks:
        (line,) = truncated_lines(beats(heartbeat(tmp_path, r)))
        assert line["rank"] == r


# ---- StopOrder, the report, the tokenizer ------------------------------------------------------------


def test_the_order_file_is_stated_at_most_every_poll_interval(tmp_path):
    order = StopOrder(tmp_path, clock=lambda: 0.0)
    assert order.poll(100.0) is None
    write_order(tmp_path, 30, order=2)
    assert order.poll(100.0 + generation.POLL_INTERVAL_S / 2) is None  # not looked at yet
    assert order.poll(100.0 + generation.POLL_INTERVAL_S) == 30 and (order.order, order.limit) == (2, 30)
    write_order(tmp_path, 50, order=3)
    assert order.poll(200.0) == 30  # the first order read is kept: every rank stops at the same limit


def test_where_there_is_no_attempt_directory_nothing_is_ever_ordered(tmp_path):
    assert StopOrder.of(NullHeartbeat()).path is None and StopOrder.of(NullHeartbeat()).poll() is None
    hb = heartbeat(tmp_path)
    assert StopOrder.of(hb).path == str(attempt_dir(tmp_path) / GENERATE_STOP_NAME)
    hb.close()
    assert StopOrder.of(hb).path is None
    assert StopOrder.of(object()).path is None


def test_the_report_fits_one_heartbeat_line_whatever_the_text(tmp_path):
    hb = heartbeat(tmp_path)
    base = {"order": 1, "limit": 100, "tokens": 100, "prompt_tokens": 9000}
    prompt, output = "\U0001f600é" * 5000, "\u4e2d" * 9000
    report = truncation_report(base, prompt=prompt, output=output)
    hb.progress(**{TRUNCATED_FIELD: report})
    raw = Path(hb.path).read_bytes()
    assert len(raw) < MAX_LINE
    line = decode_line(raw)
    assert "truncated" not in line and line[TRUNCATED_FIELD] == report
    assert report["prompt"].startswith("\U0001f600") and output.endswith(report["output_tail"])
    short = truncation_report(base, prompt="p" * 900, output="o" * 900)
    assert len(short["prompt"]) == generation.PROMPT_CHARS and short["prompt"][0] == "p" and "\u2026" in short["prompt"]
    assert short["output_tail"] == "o" * generation.TAIL_CHARS
    assert truncation_report(base, prompt_ids=list(range(100)))["prompt_ids"] == list(range(32))


def test_tokenizer_of(tok):
    class Processor:
        tokenizer = tok

    class Images:
        def __call__(self, *a):
            return a

    assert tokenizer_of(None, tok) is tok and tokenizer_of(Processor()) is tok
    assert tokenizer_of(Images(), None) is None and tokenizer_of() is None


# ---- the built-in worker's eval and the runaway_generate fault -----------------------------------------


class WriteOrderAt(LogitsProcessor):
    """Writes the order when the call has made `k` tokens (a logits processor sees the ids before the next one)."""

    def __init__(self, directory: Path, k: int, limit: int):
        self.directory, self.k, self.limit, self.start = directory, k, limit, None

    def __call__(self, input_ids, scores):
        self.start = input_ids.shape[1] if self.start is None else self.start
        if input_ids.shape[1] - self.start == self.k:
            write_order(self.directory, self.limit, order=5)
        return scores


@pytest.fixture(scope="module")
def bundle_and_cfg(tmp_path_factory):
    from fixtures.fakes.workers import make_config

    from hangwatch.common.config import load_config
    from hangwatch.daemon.model import load_model

    tmp = tmp_path_factory.mktemp("eval")
    cfg = load_config(
        make_config(
            tmp,
            eval={
                "every_steps": 2,
                "max_new_tokens": 4,
                "progress_every_tokens": 2,
                "prompts": ["upper: cat", "reverse: dog", "double: sun"],
            },
            faults=[{"kind": "runaway_generate", "at_step": 2}],
        )
    )
    return load_model(cfg), cfg


def test_a_runaway_eval_is_truncated_and_says_so(tmp_path, bundle_and_cfg, every_token):
    from hangwatch.daemon.evaluate import EVOLUTION, run_eval
    from hangwatch.daemon.faults import RUNAWAY_MAX_NEW_TOKENS, FaultPlan

    bundle, cfg = bundle_and_cfg
    run_dir = tmp_path / "run"
    hb = heartbeat(tmp_path)
    plan = FaultPlan(list(cfg.faults), run_dir, hb)
    plan.before_step(2, bundle)  # waits for the eval
    assert plan.fired_record() == []
    processors = plan.before_eval(2, 1, bundle)
    (runaway,) = processors
    assert runaway.max_new_tokens == RUNAWAY_MAX_NEW_TOKENS and bundle.tokenizer.eos_token_id in runaway.eos_ids
    scores = runaway(None, torch.zeros(1, 8 + bundle.tokenizer.eos_token_id))
    assert scores[0, bundle.tokenizer.eos_token_id] == float("-inf") and scores[0, 0] == 0

    k, limit = 9, 12  # far past eval.max_new_tokens (4): the fault raised the cap and took EOS away
    summary = run_eval(
        bundle, cfg, hb, run_dir, 2, [], processors=processors + [WriteOrderAt(attempt_dir(tmp_path), k, limit)]
    )
    assert summary["generations"] == 1
    (record,) = [json.loads(line) for line in (run_dir / EVOLUTION).read_text().splitlines()]
    assert (record["prompt"], record["truncated"], record["tokens"], record["limit"], record["skipped_prompts"]) == (
        "upper: cat",
        True,
        limit,
        limit,
        2,
    )
    recs = beats(hb)
    (line,) = truncated_lines(recs)
    assert line["phase"] == "generate" and recs[recs.index(line) + 1]["event"] == "phase"
    report = line[TRUNCATED_FIELD]
    assert (report["order"], report["limit"], report["tokens"], report["prompt"]) == (5, limit, limit, "upper: cat")
    assert record["output"].endswith(report["output_tail"])
    assert [r.get("tokens") for r in recs if r["event"] == "progress" and "tokens" in r] == [2, 4, 6, 8, 10, 12]

    # The next eval: no fault, no order of its own (the file is older than its phase): records as before.
    (run_dir / EVOLUTION).unlink()
    run_eval(bundle, cfg, hb, run_dir, 4, [], processors=plan.before_eval(4, 2, bundle))
    records = [json.loads(line) for line in (run_dir / EVOLUTION).read_text().splitlines()]
    assert [sorted(r) for r in records] == [
        sorted(["step", "prompt", "reference", "output", "loss", "attempt", "t"])
    ] * 3


def test_hang_generate_is_still_the_processor_that_never_returns(tmp_path, bundle_and_cfg):
    from hangwatch.common.config import FaultCfg
    from hangwatch.daemon.faults import FaultPlan

    bundle, _ = bundle_and_cfg
    plan = FaultPlan([FaultCfg(kind="hang_generate", at_step=2)], tmp_path / "run", NullHeartbeat())
    (hang,) = plan.before_eval(2, 1, bundle)
    assert type(hang).__name__ == "NeverEndingLogits" and not hasattr(hang, "max_new_tokens")


def test_the_report_marks_a_truncated_output():
    from hangwatch.supervisor.cli.report.page import generations_section
    from hangwatch.supervisor.cli.report.run_records import RunData

    gens = [
        {
            "step": 2,
            "prompt": "p",
            "reference": None,
            "output": "aaaa",
            "loss": None,
            "attempt": 1,
            "truncated": True,
            "tokens": 12,
            "skipped_prompts": 2,
        },
        {"step": 4, "prompt": "p", "reference": None, "output": "bbbb", "loss": None, "attempt": 1},
    ]
    page = generations_section(RunData(run_dir=Path("x"), state={}, generations=gens))
    assert "aaaa\u2026 [truncated at 12 tokens, 2 prompts skipped]" in page and "bbbb</pre>" in page


def test_the_hf_callback_hands_the_trainers_tokenizer_to_its_watch(tmp_path, tok, model):
    from types import SimpleNamespace

    from hangwatch.daemon.integrations.transformers import HangwatchCallback

    env = {"HANGWATCH_RUN_DIR": str(tmp_path / "run"), "HANGWATCH_ATTEMPT": "1"}
    args, state = SimpleNamespace(output_dir=str(tmp_path / "out")), SimpleNamespace(global_step=0)

    class Processor:  # a multimodal processing_class: its tokenizer decodes
        tokenizer = tok

    from hangwatch.daemon.heartbeat import WRITERS

    writers = (WRITERS.steps_elsewhere, WRITERS.manual, set(WRITERS.phase_owners))  # process-wide: put back after
    try:
        for given, processing_class, expected in (
            (None, Processor(), tok),
            (tok, object(), tok),
            (None, object(), None),
        ):
            callback = HangwatchCallback(environ=env, tokenizer=given)
            try:
                callback.on_train_begin(args, state, None, model=model, processing_class=processing_class)
                assert callback._watch.tokenizer is expected
            finally:
                callback.on_train_end(args, state, None)
                callback.hb.release_dump_handler()
                callback.hb.close()
    finally:
        WRITERS.steps_elsewhere, WRITERS.manual, WRITERS.phase_owners = writers
