"""OOM remediation's evidence-based pick: torch's out-of-memory message parsed (a table of real-shaped messages),
the decision from the evidence (one pick; the ladder when the evidence is missing or does not hold together;
gradient checkpointing when nothing fits; the effective batch kept; divisors; the margin), the worker's last words
carrying the `memory` object (torch.cuda faked through the probe's seam), and the `memory_limit` fault's fake
allocator end to end in process: one restart, at the predicted micro-batch, the same examples per optimizer step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hangwatch.daemon.faults import FakeAllocator, format_size, oom_message
from hangwatch.daemon.lastwords import last_words_for
from hangwatch.daemon.trainer import memory_evidence as memory
from hangwatch.supervisor.concerns import oom_evidence as ev
from hangwatch.supervisor.concerns import oom_remediation as rem
from hangwatch.supervisor.concerns.oom_evidence import Evidence, parse_oom_message
from hangwatch.supervisor.concerns.oom_remediation import OomRemediation, Setting

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


def expected_pick(weights, per_example, capacity, effective, at_most, margin=ev.MARGIN):
    """The rule, written out: the largest divisor of the effective batch, at most `at_most`, that fits the margin."""
    fits = [d for d in range(1, at_most + 1) if effective % d == 0 and weights + d * per_example <= margin * capacity]
    return max(fits) if fits else None


def test_sufficient_evidence_picks_once_and_keeps_the_effective_batch():
    remedy = rem.decide(None, cfg(16, 1), evidence())
    # 16 examples needed 700 MiB + 15.62 GiB: ≈ 1000 MiB each; 90 % of 4 GiB holds 700 + 2 × 1000, not 700 + 4 × 1000
    assert expected_pick(700, 1000, 4096, 16, 8) == 2
    assert remedy.basis == "evidence" and remedy.to == Setting(2, 8) and remedy.to.effective == 16
    assert remedy.message == (
        "out of memory at micro-batch 16: 700 MiB allocated + 15.6 GiB requested of 4.0 GiB allowed, weights 700 MiB → "
        "about 0.98 GiB per example; restarting from the last good checkpoint with micro-batch 2 × accumulation 8 "
        "(effective batch 16 unchanged), about 2.6 GiB of 3.6 GiB (90% of the capacity)"
    )
    f = remedy.fields()
    assert f["basis"] == "evidence" and f["to"] == {
        "micro_batch_size": 2,
        "grad_accum": 8,
        "gradient_checkpointing": False,
    }
    e = f["evidence"]
    assert (e["need_from"], e["capacity_from"], e["capacity_mb"], e["weights_mb"], e["picked"]) == (
        "oom",
        "allowed",
        4096.0,
        700.0,
        2,
    )
    assert e["per_example_mb"] == pytest.approx(1000, abs=1) and e["margin"] == 0.9 and e["budget_mb"] == 3686.4
    record = rem.applied(None, cfg(16, 1), remedy, attempt=1, step=3, incident="0001", now=0.0)
    assert record["history"][0]["basis"] == "evidence" and record["history"][0]["evidence"]["picked"] == 2
    assert rem.current(record, cfg(16, 1)) == Setting(2, 8)


@pytest.mark.parametrize(
    "micro, accum, weights, tried, allowed, to",
    [
        (12, 1, 1000.0, 12 * 500.0, 4096.0, Setting(4, 3)),  # 5 fit: 12's largest divisor ≤ 5 is 4
        (6, 4, 1000.0, 6 * 500.0, 4096.0, Setting(3, 8)),  # 5 fit, but never above the ladder's next (3); 24 = 3 × 8
        (
            12,
            2,
            1000.0,
            12 * 500.0,
            4000.0,
            Setting(4, 6),
        ),  # 6 fit all of 4000 MiB, 5.2 fit 90 %: 4 (divides 24), not 6
        (16, 3, 1000.0, 8100.0, 10000.0, Setting(8, 6)),  # 15 fit: capped at the ladder's 8 (a lower bound, not bolder)
        (16, 1, 3500.0, 16 * 100.0, 4096.0, Setting(1, 16)),  # 1.86 fit: 1
        (10, 1, 500.0, 10 * 1000.0, 4096.0, Setting(2, 5)),  # 3.2 fit: 10's divisors ≤ 3: 2
    ],
)
def test_pick_is_the_largest_fitting_divisor_of_the_effective_batch(micro, accum, weights, tried, allowed, to):
    remedy = rem.decide(None, cfg(micro, accum), evidence(micro, weights, tried, allowed=allowed))
    assert remedy.basis == "evidence", remedy.why
    assert remedy.to == to and remedy.to.effective == micro * accum
    e = remedy.evidence
    assert e["picked"] == expected_pick(weights, e["per_example_mb"], allowed, micro * accum, rem.smaller_micro(micro))


def test_the_margin_is_what_makes_the_difference():
    est, why = ev.estimate(evidence(12, 1000.0, 12 * 500.0, allowed=4000.0), 12)
    assert why == "" and est.per_example_mb == pytest.approx(500, abs=1)
    assert ev.pick(est, 24, 6) == 4
    full = ev.Estimate(**{**est.__dict__, "margin": 1.0})
    assert ev.pick(full, 24, 6) == 6


def test_nothing_fits_goes_to_the_last_rung_and_then_fails():
    e = evidence(16, 3600.0, 16 * 300.0, allowed=4096.0)  # weights alone nearly fill 90 %: not even 1 example fits
    remedy = rem.decide(None, cfg(16, 1), e)
    assert remedy.basis == "evidence" and remedy.to == Setting(1, 16, True) and remedy.evidence["picked"] is None
    assert "even micro-batch 1 would need about" in remedy.message and "and gradient checkpointing" in remedy.message
    record = rem.applied(None, cfg(16, 1), remedy, attempt=1, step=1, incident="a", now=0.0)
    final = rem.decide(record, cfg(16, 1), e)  # the last rung failed too: nothing is left
    assert final.exhausted and "every remedy tried" in final.message and final.basis == "ladder"


@pytest.mark.parametrize(
    "e, why",
    [
        (None, "no evidence was read"),
        (
            Evidence(
                0, "OutOfMemoryError: injected fault: CUDA out of memory at step 3 (tried to allocate 20.00 GiB)", None
            ),
            "neither the message nor the worker gave memory figures",
        ),
        (Evidence(0, None, {"micro_batch_size": 4, "device": "cpu"}), "no weights' share"),
        (evidence(4, weights=None), "no weights' share"),
        (evidence(8), "the worker reports micro-batch 8, the setting was 4"),
        (Evidence(0, evidence(4).message, evidence(4).memory, phase="eval"), "in phase 'eval', not in a training step"),
        (evidence(4, 700.0, 100.0, allowed=4096.0), "inconsistent: micro-batch 4 would fit"),
        (evidence(4, 5000.0, 100.0, allocated=3000.0, allowed=4096.0), "inconsistent: the weights"),
        (Evidence(0, None, {"micro_batch_size": 4, "weights_mb": 700.0, "allocated_mb": 3000.0}), "no capacity figure"),
        (
            Evidence(0, None, {"micro_batch_size": 4, "weights_mb": 700.0, "total_mb": 4096.0}),
            "no figure of what the failed step needed",
        ),
    ],
)
def test_missing_or_inconsistent_evidence_falls_back_to_the_ladder(e, why):
    remedy = rem.decide(None, cfg(4, 2), e)
    assert remedy.basis == "ladder" and remedy.to == Setting(2, 4) and why in remedy.why
    assert "micro-batch 4 → 2, accumulation 2 → 4 (effective batch 8 unchanged)" in remedy.message
    assert remedy.message.endswith(f"; the ladder: {remedy.why}")
    assert remedy.fields()["why"] == remedy.why and "evidence" not in remedy.fields()


def test_worker_figures_and_step_peaks_without_a_parsable_message(tmp_path):
    # The injected `oom` fault on a GPU: no figures in the message; the worker's peak (above what loading left) is.
    e = evidence(16, 700.0, message=False, allocated=3000.0, peak_mb=3900.0, reserved_mb=3900.0, free_mb=70000.0)
    remedy = rem.decide(None, cfg(16, 1), e)
    assert remedy.basis == "evidence" and remedy.evidence["need_from"] == "peak" and remedy.to == Setting(8, 2)
    # A peak no higher than the loading's says nothing about training: then nothing tells the step's need.
    flat = evidence(16, 700.0, message=False, allocated=700.0, peak_mb=700.0)
    assert rem.decide(None, cfg(16, 1), flat).basis == "ladder"
    # The step beats' peak (max_mem_allocated_mb), read from the attempt's heartbeat file.
    beats = tmp_path / "attempts" / "0001" / "heartbeat-rank0.jsonl"
    beats.parent.mkdir(parents=True)
    lines = [{"event": "start", "step": 0}] + [
        {"event": "step", "step": s, "max_mem_allocated_mb": 3000.0 + s * 400} for s in (1, 2, 3)
    ]
    beats.write_text("".join(json.dumps(b) + "\n" for b in lines) + '{"event": "step", "max_mem')
    (beats.parent / "exit.json").write_text(
        json.dumps({"kind": "oom", "message": flat.message, "memory": flat.memory, "phase": "train"})
    )
    got = ev.gather(tmp_path, 1)
    assert got.steps_peak_mb == 4200.0 and got.memory == flat.memory and got.phase == "train"
    remedy = rem.decide(None, cfg(16, 1), got)
    assert remedy.basis == "evidence" and remedy.evidence["need_from"] == "steps"
    assert "a peak of 4.1 GiB in its steps of 4.0 GiB allowed" in remedy.message


def test_later_ooms_and_micro_batch_one_take_the_ladder():
    first = rem.decide(None, cfg(16, 1), evidence())
    record = rem.applied(None, cfg(16, 1), first, attempt=1, step=3, incident="a", now=0.0)
    again = rem.decide(record, cfg(16, 1), evidence(2, tried=2000.0))  # the pick still ran out of memory
    assert (
        again.basis == "ladder" and again.to == Setting(1, 16) and "the ladder goes on from micro-batch 2" in again.why
    )
    record = rem.applied(record, cfg(16, 1), again, attempt=2, step=3, incident="b", now=0.0)
    assert [h["basis"] for h in record["history"]] == ["evidence", "ladder"]
    one = rem.decide(None, cfg(1, 8), evidence(1, tried=1000.0))
    assert one.basis == "ladder" and one.to == Setting(1, 8, True) and "micro-batch 1 already" in one.why


def test_oom_recovery_reads_the_failing_ranks_evidence_and_remedies_once(tmp_path):
    from hangwatch.supervisor.concerns import RunContext
    from hangwatch.supervisor.concerns.oom_recovery import OomRecovery
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
    episode = SimpleNamespace(kind="oom", incident=inc)
    restart = Decision("restart", "worker exited with code 1")
    decided = concern.decision(SimpleNamespace(number=1), episode, restart, 0.0)
    assert decided.action == "restart" and "micro-batch 2 × accumulation 8" in decided.reason
    on_disk = json.loads((inc.dir / "incident.json").read_text())  # amended through the store
    assert on_disk["remediation"]["basis"] == "evidence" and inc.data["remediation"] == on_disk["remediation"]
    saved = rem.load(tmp_path)
    assert (saved["micro_batch_size"], saved["grad_accum"]) == (2, 8) and saved["history"][0]["basis"] == "evidence"
    # asked again for the same incident (the tree is gone): the remedy is not applied twice
    assert concern.decision(SimpleNamespace(number=1), episode, decided, 1.0) is None
    assert len(rem.load(tmp_path)["history"]) == 1


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
    with pytest.raises(torch.OutOfMemoryError) as info:
        fake.allocate(4 * 1000.0)
    got = parse_oom_message(str(info.value))
    assert (
        got["allowed_mb"] == 4096.0
        and got["allocated_mb"] == 700.0
        and got["tried_mb"] == pytest.approx(4000, abs=5.12)
    )


# ---- the worker, in process, with the fake allocator ---------------------------------------------------------


def step_ids(beats):
    return {b["step"]: b["example_ids"] for b in beats if b["event"] == "step"}


def test_one_restart_at_the_predicted_micro_batch_with_the_same_examples(tmp_path):
    from fixtures.fakes.workers import make_config, read_beats, run_in_process

    from hangwatch.common.config import load_config

    common = {
        "train": {"max_steps": 4, "micro_batch_size": 16, "grad_accum": 1},
        "checkpoint": {"every_steps": 2, "confirm_steps": 0},
    }
    device = {"kind": "memory_limit", "weights_mb": 700, "per_example_mb": 1000, "capacity_mb": 4096, "at_step": 3}
    config = make_config(tmp_path / "a", faults=[device], **common)
    run = tmp_path / "a" / "run"
    assert run_in_process(config) == 1
    words = json.loads((run / "attempts" / "0001" / "exit.json").read_text())
    assert words["kind"] == "oom" and "4.00 GiB allowed; Of the allocated memory 700.00 MiB" in words["message"]
    assert words["memory"]["weights_mb"] == 700.0 and words["memory"]["micro_batch_size"] == 16

    remedy = OomRemediation(load_config(config), run).on_failure(
        "oom", attempt=1, step=2, incident="x", evidence=ev.gather(run, 1)
    )
    assert remedy.basis == "evidence" and remedy.to == Setting(2, 8)
    assert run_in_process(config) == 0  # micro-batch 2 needs 2.7 GiB of the 4 allowed: no second OOM
    start = read_beats(run, 2)[0]
    assert (start["micro_batch_size"], start["grad_accum"], start["effective_batch"]) == (2, 8, 16)

    reference = make_config(tmp_path / "b", **common)  # the same run on a device with room: no OOM
    assert run_in_process(reference) == 0
    remedied = {**step_ids(read_beats(run, 1)), **step_ids(read_beats(run, 2))}
    assert sorted(remedied) == [1, 2, 3, 4] and remedied == step_ids(read_beats(tmp_path / "b" / "run", 1))
