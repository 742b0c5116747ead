"""What killed a process, only as far as the kernel's own records say; rank exceptions under torchrun."""

from __future__ import annotations

import pytest
from fixtures.fakes.torchrun_report import root_cause

from hangwatch.supervisor.escalation.kernel_evidence import (
    cgroup_oom_kills,
    kernel_log,
    oom_victims,
    rank_exceptions,
    sigkill_cause,
    torchrun_root_cause,
)


def fake_cgroup(tmp_path, v2=True, count=0):
    proc = tmp_path / "cgroup"
    root = tmp_path / "sys"
    if v2:
        proc.write_text("0::/system.slice/hangwatch@demo.service\n")
        d = root / "system.slice/hangwatch@demo.service"
        d.mkdir(parents=True)
        (d / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {count}\noom_group_kill 0\n")
    else:
        proc.write_text("12:cpu,cpuacct:/x\n7:memory:/user.slice\n")
        d = root / "memory/user.slice"
        d.mkdir(parents=True)
        (d / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {count}\n")
    return {"proc_self_cgroup": proc, "cgroup_root": root}


@pytest.mark.parametrize("v2", [True, False])
def test_the_cgroup_oom_kill_counter_is_read_from_v1_and_v2(tmp_path, v2):
    assert cgroup_oom_kills(**fake_cgroup(tmp_path, v2=v2, count=4)) == 4


def test_an_unreadable_cgroup_gives_none(tmp_path):
    assert cgroup_oom_kills(proc_self_cgroup=tmp_path / "nope", cgroup_root=tmp_path) is None
    (tmp_path / "cg").write_text("0::/gone\n")
    assert cgroup_oom_kills(proc_self_cgroup=tmp_path / "cg", cgroup_root=tmp_path) is None


KMSG = [
    "6,1234,5678,-;eth0: link up",
    "3,1300,5700,-;Out of memory: Killed process 4242 (python) total-vm:123kB, anon-rss:100kB",
    "6,1301,5701,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
    "oom_memcg=/x,task_memcg=/x,task=python,pid=4343,uid=0",
]


def test_oom_victims_are_read_from_both_kernel_line_shapes():
    assert oom_victims(KMSG) == {4242, 4343}


@pytest.mark.parametrize(
    "pids,before,now,records,expect",
    [
        ({4242}, 0, 0, KMSG, "OOM killer (kernel log: killed process 4242)"),
        ({77}, 2, 3, [], "OOM killer (the memory cgroup counted 1 OOM kill(s) during this attempt)"),
        ({77}, 2, 2, [], "not sent by hangwatch, and not the OOM killer"),
        ({77}, 2, 2, KMSG, "not sent by hangwatch, and not the OOM killer"),
        ({77}, None, None, None, "whether it was the OOM killer is unknown"),
        ({77}, 1, 1, None, "not sent by hangwatch, and not the OOM killer"),  # the counter alone is evidence enough
    ],
)
def test_sigkill_cause_names_the_oom_killer_only_on_the_kernels_word(pids, before, now, records, expect):
    assert expect in sigkill_cause(pids, before, now, records)


def test_kernel_log_reads_records_until_the_end_and_none_when_unreadable(tmp_path):
    f = tmp_path / "kmsg"
    f.write_text("one record\n")
    assert kernel_log(f) == ["one record"]
    assert kernel_log(tmp_path / "missing") is None


def test_rank_exceptions_come_from_torchruns_rank_prefixes():
    log = "\n".join(
        [
            "W1123 torch/distributed/run.py: some launcher warning",
            "[rank0]: step 3 ok",
            "[rank1]: Traceback (most recent call last):",
            '[rank1]:   File "train.py", line 40, in <module>',
            "[rank1]:     boom()",
            "[rank1]: ValueError: shard 7 is empty",
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "train.py", line 12, in <module>',
            "[rank0]: RuntimeError: [../third_party/gloo/...] Connection closed by peer",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        ]
    )
    assert rank_exceptions(log) == {
        1: "ValueError: shard 7 is empty",
        0: "RuntimeError: [../third_party/gloo/...] Connection closed by peer",
    }
    assert rank_exceptions("no prefixes here\nTraceback (most recent call last):\nKeyError: 1") == {}


TORCHRUN_FAILED = """\
hello from 1
Traceback (most recent call last):
  File "/tmp/tr/t.py", line 5, in <module>
    raise ValueError("shard 7 is empty")
ValueError: shard 7 is empty
W1123 02:43:09.095000 9336 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 9405 \
closing signal SIGTERM
E1123 02:43:09.101000 9336 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) \
local_rank: 1 (pid: 9406) of binary: /x/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
""" + root_cause(peer_sigterm=True)


def test_torchruns_root_cause_names_the_failing_rank_and_its_exception():
    """The text is torch 2.13's torchrun output for a 2-rank job whose rank 1 raised (captured here)."""
    rc = torchrun_root_cause(TORCHRUN_FAILED)
    assert (rc["rank"], rc["local_rank"], rc["exitcode"], rc["pid"], rc["signal"]) == (1, 1, 1, 9406, None)
    assert rc["exception"] == "ValueError: shard 7 is empty"  # not torchrun's own ChildFailedError
    assert rc["error_file"] is None and rc["host"] == "localhost"
    assert torchrun_root_cause("Traceback (most recent call last):\nKeyError: 1\n") is None
