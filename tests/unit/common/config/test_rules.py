"""Rules across settings and duplicate keys: each is a table row, refused (or advised) with the key and
its line, never accepted silently.  Pure: no files, no processes."""

from __future__ import annotations

import pytest

from hangwatch.common.config import ConfigError, parse_config
from hangwatch.common.config.rules import advice

OWN = "worker:\n  command: [python, x.py]\n"  # lines 1-2: a worker of one's own
BUILTIN = "data:\n  train: t.jsonl\n"  # lines 1-2: the built-in worker, with data
EVAL_ON = BUILTIN + "eval:\n  every_steps: 5\n  prompts: [hi]\n"  # lines 3-5

ERRORS = [
    # (yaml, the problems, {p} for the source)
    (
        OWN + "restart:\n  backoff_initial_s: 100\n  backoff_max_s: 1\n",
        [
            "{p}:4: restart.backoff_initial_s: 100 exceeds restart.backoff_max_s (1): the first backoff delay cannot "
            "be larger than the cap it doubles towards"
        ],
    ),
    (
        OWN + "restart:\n  backoff_initial_s: 400\n",  # over the default cap (300), which the file does not mention
        [
            "{p}:4: restart.backoff_initial_s: 400 exceeds restart.backoff_max_s (300): the first backoff delay cannot "
            "be larger than the cap it doubles towards"
        ],
    ),
    (
        OWN + "watchdog:\n  step_timeout_max_s: 5\n",  # under the default lower clamp (10): the section's line
        [
            "{p}:3: watchdog.step_timeout_min_s: 10 exceeds watchdog.step_timeout_max_s (5): the calibrated step "
            "deadline is clamped between the two"
        ],
    ),
    (
        OWN + "watchdog:\n  phase_budgets_s: {eval: 0}\n",
        ["{p}:4: watchdog.phase_budgets_s.eval: Input should be greater than 0, got 0"],
    ),
    (
        OWN + "watchdog:\n  phase_budgets_s:\n    load: -5\n",
        ["{p}:5: watchdog.phase_budgets_s.load: Input should be greater than 0, got -5"],
    ),
    (
        BUILTIN + "eval:\n  every_steps: 10\n",
        [
            "{p}:4: eval.every_steps: 10 evaluates every 10 steps, but there is nothing to evaluate: set data.eval "
            "(held-out loss) and/or eval.prompts (generations), or eval.every_steps: 0"
        ],
    ),
    (
        BUILTIN + "faults:\n  - {kind: hang_generate, at_step: 3}\n",
        ["{p}:4: faults.0.kind: hang_generate waits for an eval, but eval.every_steps is 0: it would never fire"],
    ),
    (
        BUILTIN + "faults:\n  - kind: crash\n    at_eval: 2\n",
        ["{p}:5: faults.0.at_eval: crash waits for an eval, but eval.every_steps is 0: it would never fire"],
    ),
    (
        "data:\n  train: t.jsonl\n  eval: e.jsonl\neval:\n  every_steps: 5\n"
        "faults:\n  - {kind: hang_generate, at_step: 3}\n",
        [
            "{p}:7: faults.0.kind: hang_generate acts on eval's generate(), which runs only for eval.prompts, and "
            "there are none: it would never fire"
        ],
    ),
    (
        EVAL_ON + "train:\n  max_steps: 20\nfaults:\n  - {kind: crash, at_step: 3}\n  - kind: nan\n    at_step: 21\n",
        ["{p}:11: faults.1.at_step: 21 is past train.max_steps (20): it would never fire"],
    ),
    (
        EVAL_ON + "train:\n  max_steps: 20\nfaults:\n  - kind: crash\n    at_eval: 5\n",
        ["{p}:10: faults.0.at_eval: eval 5 would come at step 25, past train.max_steps (20): it would never fire"],
    ),
    # several ranks of the built-in worker
    (
        BUILTIN + "worker:\n  nproc_per_node: 2\nfaults:\n  - {kind: crash, at_step: 3, rank: 2}\n",
        ["{p}:6: faults.0.rank: 2 is not a rank of this run (worker.nproc_per_node 2: ranks 0-1): it would never fire"],
    ),
    (
        EVAL_ON + "worker:\n  nproc_per_node: 2\nfaults:\n  - {kind: hang_generate, at_step: 3, rank: 1}\n",
        ["{p}:9: faults.0.rank: 1: hang_generate acts on generate(), which runs on rank 0 only: it would never fire"],
    ),
    (
        "worker:\n  nproc_per_node: 4\ndata:\n  inbox: true\n",
        [
            "{p}:2: worker.nproc_per_node: 4: continuous mode (data.inbox: true) trains on one process; use "
            "worker.nproc_per_node: 1"
        ],
    ),
    # several nodes: the rendezvous every node must name, and what no node can do alone
    (
        BUILTIN + "worker:\n  nnodes: 2\n",
        [
            "{p}:3: worker.rdzv_endpoint: required when worker.nnodes is 2: host:port of the rendezvous store, the "
            "same on every node (e.g. 10.0.0.1:29400)"
        ],
    ),
    (
        BUILTIN + "worker:\n  nnodes: 2\n  rdzv_endpoint: 10.0.0.1\n",
        ["{p}:5: worker.rdzv_endpoint: not host:port (e.g. 10.0.0.1:29400), got '10.0.0.1'"],
    ),
    (
        BUILTIN + "worker:\n  nnodes: 2\n  rdzv_endpoint: h:1\nfaults:\n  - {kind: crash, at_step: 3, rank: 2}\n",
        [
            "{p}:7: faults.0.rank: 2 is not a rank of this run (worker.nproc_per_node 1 × worker.nnodes 2: ranks 0-1): "
            "it would never fire"
        ],
    ),
    (
        "worker:\n  command: [accelerate, launch, t.py]\n  nnodes: 2\n  rdzv_endpoint: h:1\n",
        [
            "{p}:2: worker.command: 'accelerate': with worker.nnodes 2 hangwatch launches torchrun itself; give the "
            "script as [python, train.py, …] (or a torchrun command line, whose rendezvous options hangwatch sets)"
        ],
    ),
    (
        "worker:\n  rdzv_id: 'a b'\n",
        ["{p}:2: worker.rdzv_id: String should match pattern '^[A-Za-z0-9_.-]+$', got 'a b'"],
    ),
    # several at once, each on its own line
    (
        OWN + "restart: {backoff_initial_s: 9, backoff_max_s: 2}\n"
        "watchdog: {step_timeout_min_s: 9, step_timeout_max_s: 2}\n",
        [
            "{p}:3: restart.backoff_initial_s: 9 exceeds restart.backoff_max_s (2): the first backoff delay cannot be "
            "larger than the cap it doubles towards",
            "{p}:4: watchdog.step_timeout_min_s: 9 exceeds watchdog.step_timeout_max_s (2): the calibrated step "
            "deadline is clamped between the two",
        ],
    ),
]


ACCEPTED = [
    OWN + "restart:\n  backoff_initial_s: 5\n  backoff_max_s: 5\n",  # equal is fine
    OWN + "restart:\n  backoff_initial_s: 0\n",
    OWN + "watchdog:\n  step_timeout_min_s: 30\n  step_timeout_max_s: 30\n",
    OWN + "watchdog:\n  phase_budgets_s: {eval: null, load: 0.5}\n",  # null removes a default
    # eval/faults: the worker's business
    OWN + "eval:\n  every_steps: 10\nfaults:\n  - {kind: hang_generate, at_step: 3}\n",
    BUILTIN + "  eval: e.jsonl\neval:\n  every_steps: 10\n",  # held-out loss only: an eval with work to do
    EVAL_ON + "faults:\n  - {kind: hang_generate, at_step: 3}\n  - {kind: crash, at_eval: 2, at_step: 12}\n",
    BUILTIN + "worker:\n  nproc_per_node: 2\nfaults:\n  - {kind: busy_loop, at_step: 3, rank: 1}\n",
    BUILTIN
    + "worker:\n  nnodes: 2\n  rdzv_endpoint: 127.0.0.1:29400\nfaults:\n  - {kind: busy_loop, at_step: 3, rank: 1}\n",
    "worker:\n  command: [torchrun, --nproc-per-node=2, t.py]\n  nnodes: 2\n  rdzv_endpoint: '[::1]:29400'\n",
]


@pytest.mark.parametrize("text", ACCEPTED, ids=[f"ok{i}" for i in range(len(ACCEPTED))])
def test_consistent_settings_pass(text):
    parse_config(text, "c.yaml")


ADVICE = [
    # (yaml, the advice as (dotted key, start of the message))
    (BUILTIN + "eval:\n  prompts: [hi]\n", [(("eval", "prompts"), "never generated: eval.every_steps is 0")]),
    (BUILTIN + "  eval: e.jsonl\n", [(("data", "eval"), "never read: eval.every_steps is 0")]),
    (
        EVAL_ON.replace("every_steps: 5", "every_steps: 500"),
        [(("eval", "every_steps"), "500 is more than train.max_steps (100)")],
    ),
    (
        BUILTIN + "checkpoint:\n  every_steps: 100\n",
        [
            (
                ("checkpoint", "every_steps"),
                "the first checkpoint (step 100, good 2 steps later) is not good before train.max_steps",
            )
        ],
    ),
    (
        BUILTIN + "train:\n  max_steps: 12\ncheckpoint:\n  every_steps: 10\n",
        [
            (
                ("checkpoint", "every_steps"),
                "the first checkpoint (step 10, good 2 steps later) is not good before train.max_steps (12)",
            )
        ],
    ),
    (
        BUILTIN + "train:\n  max_steps: 10\n  warmup_steps: 10\ncheckpoint: {every_steps: 2}\n",
        [
            (
                ("train", "warmup_steps"),
                "10 is not less than train.max_steps (10): the learning rate never reaches train.lr",
            )
        ],
    ),
    (EVAL_ON, []),
    (BUILTIN, []),
    (OWN + "eval:\n  prompts: [hi]\ncheckpoint: {every_steps: 1000}\n", []),  # a worker of one's own: its business
    (
        BUILTIN + "worker: {nnodes: 2, rdzv_endpoint: 'h:1'}\n",
        [(("checkpoint", "dir"), "not set with worker.nnodes 2: each node keeps checkpoints in its own run dir")],
    ),
    (BUILTIN + "worker: {nnodes: 2, rdzv_endpoint: 'h:1'}\ncheckpoint: {dir: /shared/ckpt}\n", []),
]


@pytest.mark.parametrize("text,expected", ADVICE, ids=[f"a{i}" for i in range(len(ADVICE))])
def test_likely_mistakes_are_advised(text, expected):
    got = advice(parse_config(text, "c.yaml"))
    assert [loc for loc, _ in got] == [loc for loc, _ in expected]
    for (_, msg), (_, start) in zip(got, expected):
        assert msg.startswith(start), msg


DUPLICATES = [
    (
        OWN + "watchdog:\n  silence_timeout_s: 10\n  silence_timeout_s: 20\n",
        [
            "{p}:5: watchdog.silence_timeout_s: duplicate key (first at line 4); YAML would silently keep only the "
            "last one: remove one of them"
        ],
    ),
    (
        "run_dir: a\n" + OWN + "run_dir: b\n",
        [
            "{p}:4: run_dir: duplicate key (first at line 1); YAML would silently keep only the last one: remove one "
            "of them"
        ],
    ),
    (
        OWN + "faults:\n  - kind: crash\n    at_step: 1\n    at_step: 2\n",
        [
            "{p}:6: faults.0.at_step: duplicate key (first at line 5); YAML would silently keep only the last one: "
            "remove one of them"
        ],
    ),
    (
        OWN + "watchdog: {term_grace_s: 1, term_grace_s: 2}\n",
        [
            "{p}:3: watchdog.term_grace_s: duplicate key (first at line 3); YAML would silently keep only the last "
            "one: remove one of them"
        ],
    ),
    (
        OWN + "watchdog:\n  phase_budgets_s:\n    eval: 1\n    eval: 2\nwatchdog:\n  kill_wait_s: 3\n",
        [
            "{p}:6: watchdog.phase_budgets_s.eval: duplicate key (first at line 5); YAML would silently keep only the "
            "last one: remove one of them",
            "{p}:7: watchdog: duplicate key (first at line 3); YAML would silently keep only the last one: remove one "
            "of them",
        ],
    ),
]


REFUSED = ERRORS + DUPLICATES


REFUSED_IDS = [f"r{i}" for i in range(len(ERRORS))] + [f"d{i}" for i in range(len(DUPLICATES))]


@pytest.mark.parametrize("text,problems", REFUSED, ids=REFUSED_IDS)
def test_contradicting_settings_and_duplicate_keys_are_refused_with_the_key_and_its_line(text, problems):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "c.yaml")
    assert info.value.problems == [p.format(p="c.yaml") for p in problems]


def test_a_merge_key_overriding_is_not_a_duplicate():
    # `<<` merges a mapping whose keys may then be overridden on purpose: YAML's way, not an accident
    text = OWN + "watchdog:\n  <<: {term_grace_s: 1, kill_wait_s: 2}\n  term_grace_s: 3\n"
    w = parse_config(text, "c.yaml").watchdog
    assert (w.term_grace_s, w.kill_wait_s) == (3, 2)


def test_keys_that_only_look_alike_are_not_duplicates():
    cfg = parse_config(OWN + "  env: {A: b, a: c, '1': d}\n", "c.yaml")
    assert cfg.worker.env == {"A": "b", "a": "c", "1": "d"}
