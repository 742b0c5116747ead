"""The verdict of a multi-rank stall: each rank read on its own evidence, the culprit named, the victims grouped —
or "cannot tell" when the evidence cannot."""

from __future__ import annotations

import pytest

from hangwatch.supervisor.escalation.rank_evidence import source_line
from hangwatch.supervisor.incidents import stuck_frame
from hangwatch.supervisor.incidents.collectives import py_spy_main_thread, waits_in
from hangwatch.supervisor.incidents.verdict import RankEvidence, decide

TORCH = "/venv/lib/python3.11/site-packages/torch"

# What faulthandler wrote for rank 0 of tests/fixtures/workers/ddp_spin.py under torchrun (gloo, torch 2.13), and for
# rank 1.
RANK0_ALL_REDUCE = f"""\
Current thread 0x00007ff92aff3b80 (most recent call first):
  File "{TORCH}/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "{TORCH}/distributed/c10d_logger.py", line 83 in wrapper
  File "/srv/job/train.py", line 53 in main
  File "/srv/job/train.py", line 61 in <module>
"""
RANK1_SPIN = """\
Current thread 0x00007fe10e460b80 (most recent call first):
  File "/srv/job/train.py", line 88 in _poll_shard_ready
  File "/srv/job/train.py", line 52 in main
  File "/srv/job/train.py", line 61 in <module>
"""
# py-spy --native --locals of the same rank 0 (abridged: one long pybind11 frame shortened, the locals kept).
PY_SPY_RANK0 = """\
Process 5381: /venv/bin/python -u /srv/job/train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 5390 (idle): "gloo-worker"
    0x7ff92a8a3f16 (libc.so.6)
    gloo::transport::tcp::Loop::run (libtorch_cpu.so)

Thread 5381 (idle): "MainThread"
    0x7ff92a8a3f16 (libc.so.6)
    pthread_cond_wait (libc.so.6)
    std::condition_variable::wait (libstdc++.so.6.0.30)
    c10d::Work::wait (libtorch_cpu.so)
    pybind11::cpp_function::dispatcher (libtorch_python.so)
    all_reduce (torch/distributed/distributed_c10d.py:3252)
        Arguments:
            tensor: <Tensor at 0x7ff90bebdd60>
            async_op: False
        Locals:
            work: <torch._C._distributed_c10d.Work at 0x7ff90bd35c30>
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    main (train.py:53)
        Locals:
            step: 3
    <module> (train.py:61)
    0x7ff92a84524a (libc.so.6)
"""
# DDP waiting for its buckets at the end of backward: faulthandler sees only autograd's frames.
BACKWARD = [
    {"file": f"{TORCH}/autograd/graph.py", "line": 829, "function": "_engine_run_backward"},
    {"file": f"{TORCH}/autograd/__init__.py", "line": 353, "function": "backward"},
    {"file": "/srv/job/train.py", "line": 70, "function": "step"},
]
DDP_BUFFERS = [
    {"file": f"{TORCH}/nn/parallel/distributed.py", "line": 1900, "function": "_sync_buffers"},
    {"file": f"{TORCH}/nn/parallel/distributed.py", "line": 1500, "function": "_pre_forward"},
    {"file": "/srv/job/train.py", "line": 60, "function": "step"},
]
USER = [
    {"file": "/srv/job/train.py", "line": 88, "function": "_poll_shard_ready"},
    {"file": "/srv/job/train.py", "line": 52, "function": "main"},
]
ASYNC_WAIT = [{"file": "/srv/job/train.py", "line": 57, "function": "main"}]
SP = "/venv/lib/python3.11/site-packages"
GENERATING = [
    {"file": f"{SP}/transformers/integrations/sdpa_attention.py", "line": 193, "function": "sdpa_attention_forward"},
    {"file": f"{SP}/torch/nn/modules/module.py", "line": 1789, "function": "_call_impl"},
    {"file": f"{SP}/transformers/generation/utils.py", "line": 3235, "function": "_sample"},
    {"file": f"{SP}/transformers/generation/utils.py", "line": 3007, "function": "generate"},
    {"file": "/srv/job/train.py", "line": 46, "function": "on_evaluate"},
    {"file": "/srv/job/train.py", "line": 61, "function": "<module>"},
]


def stack(text: str) -> list[dict]:
    return stuck_frame(text)[1]


BUSY = {"state": "R", "cpu_percent": 99.0}
IDLE = {"state": "S", "cpu_percent": 0.0}
D_STATE = {"state": "D", "cpu_percent": 1.0}


def ev(rank, proc=IDLE, st=(), step=2, **kw) -> RankEvidence:
    return RankEvidence(rank=rank, pid=100 + rank, proc=proc, stack=list(st), step=step, phase="train", **kw)


@pytest.mark.parametrize(
    "frames, native, line, expected",
    [
        (stack(RANK0_ALL_REDUCE), [], None, "all_reduce"),
        (stack(RANK1_SPIN), [], None, None),
        (DDP_BUFFERS, [], None, "DDP _sync_buffers"),
        (BACKWARD, [], None, None),  # faulthandler alone cannot see DDP's reducer ...
        (BACKWARD, ["c10d::Reducer::finalize_backward (libtorch_cpu.so)"], None, "DDP reducer"),  # ... py-spy can
        (ASYNC_WAIT, [], "work.wait()", "wait"),  # Work.wait() is C, called straight from the user's line
        (ASYNC_WAIT, [], "os.wait()", None),
        (ASYNC_WAIT, ["c10d::Work::wait (libtorch_cpu.so)"], None, "wait (c10d work)"),
        (
            [{"file": f"{TORCH}/distributed/_functional_collectives.py", "line": 1, "function": "wait_tensor"}],
            [],
            None,
            "wait_tensor",
        ),
        (
            [{"file": f"{TORCH}/distributed/distributed_c10d.py", "line": 1, "function": "_store_based_barrier"}],
            [],
            None,
            "torch.distributed _store_based_barrier",
        ),
    ],
)
def test_what_a_rank_waits_in(frames, native, line, expected):
    assert waits_in(frames, native, line) == expected


def test_py_spys_main_thread_is_found_and_split_into_python_and_native_frames():
    python, native = py_spy_main_thread(PY_SPY_RANK0)
    assert [f["function"] for f in python] == ["all_reduce", "_exception_logger.<locals>.wrapper", "main", "<module>"]
    assert python[0] == {"file": "torch/distributed/distributed_c10d.py", "line": 3252, "function": "all_reduce"}
    assert "c10d::Work::wait (libtorch_cpu.so)" in native and not any("gloo::transport" in n for n in native)
    assert waits_in(python, native) == "all_reduce"
    assert py_spy_main_thread("") == ([], [])


CASES = [
    # name, evidence, culprit, roles, summary start
    (
        "a foreign job: rank 1 spins, rank 0 waits in all_reduce",
        [ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, BUSY, stack(RANK1_SPIN))],
        1,
        ["victim", "culprit"],
        "rank 1: busy loop in Python (CPU 99%) at _poll_shard_ready (/srv/job/train.py:88); rank 0 waiting in "
        "all_reduce",
    ),
    (
        "the culprit blocked in C, not spinning",
        [ev(0, IDLE, USER), ev(1, IDLE, stack(RANK0_ALL_REDUCE)), ev(2, IDLE, stack(RANK0_ALL_REDUCE))],
        0,
        ["culprit", "victim", "victim"],
        "rank 0: blocked in C (CPU 0%, state S) at _poll_shard_ready (/srv/job/train.py:88); ranks 1, 2 waiting in "
        "all_reduce",
    ),
    (
        "victims in different collectives are grouped by collective",
        [ev(0, BUSY, USER), ev(1, IDLE, stack(RANK0_ALL_REDUCE)), ev(2, IDLE, DDP_BUFFERS)],
        0,
        ["culprit", "victim", "victim"],
        "rank 0: busy loop in Python (CPU 99%) at _poll_shard_ready",
    ),
    (
        "every rank in the same collective at the same step: cannot tell",
        [ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, IDLE, stack(RANK0_ALL_REDUCE))],
        None,
        ["victim", "victim"],
        "cannot tell which rank is the culprit: every rank waits in a collective at step 2; ranks 0, 1 waiting in "
        "all_reduce",
    ),
    (
        "every rank waits, one is behind in step count",
        [ev(0, IDLE, stack(RANK0_ALL_REDUCE), step=5), ev(1, IDLE, stack(RANK0_ALL_REDUCE), step=4)],
        1,
        ["victim", "culprit"],
        "rank 1, behind the others in step (4 against 5): blocked in C",
    ),
    (
        "every rank waits, the flight recorder shows one behind",
        [
            ev(0, IDLE, stack(RANK0_ALL_REDUCE), collective_seq=58),
            ev(1, IDLE, stack(RANK0_ALL_REDUCE), collective_seq=57),
        ],
        1,
        ["victim", "culprit"],
        "rank 1, behind the others in collective sequence (57 against 58)",
    ),
    (
        "no stacks at all: cannot tell",
        [ev(0, IDLE), ev(1, IDLE)],
        None,
        ["unknown", "unknown"],
        "cannot tell which rank is the culprit: rank(s) 0, 1 gave no stack",
    ),
    (
        "a rank in state D needs no stack to be outside any collective",
        [ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, D_STATE)],
        1,
        ["victim", "culprit"],
        "rank 1: uninterruptible I/O (state D, CPU 1%); rank 0 waiting in all_reduce",
    ),
    (
        "a rank whose process is gone while the others wait",
        [ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, None)],
        1,
        ["victim", "culprit"],
        "rank 1: no worker process left to inspect; rank 0 waiting in all_reduce",
    ),
    (
        "an idle rank without a stack could be waiting too: cannot tell",
        [ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, IDLE)],
        None,
        ["victim", "unknown"],
        "cannot tell which rank is the culprit: rank(s) 1 gave no stack; rank 0 waiting in all_reduce; "
        "rank 1: blocked in C (CPU 0%, state S) (no stack)",
    ),
    (
        "two ranks outside: the one behind in steps",
        [ev(0, BUSY, USER, step=7), ev(1, IDLE, ASYNC_WAIT, step=6), ev(2, IDLE, stack(RANK0_ALL_REDUCE), step=7)],
        1,
        ["unknown", "culprit", "victim"],
        "rank 1, behind the others in step (6 against 7)",
    ),
    (
        "two ranks outside at the same step: the only one spinning",
        [
            ev(0, BUSY, USER),
            ev(1, IDLE, [{"file": "/srv/job/io.py", "line": 3, "function": "read_shard"}]),
            ev(2, IDLE, stack(RANK0_ALL_REDUCE)),
        ],
        0,
        ["culprit", "unknown", "victim"],
        "rank 0: busy loop in Python (CPU 99%) at _poll_shard_ready (/srv/job/train.py:88); rank 2 waiting in "
        "all_reduce; rank 1: blocked in C (CPU 0%, state S) at read_shard (/srv/job/io.py:3)",
    ),
    (
        "NCCL: both outside a collective frame and spinning (a CUDA sync spins), the flight recorder tells",
        [
            ev(0, BUSY, [{"file": "/srv/job/train.py", "line": 54, "function": "main"}], collective_seq=58),
            ev(1, BUSY, USER, collective_seq=57),
        ],
        1,
        ["unknown", "culprit"],
        "rank 1, behind the others in collective sequence (57 against 58): busy loop in Python",
    ),
    (
        "two ranks outside, both spinning, same step: cannot tell",
        [ev(0, BUSY, USER), ev(1, BUSY, USER), ev(2, IDLE, stack(RANK0_ALL_REDUCE))],
        None,
        ["unknown", "unknown", "victim"],
        "cannot tell which rank is the culprit: ranks 0, 1 are all outside any collective",
    ),
    (
        "a rank in the worker's own `wait` phase is a victim without a recognisable stack",
        [
            RankEvidence(0, 100, BUSY, USER, step=40, phase="generate"),
            RankEvidence(1, 101, IDLE, [{"file": "/srv/w.py", "line": 9, "function": "poll"}], step=40, phase="wait"),
        ],
        0,
        ["culprit", "victim"],
        "rank 0: busy loop in Python (CPU 99%) at _poll_shard_ready (/srv/job/train.py:88); "
        "rank 1 waiting in phase 'wait'",
    ),
    (
        "the culprit's words name the call it is in",
        [ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, BUSY, GENERATING)],
        1,
        ["victim", "culprit"],
        "rank 1: busy loop in Python (CPU 99%) at sdpa_attention_forward "
        f"({SP}/transformers/integrations/sdpa_attention.py:193), in generate(), called from on_evaluate "
        "(train.py:46); rank 0 waiting in all_reduce",
    ),
    (
        "the culprit's livelock is said",
        [ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, IDLE, USER, progress_lines=14, livelock=True)],
        1,
        ["victim", "culprit"],
        "rank 1: livelock: 14 progress beat(s) but no step; blocked in C (CPU 0%, state S) at _poll_shard_ready",
    ),
]


def test_the_deadline_that_fired_first_plays_no_part():
    """The same evidence in any order gives the same verdict: nothing but each rank's own evidence counts."""
    evidence = [ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, BUSY, stack(RANK1_SPIN))]
    assert decide(evidence) == decide(list(reversed(evidence)))


def test_each_rank_is_classified_from_its_own_process_and_frame():
    v = decide([ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, BUSY, stack(RANK1_SPIN))])
    r0, r1 = (f.as_dict() for f in v.ranks)
    assert r0["classification"].startswith("blocked in C (CPU 0%, state S) at all_reduce")  # never rank 1's CPU
    assert r0["collective"] == "all_reduce" and r0["stuck_frame"]["function"] == "all_reduce"
    assert r1["classification"].startswith("busy loop in Python (CPU 99%) at _poll_shard_ready")
    assert (r1["pid"], r1["state"], r1["cpu_percent"], r1["step"], r1["role"]) == (101, "R", 99.0, 2, "culprit")


def test_one_rank_is_its_own_culprit_and_no_ranks_cannot_tell():
    v = decide([ev(0, BUSY, USER)])
    assert v.culprit_rank == 0 and [f.role for f in v.ranks] == ["culprit"]
    none = decide([])
    assert none.culprit_rank is None and none.summary.startswith("cannot tell")


def test_the_source_line_of_a_frame_relative_to_the_workers_directory(tmp_path):
    (tmp_path / "train.py").write_text("import x\n    work.wait()\n")
    assert source_line("train.py", 2, str(tmp_path)) == "work.wait()"
    assert source_line(str(tmp_path / "train.py"), 9) is None and source_line("/nonexistent.py", 1) is None


DDP_FILE = "/v/lib/python3.11/site-packages/torch/nn/parallel/distributed.py"
C10D = "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


@pytest.mark.parametrize(
    "frames,expect",
    [
        # spinning in its own code inside DDP's forward: DDP's wrapper further out is not a wait
        (
            [
                ("/job/attn.py", "_select_ranges"),
                ("/job/attn.py", "forward"),
                (DDP_FILE, "_run_ddp_forward"),
                (DDP_FILE, "forward"),
                ("/job/train.py", "main"),
            ],
            None,
        ),
        (
            [
                (C10D, "all_reduce"),
                ("/v/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", "wrapper"),
                ("/job/train.py", "step"),
            ],
            "all_reduce",
        ),
        (
            [(DDP_FILE, "_sync_buffers"), (DDP_FILE, "_pre_forward"), (DDP_FILE, "forward"), ("/job/train.py", "main")],
            "DDP _sync_buffers",
        ),
        # a collective called from the rank's own code, which DDP's forward called: still the collective
        ([(C10D, "barrier"), ("/job/model.py", "forward"), (DDP_FILE, "_run_ddp_forward")], "barrier"),
        # the user's frame is innermost: a collective further out is not what it is doing now
        ([("/job/train.py", "spin"), (C10D, "all_reduce")], None),
    ],
)
def test_only_the_inner_end_of_the_stack_names_a_wait(frames, expect):
    from hangwatch.supervisor.incidents.collectives import python_wait

    assert python_wait([{"file": f, "line": 1, "function": fn} for f, fn in frames]) == expect


def test_each_rank_carries_its_landmark_and_the_users_own_landmarks_count():
    from hangwatch.supervisor.incidents.landmarks import user_landmarks

    v = decide([ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, BUSY, stack(RANK1_SPIN))])
    r0, r1 = (f.as_dict() for f in v.ranks)
    assert r0["landmark"]["name"] == "all_reduce" and r0["caller_frame"]["function"] == "main"
    assert r1["landmark"] is None and r1["caller_frame"]["function"] == "_poll_shard_ready"
    mine = decide(
        [ev(0, IDLE, stack(RANK0_ALL_REDUCE)), ev(1, BUSY, stack(RANK1_SPIN))],
        user_landmarks([{"function": "_poll_shard_ready", "name": "shard poll", "kind": "dataloader"}]),
    )
    assert mine.finding(1).landmark["name"] == "shard poll"
    assert mine.summary.startswith(
        "rank 1: busy loop in Python (CPU 99%) at _poll_shard_ready (/srv/job/train.py:88), "
        "in shard poll, called from main (train.py:52); rank 0 waiting in all_reduce"
    )


# ---- without C stacks: a rank idle inside backward() probably waits in DDP's gradient all-reduce -----------------

SPY_BACKWARD = [
    {"file": "torch/autograd/graph.py", "line": 829, "function": "_engine_run_backward"},  # py-spy's paths
    {"file": "torch/_tensor.py", "line": 626, "function": "Tensor.backward"},
    {"file": "train.py", "line": 70, "function": "step"},
]
TENSOR_BACKWARD = [
    {"file": f"{TORCH}/autograd/graph.py", "line": 829, "function": "_engine_run_backward"},
    {"file": f"{TORCH}/autograd/__init__.py", "line": 353, "function": "backward"},
    {"file": f"{TORCH}/_tensor.py", "line": 626, "function": "backward"},
    {"file": "/srv/job/train.py", "line": 70, "function": "step"},
]
ACCELERATE_BACKWARD = BACKWARD[:2] + [
    {"file": f"{SP}/accelerate/accelerator.py", "line": 2473, "function": "backward"},
    {"file": "/srv/job/train.py", "line": 71, "function": "main"},
]
LIGHTNING_BACKWARD = BACKWARD[:2] + [
    {"file": f"{SP}/lightning/pytorch/core/module.py", "line": 1100, "function": "manual_backward"},
    {"file": "/srv/job/model.py", "line": 40, "function": "training_step"},
]
DEEPSPEED_BACKWARD = TENSOR_BACKWARD[:3] + [
    {"file": f"{SP}/deepspeed/runtime/engine.py", "line": 2050, "function": "backward"},
    {"file": "/srv/job/train.py", "line": 80, "function": "main"},
]
# the user's own autograd Function is innermost: whatever it blocks in is its own code's doing
CUSTOM_FUNCTION = [{"file": "/srv/job/ops.py", "line": 12, "function": "backward"}] + BACKWARD
IN_FORWARD = [
    {"file": f"{TORCH}/nn/modules/linear.py", "line": 125, "function": "forward"},
    {"file": f"{TORCH}/nn/modules/module.py", "line": 1789, "function": "_call_impl"},
    {"file": "/srv/job/train.py", "line": 68, "function": "step"},
]
REDUCER = ["c10d::Reducer::finalize_backward (libtorch_cpu.so)"]
COMPUTING = ["at::native::addmm_out (libtorch_cpu.so)"]  # py-spy's native frames of a rank busy in a kernel


@pytest.mark.parametrize(
    "frames, native, expected",
    [
        (BACKWARD, [], "DDP's gradient all-reduce"),
        (SPY_BACKWARD, [], "DDP's gradient all-reduce"),
        (TENSOR_BACKWARD, [], "DDP's gradient all-reduce"),
        (ACCELERATE_BACKWARD, [], "DDP's gradient all-reduce"),
        (LIGHTNING_BACKWARD, [], "DDP's gradient all-reduce"),
        (DEEPSPEED_BACKWARD, [], "DeepSpeed's gradient reduction"),
        (BACKWARD, REDUCER, None),  # py-spy's native frames say it for sure (native_wait): no presumption
        (BACKWARD, COMPUTING, None),
        (CUSTOM_FUNCTION, [], None),
        (IN_FORWARD, [], None),
        (USER, [], None),
        ([], [], None),
    ],
)
def test_what_a_rank_probably_waits_in_without_c_stacks(frames, native, expected):
    from hangwatch.supervisor.incidents.collectives import probable_wait

    assert probable_wait(frames, native) == expected


PROBABLY = "waiting, probably in DDP's gradient all-reduce — cannot tell the culprit from this rank alone"


@pytest.mark.parametrize(
    "evidence, collective, probable, words",
    [
        (
            ev(0, IDLE, BACKWARD),
            None,
            "DDP's gradient all-reduce",
            f"{PROBABLY}; blocked in C (CPU 0%, state S) at _engine_run_backward ({TORCH}/autograd/graph.py:829), "
            "in backward(), called from step (train.py:70)",
        ),
        # busy in backward(): it computes its gradients, read as ever
        (ev(0, BUSY, BACKWARD), None, None, "busy loop in Python (CPU 99%) at _engine_run_backward"),
        # py-spy's native frames: what it waits in, for sure
        (
            ev(0, IDLE, BACKWARD, native=REDUCER),
            "DDP reducer",
            None,
            "blocked in C (CPU 0%, state S) at _engine_run_backward",
        ),
        # py-spy's native frames show no wait: outside any collective, as ever
        (ev(0, IDLE, BACKWARD, native=COMPUTING), None, None, "blocked in C (CPU 0%, state S) at _engine_run_backward"),
    ],
)
def test_the_reading_of_a_rank_in_backward_with_and_without_native_frames(evidence, collective, probable, words):
    from hangwatch.supervisor.incidents.verdict import read_rank

    f = read_rank(evidence)
    assert (f.collective, f.probable) == (collective, probable)
    assert f.words.startswith(words), f.words
    assert f.as_dict()["probable_wait"] == probable


NO_C_CASES = [
    # name, evidence, culprit, roles, summary start
    (
        "the culprit blocks before the collective in Python, the victim waits inside backward(): the culprit is named",
        [ev(0, IDLE, BACKWARD), ev(1, IDLE, USER)],
        1,
        ["victim", "culprit"],
        "rank 1: blocked in C (CPU 0%, state S) at _poll_shard_ready (/srv/job/train.py:88); "
        "rank 0 waiting, probably in DDP's gradient all-reduce (no C stack)",
    ),
    (
        "the same with py-spy's native frames: the victim waits in DDP's reducer, as ever",
        [ev(0, IDLE, BACKWARD, native=REDUCER), ev(1, IDLE, USER)],
        1,
        ["victim", "culprit"],
        "rank 1: blocked in C (CPU 0%, state S) at _poll_shard_ready (/srv/job/train.py:88); rank 0 waiting in DDP "
        "reducer",
    ),
    (
        "the culprit spins, the victim waits inside backward()",
        [ev(0, IDLE, BACKWARD), ev(1, BUSY, USER)],
        1,
        ["victim", "culprit"],
        "rank 1: busy loop in Python (CPU 99%) at _poll_shard_ready",
    ),
    (
        "the other rank waits in a collective of its own: cannot tell, never the rank in backward()",
        [ev(0, IDLE, BACKWARD), ev(1, IDLE, stack(RANK0_ALL_REDUCE))],
        None,
        ["unknown", "victim"],
        "cannot tell which rank is the culprit: every rank waits in a collective or probably does (rank(s) 0 inside "
        "backward(), with no C stack to show it) at step 2; rank 1 waiting in all_reduce; "
        f"rank 0: {PROBABLY}; blocked in C (CPU 0%, state S) at _engine_run_backward",
    ),
    (
        "both inside backward(): cannot tell",
        [ev(0, IDLE, BACKWARD), ev(1, IDLE, SPY_BACKWARD)],
        None,
        ["unknown", "unknown"],
        "cannot tell which rank is the culprit: every rank waits in a collective or probably does (rank(s) 0, 1",
    ),
    (
        "the other rank's process is gone: it is the culprit",
        [ev(0, IDLE, BACKWARD), ev(1, None)],
        1,
        ["victim", "culprit"],
        "rank 1: no worker process left to inspect; rank 0 waiting, probably in DDP's gradient all-reduce (no C stack)",
    ),
    (
        "the other rank gave no stack: cannot tell",
        [ev(0, IDLE, BACKWARD), ev(1, IDLE)],
        None,
        ["unknown", "unknown"],
        "cannot tell which rank is the culprit: rank(s) 1 gave no stack",
    ),
    (
        "the rank in backward() is behind the others in step count: that evidence names it",
        [ev(0, IDLE, BACKWARD, step=4), ev(1, IDLE, stack(RANK0_ALL_REDUCE), step=5)],
        0,
        ["culprit", "victim"],
        "rank 0, behind the others in step (4 against 5)",
    ),
    (
        "three ranks: two inside backward(), one blocked in its own code",
        [
            ev(0, IDLE, BACKWARD),
            ev(1, IDLE, [{"file": "/srv/job/io.py", "line": 3, "function": "read_shard"}]),
            ev(2, IDLE, TENSOR_BACKWARD),
        ],
        1,
        ["victim", "culprit", "victim"],
        "rank 1: blocked in C (CPU 0%, state S) at read_shard (/srv/job/io.py:3); "
        "ranks 0, 2 waiting, probably in DDP's gradient all-reduce (no C stack)",
    ),
]


@pytest.mark.parametrize(
    "name, evidence, culprit, roles, summary", CASES + NO_C_CASES, ids=[c[0] for c in CASES + NO_C_CASES]
)
def test_verdict(name, evidence, culprit, roles, summary):
    v = decide(evidence)
    assert v.culprit_rank == culprit
    assert [f.role for f in v.ranks] == roles
    assert v.summary.startswith(summary), v.summary


def test_a_rank_probably_waiting_in_backward_is_never_the_culprit_on_its_own_evidence():
    """Whatever else the other ranks show, at the same step and without a flight recorder, the rank idle inside
    backward() without C stacks is never the one named."""
    others = [USER, stack(RANK0_ALL_REDUCE), DDP_BUFFERS, BACKWARD, ASYNC_WAIT, [], GENERATING]
    for proc in (IDLE, BUSY, D_STATE, None):
        for frames in others:
            v = decide([ev(0, IDLE, BACKWARD), ev(1, proc, frames)])
            assert v.culprit_rank != 0, (proc, frames, v.summary)


@pytest.mark.parametrize(
    "evidence, own, words",
    [
        (
            [ev(0, IDLE, BACKWARD)],
            None,
            f"cannot tell from the local evidence: rank 0: {PROBABLY}; blocked in C (CPU 0%, state S) at "
            "_engine_run_backward",
        ),
        ([ev(0, IDLE, BACKWARD, native=REDUCER)], False, "local ranks were waiting in DDP reducer (rank 0)"),
        ([ev(0, IDLE, USER)], True, "rank 0: blocked in C (CPU 0%, state S) at _poll_shard_ready"),
        (
            [ev(0, IDLE, BACKWARD), ev(1, IDLE, USER)],
            True,
            "rank 1: blocked in C (CPU 0%, state S) at _poll_shard_ready",
        ),
        ([ev(0, IDLE, BACKWARD), ev(1, IDLE, stack(RANK0_ALL_REDUCE))], None, "cannot tell from the local evidence"),
    ],
)
def test_a_node_whose_ranks_probably_wait_in_backward_does_not_blame_itself(evidence, own, words):
    """Several nodes: each reads its own ranks; one that only probably waits (no C stack) is no culprit of the
    node's."""
    from hangwatch.supervisor.nodes.node_incident import local_findings, local_reading

    got_own, got_words, _ = local_reading(*local_findings(evidence))
    assert got_own is own and got_words.startswith(words), got_words
