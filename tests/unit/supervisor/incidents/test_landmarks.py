"""The call a stuck stack is in: the deepest landmark (helpers yield to a long-running call around them), the user's
frame that called it, the outermost frame of the user's code, the innermost frame — wherever the sample landed."""

from __future__ import annotations

import pytest

from hangwatch.common.config import parse_config
from hangwatch.supervisor.incidents import main_stack
from hangwatch.supervisor.incidents.landmarks import HANGWATCH_DAEMON_DIR, is_own_code, read_stack, user_landmarks

SP = "/venv/lib/python3.11/site-packages"
LIB = "/usr/lib/python3.11"
TRAIN = "/srv/job/train.py"


def fr(file: str, function: str, line: int = 1) -> dict:
    return {"file": file, "line": line, "function": function}


# What faulthandler showed in the middle of a tiny Llama's generate() (transformers 5.x), called from the user's
# Trainer callback; outermost first here, reversed below into a stack (innermost first).
GENERATE_OUTER_FIRST = [
    fr(TRAIN, "<module>", 80),
    fr(TRAIN, "main", 70),
    fr(f"{SP}/transformers/trainer.py", "train", 2200),
    fr(f"{SP}/transformers/trainer_callback.py", "call_event", 500),
    fr(TRAIN, "on_evaluate", 46),
    fr(f"{SP}/torch/utils/_contextlib.py", "decorate_context", 124),
    fr(f"{SP}/transformers/generation/utils.py", "generate", 3007),
    fr(f"{SP}/transformers/generation/utils.py", "_sample", 3235),
]
FORWARD = [  # outermost first: the model's forward down to attention
    fr(f"{SP}/torch/nn/modules/module.py", "_wrapped_call_impl", 1778),
    fr(f"{SP}/torch/nn/modules/module.py", "_call_impl", 1789),
    fr(f"{SP}/transformers/utils/generic.py", "wrapper", 943),
    fr(f"{SP}/transformers/models/llama/modeling_llama.py", "forward", 456),
    fr(f"{SP}/transformers/modeling_layers.py", "forward_with_checkpointing", 121),  # not a checkpoint save
    fr(f"{SP}/transformers/models/llama/modeling_llama.py", "forward", 257),
    fr(f"{SP}/transformers/integrations/sdpa_attention.py", "sdpa_attention_forward", 193),
]
STOPPING_BEAT = [  # a stopping criterion that beats progress through hangwatch's heartbeat
    fr(f"{SP}/transformers/generation/stopping_criteria.py", "__call__", 500),
    fr(f"{HANGWATCH_DAEMON_DIR}/integrations/transformers.py", "__call__", 90),
    fr(f"{HANGWATCH_DAEMON_DIR}/heartbeat.py", "progress", 180),
    fr(f"{HANGWATCH_DAEMON_DIR}/heartbeat.py", "emit", 150),
]
STREAMER_DECODE = [
    fr(f"{SP}/transformers/generation/streamers.py", "put", 100),
    fr(f"{SP}/transformers/tokenization_utils_base.py", "decode", 2884),
    fr(f"{SP}/transformers/tokenization_utils_tokenizers.py", "_decode", 1150),
]
TP_ALL_REDUCE = [
    fr(f"{SP}/torch/distributed/distributed_c10d.py", "all_reduce", 3252),
    fr(f"{SP}/torch/distributed/c10d_logger.py", "wrapper", 83),
][::-1]


def stack(*outer_first: list) -> list[dict]:
    return [f for part in outer_first for f in part][::-1]


def gen(*inner: list) -> list[dict]:
    return stack(GENERATE_OUTER_FIRST, *inner)


LOADER = stack(
    [
        fr(TRAIN, "<module>", 61),
        fr(TRAIN, "main", 30),
        fr(f"{SP}/torch/utils/data/dataloader.py", "__next__", 741),
        fr(f"{SP}/torch/utils/data/dataloader.py", "_next_data", 1469),
        fr(f"{SP}/torch/utils/data/dataloader.py", "_get_data", 1431),
        fr(f"{SP}/torch/utils/data/dataloader.py", "_try_get_data", 1284),
        fr(f"{LIB}/multiprocessing/queues.py", "get", 113),
        fr(f"{LIB}/multiprocessing/connection.py", "poll", 257),
        fr(f"{LIB}/selectors.py", "select", 415),
    ]
)
SAVE = stack(
    [
        fr(TRAIN, "main", 90),
        fr(f"{SP}/transformers/trainer.py", "_save_checkpoint", 3100),
        fr(f"{SP}/transformers/trainer.py", "save_model", 3900),
        fr(f"{SP}/transformers/modeling_utils.py", "save_pretrained", 3300),
        fr(f"{SP}/torch/serialization.py", "save", 960),
        fr(f"{SP}/torch/serialization.py", "_save", 1200),
    ]
)
BACKWARD = stack(
    [
        fr(TRAIN, "main", 52),
        fr(TRAIN, "train_step", 40),
        fr(f"{SP}/torch/_tensor.py", "backward", 625),
        fr(f"{SP}/torch/autograd/__init__.py", "backward", 354),
        fr(f"{SP}/torch/autograd/graph.py", "_engine_run_backward", 829),
    ]
)
ACT_CHECKPOINT_IN_BACKWARD = stack(
    [
        fr(TRAIN, "train_step", 40),
        fr(f"{SP}/torch/autograd/graph.py", "_engine_run_backward", 829),
        fr(f"{SP}/torch/utils/checkpoint.py", "checkpoint", 480),
        fr(f"{SP}/torch/utils/checkpoint.py", "unpack_hook", 1100),
    ]
)
ADAM = stack(
    [
        fr(TRAIN, "train_step", 44),
        fr(f"{SP}/torch/optim/optimizer.py", "wrapper", 485),
        fr(f"{SP}/torch/optim/adam.py", "step", 247),
        fr(f"{SP}/torch/optim/adam.py", "adam", 900),
        fr(f"{SP}/torch/optim/adam.py", "_single_tensor_adam", 400),
    ]
)
SCHEDULER = stack([fr(TRAIN, "train_step", 45), fr(f"{SP}/torch/optim/lr_scheduler.py", "step", 200)])
TOKENIZE = stack(
    [
        fr(TRAIN, "main", 20),
        fr(TRAIN, "build_dataset", 12),
        fr(f"{SP}/transformers/tokenization_utils_base.py", "__call__", 2449),
        fr(f"{SP}/transformers/tokenization_utils_tokenizers.py", "_encode_plus", 972),
    ]
)
SPIN = stack([fr(TRAIN, "<module>", 61), fr(TRAIN, "main", 52), fr(TRAIN, "_poll_shard_ready", 88)])
SOCKET = stack([fr(TRAIN, "<module>", 61), fr(TRAIN, "wait_for_peer", 12), fr(f"{LIB}/socket.py", "recv_into", 700)])
ASYNC_WAIT = stack([fr(TRAIN, "<module>", 61), fr(TRAIN, "main", 57)])
MYLIB = stack(
    [fr(TRAIN, "main", 30), fr("/srv/job/mylib/io.py", "fetch_batch", 9), fr(f"{LIB}/socket.py", "recv_into", 700)]
)

CASES = [
    # name, stack, native, source line, landmark (name, kind), caller, summary
    (
        "generate, sampled in attention",
        gen(FORWARD),
        (),
        None,
        ("generate", "generate"),
        "on_evaluate",
        "in generate(), called from on_evaluate (train.py:46); innermost sdpa_attention_forward",
    ),
    (
        "generate, sampled in hangwatch's own beat inside a stopping criterion",
        gen(STOPPING_BEAT),
        (),
        None,
        ("generate", "generate"),
        "on_evaluate",
        "in generate(), called from on_evaluate (train.py:46); innermost emit",
    ),
    (
        "generate, sampled in a streamer's decode: the helper yields",
        gen(STREAMER_DECODE),
        (),
        None,
        ("generate", "generate"),
        "on_evaluate",
        "in generate(), called from on_evaluate (train.py:46); innermost _decode",
    ),
    (
        "a collective inside generate is a real wait",
        gen(FORWARD[:3], TP_ALL_REDUCE),
        (),
        None,
        ("all_reduce", "collective"),
        "on_evaluate",
        "in all_reduce(), called from on_evaluate (train.py:46); innermost all_reduce",
    ),
    (
        "the user's own tokenizer call, no long-running call around it",
        TOKENIZE,
        (),
        None,
        ("tokenizer.__call__", "tokenizer"),
        "build_dataset",
        None,
    ),
    (
        "the DataLoader waiting for its workers",
        LOADER,
        (),
        None,
        ("DataLoader.__next__", "dataloader"),
        "main",
        "in DataLoader.__next__(), called from main (train.py:30); innermost select",
    ),
    (
        "a checkpoint save: the deepest of torch.save / save_pretrained / Trainer",
        SAVE,
        (),
        None,
        ("torch.save", "checkpoint"),
        "main",
        None,
    ),
    ("backward", BACKWARD, (), None, ("backward", "backward"), "train_step", None),
    (
        "activation checkpointing is not a checkpoint save",
        ACT_CHECKPOINT_IN_BACKWARD,
        (),
        None,
        ("backward", "backward"),
        "train_step",
        None,
    ),
    (
        "optimizer.step, sampled in adam's inner function",
        ADAM,
        (),
        None,
        ("optimizer.step", "optimizer"),
        "train_step",
        None,
    ),
    (
        "an LR scheduler's step is no optimizer step",
        SCHEDULER,
        (),
        None,
        None,
        "train_step",
        "no landmark call on the stack; your code at train_step (train.py:45); innermost step (lr_scheduler.py:200)",
    ),
    (
        "DDP's reducer, seen in py-spy's native frames, is deeper than backward",
        BACKWARD,
        ("c10d::Reducer::finalize_backward (libtorch_cpu.so)",),
        None,
        ("DDP reducer", "collective"),
        "train_step",
        "in DDP reducer, called from train_step (train.py:40); innermost _engine_run_backward",
    ),
    (
        "work.wait() on the user's line: a C wait with no frame of its own",
        ASYNC_WAIT,
        (),
        "work.wait()",
        ("wait", "collective"),
        "main",
        "in wait(), called from main (train.py:57); innermost main",
    ),
    (
        "no landmark: the user's own spin",
        SPIN,
        (),
        None,
        None,
        "_poll_shard_ready",
        "no landmark call on the stack; innermost _poll_shard_ready (train.py:88), your own code",
    ),
    (
        "no landmark: blocked in the standard library",
        SOCKET,
        (),
        None,
        None,
        "wait_for_peer",
        "no landmark call on the stack; your code at wait_for_peer (train.py:12); innermost recv_into (socket.py:700)",
    ),
]


@pytest.mark.parametrize("name, frames, native, line, landmark, caller, summary", CASES, ids=[c[0] for c in CASES])
def test_the_landmark_and_the_users_caller(name, frames, native, line, landmark, caller, summary):
    r = read_stack(frames, native=native, source_line=line)
    assert (r.landmark["name"], r.landmark["kind"]) == landmark if landmark else r.landmark is None, r.landmark
    assert r.caller_frame["function"] == caller
    assert r.innermost_frame is frames[0]
    if summary:
        assert r.summary().startswith(summary), r.summary()
    if r.landmark and r.landmark["depth"] >= 0:  # the caller is OUTER to the landmark
        assert frames.index(r.caller_frame) > r.landmark["depth"]


def test_wherever_a_sample_lands_inside_generate_it_reads_generate():
    """Every depth a sample can land at under generate (forward, attention, a stopping criterion's beat, a
    streamer's decode): the innermost frames cut at each point in turn, the landmark and the caller never change."""
    for inner in (FORWARD, STOPPING_BEAT, STREAMER_DECODE):
        for cut in range(len(inner) + 1):
            r = read_stack(gen(inner[:cut]))
            assert (r.landmark["name"], r.caller_frame["function"]) == ("generate", "on_evaluate"), (inner[:cut], r)
            assert r.user_outermost_frame == fr(TRAIN, "<module>", 80)


def test_peft_wrapping_generate_reads_generate_and_the_deepest_frame_is_the_landmarks():
    peft = stack(
        GENERATE_OUTER_FIRST[:5], [fr(f"{SP}/peft/peft_model.py", "generate", 2229)], GENERATE_OUTER_FIRST[5:], FORWARD
    )
    r = read_stack(peft)
    assert r.landmark["name"] == "generate" and r.landmark["frame"]["function"] == "_sample"
    assert r.fields()["landmark"]["frame"] == fr(f"{SP}/transformers/generation/utils.py", "_sample", 3235)
    assert r.caller_frame["function"] == "on_evaluate"


def test_a_truncated_stack_keeps_its_deepest_landmark_and_says_so():
    text = (
        "Current thread 0x1 (most recent call first):\n"
        + "".join(f'  File "{f["file"]}", line {f["line"]} in {f["function"]}\n' for f in (gen(FORWARD) * 10)[:100])
        + "  ...\n"
    )
    frames, truncated = main_stack(text)
    r = read_stack(frames, truncated=truncated)
    assert r.landmark["name"] == "generate" and r.truncated and r.fields()["stack_truncated"] is True
    assert r.summary().endswith("stack truncated to its innermost 100 frames")
    deep = read_stack(gen(FORWARD)[:10], truncated=True)  # cut below on_evaluate: no caller left to name
    assert deep.caller_frame is None and "beyond the 100 frames" in deep.summary()


def test_user_landmarks_from_the_config_come_before_the_builtins():
    cfg = parse_config(
        "worker: {command: [python, train.py]}\nwatchdog:\n  landmarks:\n"
        "    - {function: fetch_batch, file: mylib/io.py, name: shard fetch, kind: dataloader}\n"
        "    - {function: Scorer.score}\n"
    )
    extra = user_landmarks(cfg.watchdog.landmarks)
    r = read_stack(MYLIB, extra=extra)
    assert r.landmark == {"name": "shard fetch", "kind": "dataloader", "frame": MYLIB[1], "depth": 1, "via": "stack"}
    assert r.caller_frame["function"] == "main"  # mylib/io.py is the user's code, but it is the landmark itself
    elsewhere = [fr("/srv/other/io.py", "fetch_batch")] + MYLIB[2:]
    assert read_stack(elsewhere, extra=extra).landmark is None  # the file does not match
    # Class.method: a faulthandler frame (bare name) matches, a py-spy frame must be that class's method
    assert read_stack([fr(TRAIN, "score")], extra=extra).landmark["name"] == "Scorer.score"
    assert read_stack([fr(TRAIN, "Scorer.score")], extra=extra).landmark["kind"] == "other"
    assert read_stack([fr(TRAIN, "Ranker.score")], extra=extra).landmark is None
    assert user_landmarks([{"function": "poll", "kind": "collective"}])[0].name == "poll"


@pytest.mark.parametrize(
    "path, own",
    [
        (TRAIN, True),
        ("train.py", True),  # py-spy shortens the user's files too
        (f"{SP}/torch/nn/modules/module.py", False),
        ("/usr/lib/python3/dist-packages/yaml/x.py", False),
        (f"{LIB}/threading.py", False),
        ("<frozen runpy>", False),
        ("<string>", False),
        ("torch/distributed/distributed_c10d.py", False),
        ("threading.py", False),
        ("multiprocessing/queues.py", False),
        (f"{HANGWATCH_DAEMON_DIR}/heartbeat.py", False),
        (f"{HANGWATCH_DAEMON_DIR}/integrations/transformers.py", False),
        (f"{HANGWATCH_DAEMON_DIR}/evaluate.py", True),  # the built-in worker is the code the user runs
        (f"{SP}/hangwatch/daemon/heartbeat.py", False),
        (f"{SP}/hangwatch/daemon/trainer/loop.py", True),
        ("hangwatch/daemon/integrations/lightning.py", False),
        (None, False),
    ],
)
def test_what_counts_as_the_users_own_code(path, own):
    assert is_own_code(path) is own


def test_no_stack_reads_as_none():
    r = read_stack([])
    assert r.landmark is None and r.innermost_frame is None and r.summary() == "no stack: the process wrote no dump"
    assert r.fields() == {
        "landmark": None,
        "caller_frame": None,
        "user_outermost_frame": None,
        "stack_truncated": False,
    }
