"""The GPUs the worker will see (NVML's count narrowed by CUDA_VISIBLE_DEVICES, read as CUDA reads it), and the
refusal of more built-in ranks than that on CUDA: in `validate-config`/`run` (`config.deep`) and in the doctor.
NVML is faked: a list of UUIDs, None for a machine without it, or a stand-in `pynvml` module."""

from __future__ import annotations

import sys
import types

import pytest

from hangwatch.common import gpus
from hangwatch.common.config import deep, parse_config
from hangwatch.common.gpus import Placement, WorkerGpus, placement_problem, visible_count, worker_gpus

FOUR = [
    "GPU-1a2b3c4d-0000-0000-0000-000000000000",
    "GPU-1a2b9999-0000-0000-0000-000000000001",
    "GPU-5e6f7a8b-0000-0000-0000-000000000002",
    "GPU-9c0d1e2f-0000-0000-0000-000000000003",
]


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, 4),  # not set: every GPU
        ("", 0),  # set and empty: none
        ("-1", 0),
        ("0", 1),
        ("0,1,2,3", 4),
        (" 2 , 3", 2),  # CUDA trims each entry
        ("3,0", 2),  # any order
        ("0,-1,1", 1),  # the list ends at the first entry that names no device
        ("0,7,1", 1),  # an index past the machine's GPUs
        ("0,0,1", 1),  # a device listed twice
        ("0,,1", 1),
        ("x", 0),
        (FOUR[2], 1),  # a whole UUID
        ("GPU-5e6f", 1),  # a unique prefix
        ("GPU-1a2b", 0),  # a prefix two GPUs share names none
        ("GPU-1a2b3c,GPU-9c0d", 2),
        ("GPU-1a2b3c,0", 1),  # the same GPU by UUID and by index
        ("GPU-ffff", 0),  # not on this machine
        ("MIG-4f1c0b66-0000-0000-0000-000000000000", 1),  # a MIG instance: not NVML's device, counted unchecked
        ("1,MIG-a,MIG-b", 3),
    ],
)
def test_visible_count(value, expected):
    assert visible_count(value, FOUR) == expected


def test_a_machine_without_gpus_shows_none_whatever_is_set():
    assert [visible_count(v, []) for v in (None, "", "0", "GPU-1a2b")] == [0, 0, 0, 0]


@pytest.mark.parametrize(
    "environ, worker_env, expected",
    [
        ({}, {}, WorkerGpus(4, 4, None, "")),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, {}, WorkerGpus(2, 4, "0,1", "the environment")),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "3"}, WorkerGpus(1, 4, "3", "worker.env")),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": ""}, WorkerGpus(0, 4, "", "worker.env")),
    ],
)
def test_worker_env_is_laid_over_the_supervisors(environ, worker_env, expected):
    assert worker_gpus(environ, worker_env, FOUR) == expected


def test_without_nvml_nothing_is_known():
    assert worker_gpus({"CUDA_VISIBLE_DEVICES": "0"}, {}, None) is None


ONE_OF_FOUR = WorkerGpus(1, 4, "0", "worker.env")
TWO_OF_FOUR = WorkerGpus(2, 4, "0,1", "the environment")
ALL_FOUR = WorkerGpus(4, 4, None, "")
NONE_OF_FOUR = WorkerGpus(0, 4, "", "worker.env")
NO_GPU_MACHINE = WorkerGpus(0, 0, None, "")


@pytest.mark.parametrize(
    "device, nproc, seen, expected",
    [
        (
            "cuda",
            2,
            ONE_OF_FOUR,
            Placement(
                ("worker", "nproc_per_node"),
                "2, but the worker sees 1 GPU (CUDA_VISIBLE_DEVICES=0 in worker.env; NVML counts 4 on this machine): "
                "NCCL needs one GPU per rank",
                "set worker.nproc_per_node: 1 or make more GPUs visible",
            ),
        ),
        (
            "auto",
            4,
            TWO_OF_FOUR,
            Placement(
                ("worker", "nproc_per_node"),
                "4, but the worker sees 2 GPUs (CUDA_VISIBLE_DEVICES=0,1 in the environment; NVML counts 4 on this "
                "machine): NCCL needs one GPU per rank",
                "set worker.nproc_per_node: 2 or make more GPUs visible",
            ),
        ),
        (
            "cuda",
            8,
            ALL_FOUR,
            Placement(
                ("worker", "nproc_per_node"),
                "8, but the worker sees 4 GPUs (CUDA_VISIBLE_DEVICES not set; NVML counts 4 on this machine): NCCL "
                "needs one GPU per rank",
                "set worker.nproc_per_node: 4 or make more GPUs visible",
            ),
        ),
        (
            "cuda",
            1,
            NONE_OF_FOUR,
            Placement(
                ("model", "device"),
                "cuda, but the worker sees no GPU (CUDA_VISIBLE_DEVICES='' in worker.env; NVML counts "
                "4 on this machine)",
                "set model.device: cpu (or auto), or make a GPU visible",
            ),
        ),
        (
            "cuda",
            2,
            NO_GPU_MACHINE,
            Placement(
                ("model", "device"),
                "cuda, but the worker sees no GPU (CUDA_VISIBLE_DEVICES not set; NVML counts 0 on this machine)",
                "set model.device: cpu (or auto), or make a GPU visible",
            ),
        ),
        # enough GPUs
        ("cuda", 2, TWO_OF_FOUR, None),
        ("auto", 1, ONE_OF_FOUR, None),
        ("cuda", 2, ALL_FOUR, None),
        # the CPU: gloo, any number of ranks
        ("cpu", 8, ONE_OF_FOUR, None),
        ("auto", 2, NONE_OF_FOUR, None),  # auto with no GPU visible falls back to the CPU
        ("auto", 2, NO_GPU_MACHINE, None),
        # no NVML: nothing is known, nothing is refused
        ("cuda", 8, None, None),
    ],
)
def test_placement_problem(device, nproc, seen, expected):
    assert placement_problem(device, nproc, seen) == expected


# ---- validate-config / run: the deep check ------------------------------------------------------------------------


def config(device: str = "cuda", nproc: int = 2, worker_env: dict | None = None, command: list | None = None):
    env = "".join(f"    {k}: {v!r}\n" for k, v in (worker_env or {}).items())
    return parse_config(
        f"run_dir: /tmp/hw-gpus\ndata:\n  train: train.jsonl\nmodel:\n  device: {device}\n"
        f"worker:\n  nproc_per_node: {nproc}\n"
        + (f"  env:\n{env}" if env else "")
        + (f"  command: {command}\n" if command else ""),
        environ={},
    )


def gpu_errors(cfg, environ=None, uuids=FOUR) -> list:
    asked = []

    def nvml():
        asked.append(True)
        return uuids

    return [e for e in deep.gpu_placement(cfg, environ or {}, nvml)], bool(asked)


def test_more_ranks_than_visible_gpus_is_refused_with_both_numbers():
    errors, _ = gpu_errors(config(worker_env={"CUDA_VISIBLE_DEVICES": "0"}))
    assert errors == [
        (
            ("worker", "nproc_per_node"),
            "2, but the worker sees 1 GPU (CUDA_VISIBLE_DEVICES=0 in worker.env; NVML counts 4 on this "
            "machine): NCCL needs one GPU per rank; set worker.nproc_per_node: 1 or make more GPUs visible",
        )
    ]


def test_the_check_is_part_of_the_machine_checks():
    def placement(found) -> list:  # (train.jsonl is not there either: another finding)
        return [loc for loc, _ in found.errors if loc in (("worker", "nproc_per_node"), ("model", "device"))]

    assert placement(deep.check(config(worker_env={"CUDA_VISIBLE_DEVICES": "0"}), {}, lambda: FOUR)) == [
        ("worker", "nproc_per_node")
    ]
    assert placement(deep.check(config(), {"CUDA_VISIBLE_DEVICES": "0,1"}, lambda: FOUR)) == []


@pytest.mark.parametrize(
    "cfg, environ, uuids, asked",
    [
        (config(), {}, None, True),  # no NVML on this machine
        (config(), {"CUDA_VISIBLE_DEVICES": "2,3"}, FOUR, True),
        (config(device="auto"), {"CUDA_VISIBLE_DEVICES": ""}, FOUR, True),  # auto falls back to the CPU
        (config(device="cpu", nproc=4), {}, FOUR, False),  # gloo: NVML is not even asked
        (config(nproc=4, command=["torchrun", "train.py"]), {}, FOUR[:1], False),  # its backend is its own
    ],
)
def test_accepted(cfg, environ, uuids, asked):
    assert gpu_errors(cfg, environ, uuids) == ([], asked)


# ---- the doctor: the same refusal, as a FAIL ---------------------------------------------------------------------


def test_the_doctor_fails_the_placement_in_the_same_words():
    from hangwatch.daemon.doctor.findings import FAIL, OK, SKIP
    from hangwatch.daemon.doctor.runner import Doctor

    f = Doctor(
        config(worker_env={"CUDA_VISIBLE_DEVICES": "0"}), cheap=True, env={}, gpu_uuids=lambda: FOUR
    ).placement_finding()
    assert (f.status, f.fix) == (FAIL, "set worker.nproc_per_node: 1 or make more GPUs visible")
    assert f.summary == (
        "worker.nproc_per_node: 2, but the worker sees 1 GPU (CUDA_VISIBLE_DEVICES=0 in worker.env; "
        "NVML counts 4 on this machine): NCCL needs one GPU per rank"
    )
    f = Doctor(config(), cheap=True, env={"CUDA_VISIBLE_DEVICES": "1,3"}, gpu_uuids=lambda: FOUR).placement_finding()
    assert f.status == OK and "one per visible GPU" in f.summary
    f = Doctor(config(), cheap=True, env={}, gpu_uuids=lambda: None).placement_finding()
    assert f.status == SKIP and "no NVML" in f.summary


# ---- the NVML reader ---------------------------------------------------------------------------------------------


class NVMLError(Exception):
    pass


def fake_pynvml(uuids=None, init_error=None, uuid_error=False) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.shutdowns = 0

    def init():
        if init_error:
            raise NVMLError(init_error)

    def shutdown():
        m.shutdowns += 1

    def uuid(handle):
        if uuid_error:
            raise NVMLError("Not Supported")
        return uuids[handle].encode()

    m.nvmlInit, m.nvmlShutdown = init, shutdown
    m.nvmlDeviceGetCount = lambda: len(uuids)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = uuid
    return m


def test_nvml_lists_the_machines_gpus(monkeypatch):
    m = fake_pynvml(FOUR)
    monkeypatch.setitem(sys.modules, "pynvml", m)
    assert gpus.nvml_uuids() == FOUR and m.shutdowns == 1


def test_a_gpu_whose_uuid_cannot_be_read_still_counts(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(FOUR[:2], uuid_error=True))
    assert gpus.nvml_uuids() == ["", ""]


def test_no_driver_or_no_library_is_no_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(FOUR, init_error="Driver Not Loaded"))
    assert gpus.nvml_uuids() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert gpus.nvml_uuids() is None
