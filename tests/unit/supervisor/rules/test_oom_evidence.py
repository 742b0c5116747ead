"""OOM remediation's evidence-based pick: torch's out-of-memory message parsed (a table of real-shaped messages),
the decision from the evidence (one pick; the ladder when the evidence is missing or does not hold together;
gradient checkpointing when nothing fits; the effective batch kept; divisors; the margin), the worker's last words
carrying the `memory` object (torch.cuda faked through the probe's seam), and the `memory_limit` fault's fake
allocator end to end in process: one restart, at the predicted micro-batch, the same examples per optimizer step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hangwatch.common.oom_ladder import Rung as Setting
from hangwatch.daemon.faults import FakeAllocator, format_size, oom_message
from hangwatch.daemon.lastwords import last_words_for
from hangwatch.daemon.trainer import memory_evidence as memory
from hangwatch.supervisor.concerns.oom_recovery import OomRemediation
from hangwatch.supervisor.records import healing, memory_evidence
from hangwatch.supervisor.rules import oom_evidence as ev
from hangwatch.supervisor.rules import oom_remediation as rem
from hangwatch.supervisor.rules.oom_evidence import Evidence, parse_oom_message

GIB = 1024.0
TAIL = (
    " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
    "avoid fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


@pytest.fixture(autouse=True)
def _nothing_noted():
    memory.forget()
    yield
    memory.forget()


# ---- the message ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        pytest.param(  # torch 2.x, capped by set_per_process_memory_fraction
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of "
            "79.10 GiB of which 75.02 GiB is free. Including non-PyTorch memory, this process has 3.95 GiB memory in "
            "use. 4.00 GiB allowed; Of the allocated memory 3.61 GiB is allocated by PyTorch, and 20.00 MiB is "
            "reserved by PyTorch but unallocated." + TAIL,
            {
                "tried_mb": 512.0,
                "gpu": 0,
                "total_mb": 79.10 * GIB,
                "free_mb": 75.02 * GIB,
                "in_use_mb": 3.95 * GIB,
                "allowed_mb": 4096.0,
                "allocated_mb": 3.61 * GIB,
                "unallocated_mb": 20.0,
                "reserved_mb": 3.61 * GIB + 20.0,
            },
            id="capped",
        ),
        pytest.param(  # not capped; another process on the device; GPU 3
            "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.10 GiB "
            "of which 1.02 GiB is free. Process 4242 has 10.00 GiB memory in use. Including non-PyTorch memory, this "
            "process has 68.06 GiB memory in use. Of the allocated memory 65.31 GiB is allocated by PyTorch, and 1.93 "
            "GiB is reserved by PyTorch but unallocated." + TAIL,
            {
                "tried_mb": 2048.0,
                "gpu": 3,
                "total_mb": 79.10 * GIB,
                "free_mb": 1.02 * GIB,
                "in_use_mb": 68.06 * GIB,
                "others_mb": 10.0 * GIB,
                "allocated_mb": 65.31 * GIB,
                "unallocated_mb": 1.93 * GIB,
                "reserved_mb": (65.31 + 1.93) * GIB,
            },
            id="uncapped",
        ),
        pytest.param(  # bytes and KiB; no NVML (no per-process line)
            "CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has a total capacity of 15.77 GiB of which 20.00 "
            "KiB is free. Of the allocated memory 14.90 GiB is allocated by PyTorch, and 1.00 KiB is reserved by "
            "PyTorch but unallocated." + TAIL,
            {
                "tried_mb": 512 / 1048576,
                "gpu": 0,
                "total_mb": 15.77 * GIB,
                "free_mb": 20.0 / 1024,
                "allocated_mb": 14.90 * GIB,
                "unallocated_mb": 1.0 / 1024,
                "reserved_mb": 14.90 * GIB + 1.0 / 1024,
            },
            id="bytes-KiB",
        ),
        # CUDA graphs' private pools; torch's generic allocator says "Out of memory" and PYTORCH_ALLOC_CONF
        pytest.param(
            "Out of memory. Tried to allocate 1.50 GiB. GPU 1 has a total capacity of 39.38 GiB of which 300.00 MiB is "
            "free. Including non-PyTorch memory, this process has 39.07 GiB memory in use. 38.00 GiB allowed; Of the "
            "allocated memory 36.00 GiB is allocated by PyTorch, with 2.00 GiB allocated in private pools (e.g., CUDA "
            "Graphs), and 500.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is "
            "large try setting PYTORCH_ALLOC_CONF=expandable_segments:True to avoid fragmentation.",
            {
                "tried_mb": 1.5 * GIB,
                "gpu": 1,
                "total_mb": 39.38 * GIB,
                "free_mb": 300.0,
                "in_use_mb": 39.07 * GIB,
                "allowed_mb": 38.0 * GIB,
                "allocated_mb": 36.0 * GIB,
                "unallocated_mb": 500.0,
                "reserved_mb": 36.0 * GIB + 500.0,
            },
            id="private-pools",
        ),
        pytest.param(  # torch 1.x
            "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB "
            "already allocated; 3.44 MiB free; 14.71 GiB reserved in total by PyTorch) If reserved memory is >> "
            "allocated memory try setting max_split_size_mb to avoid fragmentation.",
            {
                "tried_mb": 20.0,
                "gpu": 0,
                "total_mb": 15.78 * GIB,
                "allocated_mb": 14.56 * GIB,
                "free_mb": 3.44,
                "reserved_mb": 14.71 * GIB,
            },
            id="torch1",
        ),
        pytest.param(
            "CUDA out of memory. Tried to allocate 64.00 MiB (GPU 0; 7.79 GiB total capacity; 4.13 GiB already "
            "allocated; 2.56 MiB free; 4.23 GiB allowed; 4.22 GiB reserved in total by PyTorch)",
            {
                "tried_mb": 64.0,
                "gpu": 0,
                "total_mb": 7.79 * GIB,
                "allocated_mb": 4.13 * GIB,
                "free_mb": 2.56,
                "allowed_mb": 4.23 * GIB,
                "reserved_mb": 4.22 * GIB,
            },
            id="torch1-allowed",
        ),
        pytest.param(
            "OutOfMemoryError: injected fault: CUDA out of memory at step 5 (tried to allocate 20.00 GiB)",
            None,
            id="injected-fault",
        ),
        pytest.param(
            "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
            None,
            id="cuda-error",
        ),
        pytest.param("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total", None, id="truncated"),
        pytest.param(
            "CUDA out of memory. Tried to allocate 2.00 TiB. GPU 0 has a total capacity of 79.10 GiB of which 1.02 GiB "
            "is free.",
            None,
            id="unknown-unit",
        ),
        pytest.param("", None, id="empty"),
        pytest.param(None, None, id="none"),
    ],
)
def test_parse_oom_message(text, expected):
    got = parse_oom_message(text)
    if expected is None:
        assert got is None
        return
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key


def test_format_size_is_torchs_and_the_fake_message_parses_back():
    assert [format_size(n) for n in (0, 512, 1024, 1025, 20 * 1024, 1 << 20, 3 * (1 << 30) // 2)] == [
        "0 bytes",
        "512 bytes",
        "1024 bytes",
        "1.00 KiB",
        "20.00 KiB",
        "1024.00 KiB",
        "1.50 GiB",
    ]
    text = oom_message(
        tried_mb=1500.0,
        total_mb=81559.0,
        free_mb=80000.0,
        in_use_mb=1212.0,
        allocated_mb=700.0,
        reserved_mb=720.0,
        allowed_mb=4096.0,
    )
    assert "1.18 GiB memory in use. 4.00 GiB allowed; Of the allocated memory 700.00 MiB" in text
    got = parse_oom_message("OutOfMemoryError: " + text)
    assert got["allowed_mb"] == 4096.0 and got["allocated_mb"] == 700.0
    assert got["tried_mb"] == pytest.approx(1500, abs=5.12)  # format_size's 2 decimals of GiB
    assert got["unallocated_mb"] == 20.0
    assert "allowed" not in oom_message(tried_mb=1, total_mb=2, free_mb=1, in_use_mb=1, allocated_mb=1, reserved_mb=1)


# ---- the decision --------------------------------------------------------------------------------------------


def cfg(micro=16, accum=1, gc=False):
    return SimpleNamespace(
        train=SimpleNamespace(micro_batch_size=micro, grad_accum=accum),
        model=SimpleNamespace(gradient_checkpointing=gc),
        worker=SimpleNamespace(command=None),
        restart=SimpleNamespace(oom_remediation=True),
    )


def evidence(
    micro=16, weights=700.0, tried=16000.0, allocated=None, allowed=4096.0, total=81559.0, message=True, **memory_extra
) -> Evidence:
    """A capped device's OOM: the torch message, and the worker's `memory` object."""
    allocated = (700.0 if weights is None else weights) if allocated is None else allocated
    text = (
        oom_message(
            tried_mb=tried,
            total_mb=total,
            free_mb=total - allocated - 512,
            in_use_mb=allocated + 512,
            allocated_mb=allocated,
            reserved_mb=allocated,
            allowed_mb=allowed,
        )
        if message
        else "injected fault: CUDA out of memory at step 3 (tried to allocate 20.00 GiB)"
    )
    mem = {
        "micro_batch_size": micro,
        "device": "cuda:0",
        "weights_mb": weights,
        "loading_peak_mb": weights,
        "total_mb": total,
        "allocated_mb": allocated,
        "peak_mb": allocated,
        **memory_extra,
    }
    if allowed is not None:
        mem["allowed_mb"] = allowed
    return Evidence(0, "OutOfMemoryError: " + text, {k: v for k, v in mem.items() if v is not None})


def test_the_first_oom_restarts_one_rung_down_and_asks_the_new_process_to_measure():
    remedy = rem.decide(None, cfg(16, 1), evidence())
    # the ladder's next rung at most; the new process measures before training and may go lower at once
    assert remedy.basis == "probe" and remedy.to == Setting(8, 2) and remedy.to.effective == 16
    assert "measures one step at micro-batch 1" in remedy.message
    # the message's figures are said as what they are: a lower bound, not a pick
    assert "a lower bound" in remedy.message and "at least 16.3 GiB were needed at micro-batch 16" in remedy.message
    assert remedy.evidence["lower_bound"] is True and remedy.evidence["need_from"] == "oom"
    record = rem.applied(None, cfg(16, 1), remedy, attempt=1, step=3, incident="0001", now=0.0)
    assert record["probe"] == {"at_most": 8, "incident": "0001"}
    assert record["history"][0]["basis"] == "probe" and rem.current(record, cfg(16, 1)) == Setting(8, 2)


@pytest.mark.parametrize(
    "e",
    [
        None,
        Evidence(
            0, "OutOfMemoryError: injected fault: CUDA out of memory at step 3 (tried to allocate 20.00 GiB)", None
        ),
        Evidence(0, None, {"micro_batch_size": 4, "device": "cpu"}),
        evidence(4, weights=None),
        evidence(8),  # made at another micro-batch than the setting's
        Evidence(0, evidence(4).message, evidence(4).memory, phase="eval"),
        evidence(4, 700.0, 100.0, allowed=4096.0),  # would fit: inconsistent
    ],
)
def test_without_usable_figures_the_first_oom_still_restarts_one_rung_down_and_measures(e):
    remedy = rem.decide(None, cfg(4, 2), e)
    assert remedy.basis == "probe" and remedy.to == Setting(2, 4) and remedy.evidence is None
    assert "lower bound" not in remedy.message


def test_the_fake_devices_oom_says_less_than_the_need_as_cudas_does():
    """An OOM is raised at the first allocation that does not fit: allocated + requested is below the step's need."""
    import torch

    fault = SimpleNamespace(weights_mb=700.0, per_example_mb=1000.0, capacity_mb=4096.0, at_step=None)
    fake = FakeAllocator(fault, SimpleNamespace(warn=lambda *a, **k: None))
    with pytest.raises(torch.OutOfMemoryError) as info:
        fake.allocate(16 * 1000.0)
    got = parse_oom_message(str(info.value))
    need = 700.0 + 16 * 1000.0
    assert got["allocated_mb"] + got["tried_mb"] < need
    assert got["allocated_mb"] + got["tried_mb"] > fault.capacity_mb  # the piece that did not fit
    est, _ = ev.estimate(
        Evidence(
            0,
            "OutOfMemoryError: " + str(info.value),
            {"micro_batch_size": 16, "device": "cuda:0", "weights_mb": 700.0, "allowed_mb": 4096.0},
        ),
        16,
    )
    assert est is not None and est.per_example_mb < 1000.0  # what a pick from it would have taken for the cost


def test_later_ooms_and_micro_batch_one_take_the_ladder():
    first = rem.decide(None, cfg(16, 1), evidence())
    record = rem.applied(None, cfg(16, 1), first, attempt=1, step=3, incident="a", now=0.0)
    again = rem.decide(record, cfg(16, 1), evidence(8, tried=2000.0))  # the rung still ran out of memory
    assert (
        again.basis == "ladder" and again.to == Setting(4, 4) and "the ladder goes on from micro-batch 8" in again.why
    )
    record = rem.applied(record, cfg(16, 1), again, attempt=2, step=3, incident="b", now=0.0)
    assert [h["basis"] for h in record["history"]] == ["probe", "ladder"] and "probe" not in record
    one = rem.decide(None, cfg(1, 8), evidence(1, tried=1000.0))
    assert one.basis == "ladder" and one.to == Setting(1, 8, True) and "micro-batch 1 already" in one.why


def test_the_measure_is_recorded_once_and_only_when_it_keeps_the_effective_batch():
    record = rem.applied(None, cfg(16, 1), rem.decide(None, cfg(16, 1), evidence()), attempt=1, step=3, incident="a")
    to = {"micro_batch_size": 2, "grad_accum": 8, "gradient_checkpointing": False}
    result = {"picked": 2, "to": to, "weights_mb": 700.0, "per_example_mb": 1000.0, "capacity_mb": 4096.0}
    after = rem.measured(record, cfg(16, 1), result, attempt=2, now=1.0)
    assert "probe" not in after and rem.current(after, cfg(16, 1)) == Setting(2, 8)
    assert after["history"][-1]["basis"] == "measured" and after["history"][-1]["incident"] == "a"
    assert after["history"][-1]["evidence"]["per_example_mb"] == 1000.0
    # nothing measured (the CPU), or a pick that would change the effective batch: the probe is done, nothing else
    for r in ({"picked": None, "why": "no memory figures"}, {"picked": 3, "to": {**to, "micro_batch_size": 3}}):
        kept = rem.measured(record, cfg(16, 1), r, attempt=2)
        assert "probe" not in kept and rem.current(kept, cfg(16, 1)) == Setting(8, 2) and len(kept["history"]) == 1


def test_oom_recovery_reads_the_failing_ranks_evidence_and_remedies_once(tmp_path):
    from fixtures.deciding import RecordingFs, decided

    from hangwatch.supervisor.concerns import RunContext
    from hangwatch.supervisor.concerns.oom_recovery import OomRecovery
    from hangwatch.supervisor.escalation.episode import Episode
    from hangwatch.supervisor.incidents import IncidentStore
    from hangwatch.supervisor.rules.policy import Decision

    e = evidence(16)
    attempt = tmp_path / "attempts" / "0001"
    attempt.mkdir(parents=True)
    (attempt / "exit.json").write_text(
        json.dumps({"kind": "oom", "message": "OutOfMemoryError: x"})
    )  # rank 0: a victim
    (attempt / "exit-rank1.json").write_text(
        json.dumps({"kind": "oom", "message": e.message, "memory": e.memory, "rank": 1})
    )
    store = IncidentStore(tmp_path)
    inc = store.create("oom", step=3, culprit_rank=1)
    concern = OomRecovery(RunContext(cfg(16, 1), tmp_path, None, store, None, None))
    episode = Episode("oom", inc, 0.0)
    restart, fs = Decision("restart", "worker exited with code 1"), RecordingFs()
    # asked once, when the tree is gone, through the owner: it writes the record, the incident is saved after it
    got = decided([concern], SimpleNamespace(number=1), episode, restart, 0.0, fs=fs, store=store)
    assert got.action == "restart" and "at micro-batch 8 at most" in got.reason and episode.decision is got
    on_disk = json.loads((inc.dir / "incident.json").read_text())  # saved through the store
    assert on_disk["remediation"]["basis"] == "probe" and inc.data["remediation"] == on_disk["remediation"]
    assert on_disk["remediation"]["evidence"]["micro_batch_size"] == 16  # rank 1's figures, not the victim's
    saved = healing.load(tmp_path)
    assert (saved["micro_batch_size"], saved["grad_accum"]) == (8, 2) and saved["history"][0]["basis"] == "probe"
    # the remedy applied once: one write of the record, one step in its history
    assert fs.written == [healing.path_for(tmp_path)]
    assert len(healing.load(tmp_path)["history"]) == 1


# ---- the worker's evidence -----------------------------------------------------------------------------------

MIB = 1 << 20


class FakeCuda:
    """torch.cuda's memory queries, as the worker's probe reads them (bytes)."""

    def __init__(self, allocated=700, peak=1400, reserved=720, free=70000, total=81559, fraction=0.05, broken=()):
        self.values = {"allocated": allocated, "peak": peak, "reserved": reserved, "free": free, "total": total}
        self.fraction, self.broken = fraction, set(broken)

    def _get(self, name):
        if name in self.broken:
            raise RuntimeError(f"CUDA error: {name}")
        return self.values[name] * MIB

    def memory_allocated(self, device):
        return self._get("allocated")

    def max_memory_allocated(self, device):
        return self._get("peak")

    def memory_reserved(self, device):
        return self._get("reserved")

    def mem_get_info(self, device):
        return self._get("free"), self._get("total")

    def get_device_properties(self, device):
        return SimpleNamespace(total_memory=self._get("total"))

    def get_per_process_memory_fraction(self, device):
        return self.fraction


def cuda0():
    import torch

    return torch.device("cuda", 0)


def oom(text="CUDA out of memory. Tried to allocate 2.00 GiB."):
    import torch

    return torch.OutOfMemoryError(text)


def test_last_words_of_an_oom_carry_the_memory_figures(tmp_path):
    fake = FakeCuda()
    memory.note_model(cuda0(), 16, probe=memory.CudaProbe(fake))
    fake.values.update(allocated=3700, peak=3710, reserved=3900, free=60000)  # at the failure
    kind, code, path = last_words_for(oom(), tmp_path, 1, step=3)
    words = json.loads(path.read_text())
    assert kind == "oom" and words["memory"] == {
        "micro_batch_size": 16,
        "device": "cuda:0",
        "weights_mb": 700.0,
        "loading_peak_mb": 1400.0,
        "total_mb": 81559.0,
        "allowed_mb": round(0.05 * 81559, 1),
        "allocated_mb": 3700.0,
        "peak_mb": 3710.0,
        "reserved_mb": 3900.0,
        "free_mb": 60000.0,
    }


def test_evidence_gathering_never_raises_and_leaves_out_what_it_cannot_read(tmp_path):
    fake = FakeCuda(fraction=1.0, broken={"reserved"})  # not capped; one figure unreadable
    memory.note_model(cuda0(), 8, probe=memory.CudaProbe(fake))
    mem = json.loads(last_words_for(oom(), tmp_path, 1)[2].read_text())["memory"]
    assert "allowed_mb" not in mem and "reserved_mb" not in mem and mem["allocated_mb"] == 700.0

    class Broken:
        def figures(self, device):
            raise RuntimeError("the device is gone")

    memory.note_model(cuda0(), 8, probe=Broken())
    mem = json.loads(last_words_for(oom(), tmp_path, 2)[2].read_text())["memory"]
    assert mem == {"micro_batch_size": 8, "device": "cuda:0"}


def test_cpu_and_other_failures(tmp_path):
    import torch

    kind, _, path = last_words_for(oom(), tmp_path, 1)  # nothing noted (no trainer yet): no memory object
    assert kind == "oom" and "memory" not in json.loads(path.read_text())
    memory.note_model(torch.device("cpu"), 4)  # the CPU: no CUDA figures, the message is all there is
    assert json.loads(last_words_for(oom(), tmp_path, 2)[2].read_text())["memory"] == {
        "micro_batch_size": 4,
        "device": "cpu",
    }
    kind, _, path = last_words_for(RuntimeError("boom"), tmp_path, 3)
    assert kind == "crash" and "memory" not in json.loads(path.read_text())


def test_fake_allocator_is_a_probe_and_raises_torchs_oom():
    import torch

    fault = SimpleNamespace(weights_mb=700.0, per_example_mb=1000.0, capacity_mb=4096.0, at_step=None)
    fake = FakeAllocator(fault, SimpleNamespace(warn=lambda *a, **k: None))
    fake.allocate(3 * 1000.0)
    assert fake.figures(None)["peak_mb"] == 3700.0 and fake.figures(None)["allocated_mb"] == 700.0
    fake.reset_peak()
    assert fake.figures(None)["peak_mb"] == 700.0
    with pytest.raises(torch.OutOfMemoryError) as info:
        fake.allocate(4 * 1000.0)
    got = parse_oom_message(str(info.value))
    # 500 MiB pieces: 6 of them fit on top of the weights (3700 MiB), the 7th is the one asked for
    assert got["allowed_mb"] == 4096.0 and got["allocated_mb"] == pytest.approx(3700, abs=5.12)
    assert got["tried_mb"] == 500.0
    assert fake.figures(None)["allocated_mb"] == 700.0  # the failed step's memory went back


# ---- the worker, in process, with the fake allocator ---------------------------------------------------------


def step_ids(beats):
    return {b["step"]: b["example_ids"] for b in beats if b["event"] == "step"}


def test_one_restart_measures_its_micro_batch_and_keeps_the_examples_of_every_step(tmp_path):
    from fixtures.fakes.workers import make_config, read_beats, run_in_process

    from hangwatch.common.config import load_config

    common = {
        "train": {"max_steps": 6, "micro_batch_size": 16, "grad_accum": 1},
        "checkpoint": {"every_steps": 2, "confirm_steps": 0},
    }
    # from step 4: the restart resumes at step 2, and its probe step measures the small device all the same
    device = {"kind": "memory_limit", "weights_mb": 700, "per_example_mb": 1000, "capacity_mb": 4096, "at_step": 4}
    config = make_config(tmp_path / "a", faults=[device], **common)
    run = tmp_path / "a" / "run"
    assert run_in_process(config) == 1
    words = json.loads((run / "attempts" / "0001" / "exit.json").read_text())
    assert words["kind"] == "oom" and "4.00 GiB allowed; Of the allocated memory" in words["message"]
    assert words["memory"]["weights_mb"] == 700.0 and words["memory"]["micro_batch_size"] == 16

    remedy = OomRemediation(load_config(config), run).on_failure(
        "oom", attempt=1, step=3, incident="x", evidence=memory_evidence.gather(run, 1)
    )
    assert remedy.basis == "probe" and remedy.to == Setting(8, 2)
    assert run_in_process(config) == 0  # measured: micro-batch 2 needs 2.7 GiB of the 4 allowed, 4 would need 4.7
    beats = read_beats(run, 2)
    assert (beats[0]["micro_batch_size"], beats[0]["grad_accum"]) == (8, 2)  # the rung it was started at
    (measured,) = [b["remediation_probe"] for b in beats if "remediation_probe" in b]
    assert measured["picked"] == 2 and measured["to"]["grad_accum"] == 8
    assert measured["per_example_mb"] == pytest.approx(1000.0) and measured["weights_mb"] == 700.0
    assert all(len(b["example_ids"]) == 16 for b in beats if b["event"] == "step")

    reference = make_config(tmp_path / "b", **common)  # the same run on a device with room: no OOM
    assert run_in_process(reference) == 0
    remedied = {**step_ids(read_beats(run, 1)), **step_ids(read_beats(run, 2))}
    assert sorted(remedied) == [1, 2, 3, 4, 5, 6] and remedied == step_ids(read_beats(tmp_path / "b" / "run", 1))
