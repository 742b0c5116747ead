"""The doctor's verdicts as pure functions, table-tested with plain values and fakes (no torch, no model)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from hangwatch.daemon.data import Example, Problem
from hangwatch.daemon.doctor import memory_estimate as memory
from hangwatch.daemon.doctor import plan_checks as plan
from hangwatch.daemon.doctor import text_checks as text
from hangwatch.daemon.doctor.findings import FAIL, OK, SKIP, WARN, exit_code, ok
from hangwatch.daemon.doctor.model_checks import check_generate
from hangwatch.daemon.doctor.runner import timed

EOS, PAD = 2, 0


class FakeTok:
    """The part of a transformers tokenizer the special-token check reads."""

    def __init__(self, pad=PAD, eos=EOS, bos=1, unk=3):
        self.pad_token_id, self.eos_token_id, self.bos_token_id, self.unk_token_id = pad, eos, bos, unk
        self.pad_token, self.eos_token, self.bos_token, self.unk_token = "<pad>", "</s>", "<s>", "<unk>"

    def convert_tokens_to_ids(self, t):
        return None


def ex(input_ids, labels, id="f:1"):
    return Example(id=id, input_ids=input_ids, labels=labels)


LEARNS_EOS = ex([1, 5, 6, 7, EOS], [-100, -100, 6, 7, EOS])
NO_EOS = ex([1, 5, 6, 7], [-100, -100, 6, 7])


@pytest.mark.parametrize(
    "tok, examples, status, words",
    [
        (FakeTok(), [LEARNS_EOS], OK, "present and distinct"),
        (FakeTok(eos=None), [LEARNS_EOS], FAIL, "no eos"),
        (FakeTok(pad=None), [LEARNS_EOS], FAIL, "no pad"),
        (FakeTok(pad=EOS), [LEARNS_EOS], WARN, "pad == eos"),  # masked by position: eos still learned
        (FakeTok(pad=EOS), [NO_EOS], FAIL, "never learns to stop"),  # pad == eos and eos never a label
        (FakeTok(bos=EOS), [LEARNS_EOS], WARN, "bos == eos"),
    ],
)
def test_special_tokens(tok, examples, status, words):
    f = text.check_special_tokens(tok, examples)
    assert f.status == status and words in f.summary
    assert (f.fix != "") == (status != OK)


@pytest.mark.parametrize(
    "examples, problems, status, words",
    [
        ([LEARNS_EOS], [], OK, "1/1 usable"),
        ([], [Problem("t", i, "the completion is empty: nothing to learn") for i in (1, 2)], FAIL, "all-masked"),
        ([LEARNS_EOS], [Problem("t", 2, "every label is masked: nothing to learn")], WARN, "1 all-masked"),
        (
            [LEARNS_EOS],
            [Problem("t", 2, "90 tokens, longer than data.max_length=64 (data.truncation: reject)")],
            WARN,
            "1 too long",
        ),
        ([], [Problem("t", 1, "not valid JSON: x")], FAIL, "no example is usable"),
    ],
)
def test_data_counts(examples, problems, status, words):
    f = text.check_data("training", "t.jsonl", examples, problems, required=True)
    assert f.status == status and words in f.summary


def test_truncation_of_many_examples_warns():
    cut = [Example(id=str(i), input_ids=[1, 2], labels=[-100, 2], truncated=True) for i in range(3)]
    assert text.check_data("training", "t", cut + [LEARNS_EOS], [], required=True).status == WARN


@pytest.mark.parametrize(
    "examples, status, words",
    [
        ([LEARNS_EOS], OK, "eos learned"),
        ([ex([1, 5, 6], [-100, 6, 7])], FAIL, "not their input ids"),  # labels shifted already
        ([ex([5, 6, EOS], [5, 6, EOS])], WARN, "position 0"),
        ([NO_EOS], FAIL, "never learns to stop"),
        ([LEARNS_EOS, ex([1, 5, 6, 7, EOS], [-100, 5, -100, 7, EOS])], WARN, "masked tokens inside"),
    ],
)
def test_label_alignment(examples, status, words):
    f = text.check_label_alignment(examples, EOS)
    assert f.status == status and words in f.summary


def test_decoded_example_shows_the_masked_and_learned_spans():
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "".join(f"<{i}>" for i in ids))
    f = text.check_example(tok, [LEARNS_EOS])
    assert f.status == OK and "2 masked + 3 learned" in f.summary
    assert f.details == ["masked (-100), 2 tokens: '<1><5>'", "learned, 3 tokens: '<6><7><2>'"]


@pytest.mark.parametrize(
    "lr, warmup, steps, pretrained, status, words",
    [
        (2e-4, 10, 100, True, OK, "peak 0.0002"),
        (1.0, 10, 100, True, FAIL, "train.lr 1"),
        (0.1, 10, 100, False, FAIL, "diverges"),
        (5e-3, 10, 100, True, WARN, "high for a pretrained"),
        (1e-2, 10, 100, False, OK, "peak 0.01"),  # the demo's tiny model
        (2e-4, 100, 100, True, WARN, "whole run is warm-up"),
        (2e-4, 60, 100, True, WARN, "more than half"),
    ],
)
def test_lr_schedule(lr, warmup, steps, pretrained, status, words):
    f = plan.check_lr_schedule(lr, warmup, steps, pretrained=pretrained, effective_batch=16, n_examples=320)
    assert f.status == status and words in f.summary
    assert "5.0 epochs" in f.details[1]


@pytest.mark.parametrize(
    "device, nproc, count, visible, status, words",
    [
        ("cpu", 2, None, None, OK, "gloo"),
        ("cuda", 1, 0, "", FAIL, "no CUDA device"),
        ("auto", 1, 0, None, OK, "cpu"),
        ("cuda", 4, 2, "0,1", FAIL, "nproc_per_node 4 but 2 GPU"),
        ("auto", 2, 2, None, OK, "one per visible GPU"),
        ("cuda", 1, 8, None, OK, "7 GPU(s) left idle"),
        ("cuda", 2, None, None, SKIP, "not counted"),
    ],
)
def test_placement(device, nproc, count, visible, status, words):
    f = plan.check_placement(device, nproc, count, visible)
    assert f.status == status and words in f.summary


@pytest.mark.parametrize(
    "value, n", [(None, None), ("", 0), ("-1", 0), ("0", 1), ("0,1, 2", 3), ("GPU-abc,GPU-def", 2)]
)
def test_visible_count(value, n):
    assert plan.visible_count(value) == n


GIB = 1 << 30


@pytest.mark.parametrize(
    "keep, size, free, status",
    [
        (3, 1 * GIB, 100 * GIB, OK),
        (3, 15 * GIB, 100 * GIB, WARN),  # 4.34 checkpoints × 15 GiB = 65 GiB: over half of what is free
        (3, 30 * GIB, 100 * GIB, FAIL),
        (3, None, 1 * GIB, OK),
    ],
)
def test_disk(keep, size, free, status):
    assert plan.check_disk(keep, size, free, "/x", basis="b").status == status


def test_newest_checkpoint_is_measured(tmp_path):
    for step, n in (("step-00000010", 10), ("step-00000020", 30)):
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
        (tmp_path / "checkpoints" / step / "w").write_bytes(b"x" * n)
    assert plan.newest_checkpoint_bytes(tmp_path / "checkpoints") == 30
    assert plan.newest_checkpoint_bytes(tmp_path / "none") is None


@pytest.mark.parametrize(
    "enabled, exe, scope, cap, probe, status, words",
    [
        (False, None, None, False, None, SKIP, "py_spy is false"),
        (True, None, None, False, None, WARN, "not found"),
        (True, "/bin/py-spy", None, False, None, OK, "no Yama"),
        (True, "/bin/py-spy", 1, False, None, WARN, "ptrace_scope 1"),
        (True, "/bin/py-spy", 1, True, None, OK, "CAP_SYS_PTRACE"),
        (True, "/bin/py-spy", 3, True, None, WARN, "forbids every attach"),
        (True, "/bin/py-spy", 0, False, (False, "Permission denied"), WARN, "Permission denied"),
        (True, "/bin/py-spy", 0, False, (True, "ok"), OK, "attached"),
    ],
)
def test_py_spy(enabled, exe, scope, cap, probe, status, words):
    f = plan.check_py_spy(enabled, exe, scope, cap, probe)
    assert f.status == status and words in f.summary


def test_ptrace_facts_from_proc_files(tmp_path):
    (tmp_path / "scope").write_text("1\n")
    (tmp_path / "status").write_text("Name:\tx\nCapEff:\t0000000000080000\n")  # bit 19 only
    assert plan.ptrace_scope(str(tmp_path / "scope")) == 1 and plan.ptrace_scope(str(tmp_path / "no")) is None
    assert plan.has_cap_sys_ptrace(str(tmp_path / "status"))
    (tmp_path / "status").write_text("CapEff:\t0000000000000000\n")
    assert not plan.has_cap_sys_ptrace(str(tmp_path / "status"))


def counts(total=8_000_000_000, trainable=20_000_000):
    return memory.Counts(
        total=total, trainable_numel={"lora": trainable}, hidden=4096, intermediate=14336, layers=32, vocab=128256
    )


def test_memory_estimate_parts_and_dtype():
    fp32 = memory.estimate(
        counts(), micro_batch=1, max_length=1024, weight_bytes=4.0, act_bytes=4, gradient_checkpointing=False, cuda=True
    )
    bf16 = memory.estimate(
        counts(), micro_batch=1, max_length=1024, weight_bytes=2.0, act_bytes=2, gradient_checkpointing=False, cuda=True
    )
    assert fp32["weights"] == 2 * bf16["weights"] == (8_000_000_000 - 20_000_000) * 4
    assert fp32["optimizer"] == 20_000_000 * 8 and fp32["cuda context"] > 0
    ckpt = memory.estimate(
        counts(), micro_batch=1, max_length=1024, weight_bytes=2.0, act_bytes=2, gradient_checkpointing=True, cuda=True
    )
    assert ckpt["activations"] < bf16["activations"] / 4
    assert bf16["total"] > sum(v for k, v in bf16.items() if k != "total")  # the margin
    # An 8B model in float32 does not fit a 24 GiB card; in bf16 with checkpointing the weights still need 16 GB.
    assert memory.check_memory(fp32, 24 * GIB, "gpu", dtype_text="", shape_text="").status == FAIL
    assert memory.check_memory(bf16, 80 * GIB, "gpu", dtype_text="", shape_text="").status == OK
    assert memory.check_memory(bf16, int(bf16["total"] / 0.9), "gpu", dtype_text="", shape_text="").status == WARN


@pytest.mark.parametrize(
    "dtype, four_bit, cuda, bf16, expected",
    [
        ("auto", False, False, False, 4.0),
        ("auto", False, True, True, 2.0),
        ("auto", False, True, False, 4.0),
        ("bfloat16", False, False, False, 2.0),
        ("float32", False, True, True, 4.0),
        ("auto", True, True, True, 0.56),
    ],
)
def test_weight_bytes(dtype, four_bit, cuda, bf16, expected):
    assert memory.weight_bytes_per_param(dtype, four_bit, cuda, bf16) == expected


def test_trainable_kinds():
    p = lambda grad=True: SimpleNamespace(requires_grad=grad, numel=lambda: 10)  # noqa: E731
    names, numel = memory.classify(
        [
            ("m.q_proj.lora_A.default.weight", p()),
            ("m.lm_head.modules_to_save.default.weight", p()),
            ("base_model.model.causal_projection.proj.weight", p()),
            ("m.q_proj.base_layer.weight", p(False)),
            ("m.norm.weight", p()),
        ],
        ["causal_projection"],
    )
    assert {k: len(v) for k, v in names.items()} == {"lora": 1, "modules_to_save": 1, "extra": 1, "other": 1}


def probe(tokens, stopped=False, eos_p=0.01, seconds=0.1, vocab=128):
    return {
        "prompt": "p",
        "tokens": tokens,
        "seconds": seconds,
        "timed_out": False,
        "stopped_early": stopped,
        "eos_p": [eos_p] * tokens,
        "vocab": vocab,
        "text": "x",
    }


@pytest.mark.parametrize(
    "probes, eos, max_new, sample, budget, status, words",
    [
        ([probe(16)], 2, 16, False, 10, OK, "eos reached in 0/1"),
        ([probe(64, eos_p=0.0)] * 2, 2, 2048, True, 300, WARN, "never emitted"),
        ([probe(64, eos_p=0.0)] * 2, 2, 2048, True, 5, FAIL, "never emitted"),
        ([probe(64, seconds=1.0)], 2, 2048, False, 10, FAIL, "killed as a hang"),  # 2048 × 15.6 ms > 10 s
        ([probe(64)], 2, 2048, True, None, WARN, "eos reached in 0/1"),
        ([probe(5, stopped=True)], 2, 2048, True, None, OK, "eos reached in 1/1"),
        ([probe(4)], 200, 16, False, 10, FAIL, "outside the model's 128 logits"),
        ([probe(4)], None, 16, False, 10, FAIL, "no eos"),
        ([], 2, 16, False, 10, SKIP, "no eval.prompts"),
    ],
)
def test_generate_verdict(probes, eos, max_new, sample, budget, status, words):
    f = check_generate(probes, eos=eos, eos_text="</s>", max_new_tokens=max_new, do_sample=sample, budget_s=budget)
    assert f.status == status and words in f.summary


def test_timed_turns_errors_and_hangs_into_failures():
    def boom():
        raise RuntimeError("no such file\nmore")

    assert timed("x", lambda: ok("x", "fine"), 5).status == OK
    f = timed("x", boom, 5)
    assert f.status == FAIL and "RuntimeError: no such file" in f.summary
    f = timed("x", lambda: time.sleep(5), 0.05)
    assert f.status == FAIL and "did not finish within 0.05s" in f.summary
    assert exit_code([ok("a", "b"), f]) == 1 and exit_code([ok("a", "b")]) == 0


def test_rendezvous_check():
    r = plan.check_rendezvous("127.0.0.1:1", None, 2)
    assert r.status == WARN and "checkpoint.dir is not set" in r.summary
    r = plan.check_rendezvous("127.0.0.1:1", "/shared", 2)
    assert r.status == OK and "this machine: its hangwatch hosts the store" in r.summary
    r = plan.check_rendezvous("no-such-host.invalid:29400", "/shared", 2)
    assert r.status == FAIL and "does not resolve" in r.summary
