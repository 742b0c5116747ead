"""Two nodes on one machine: two `hangwatch run` supervisors on loopback (127.0.0.1), one rank each, gloo, a
shared checkpoint dir — the built-in worker under torchrun's c10d rendezvous, as two machines would run it.

* A busy loop on global rank 1: both nodes recover and finish, the final adapter is bit for bit the one the same
  run makes uninterrupted, the node that hosted rank 1 names it the culprit, the other node's incident says its
  rank only waited (in a collective) for the peer that restarted, and neither node's restart budget paid for
  the other's culprit.
* A user's own DDP script whose global rank 0 spends 15 s after the last step before it exits (a final save): the
  other node's ranks are gone long before, its torchrun waits at its exit barrier past that node's exit deadline,
  and is left to: both nodes finish their one attempt without an incident.
* The node hosting the rendezvous store (and rank 0) has its whole tree SIGKILLed mid-run: the survivor takes the
  store over, waits at the rendezvous and reports the lost peer (incident and alert) within its rendezvous
  deadline; once the node is started again both finish.

Which node hosts which global rank is torchrun's choice (its rendezvous orders nodes by address and pid), so the
tests find the culprit's node from what the nodes wrote, never assume it.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest
from fixtures.fakes.nodes import (
    incidents_of,
    node_configs,
    run_dir_of,
    shared_dir_of,
    start_node,
    steps_seen,
    wait_all,
    wait_for,
)
from fixtures.fakes.user_shell import log_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_STEPS = 12
ADAPTER_FILES = ("adapter_model.safetensors", "extra_modules.safetensors")


def run_pair(tmp_path: Path, faults: list, **kw) -> dict[str, Path]:
    cfgs = node_configs(tmp_path, faults=faults, max_steps=MAX_STEPS, **kw)
    logs = {n: tmp_path / f"{n}.out" for n in cfgs}
    procs = {}
    for name, cfg in cfgs.items():
        procs[name] = start_node(cfg, logs[name])
        time.sleep(0.5)
    codes = wait_all(procs, 420, logs)
    assert codes == {n: 0 for n in cfgs}, (codes, {n: l.read_text()[-3000:] for n, l in logs.items()})
    return cfgs


def adapter(cfg: Path) -> dict[str, bytes]:
    final = shared_dir_of(cfg) / "final"
    return {f: (final / f).read_bytes() for f in ADAPTER_FILES}


def test_a_busy_loop_on_rank_1_both_nodes_recover_bitwise_and_each_incident_tells_its_part(tmp_path):
    reference = run_pair(tmp_path / "uninterrupted", [])
    cfgs = run_pair(tmp_path / "faulted", [{"kind": "busy_loop", "at_step": 5, "rank": 1}])

    assert adapter(cfgs["a"]) == adapter(reference["a"]), (
        "the recovered run's adapter differs from the uninterrupted one"
    )
    for cfg in cfgs.values():
        assert steps_seen(run_dir_of(cfg)) == MAX_STEPS

    incs = {n: incidents_of(run_dir_of(c)) for n, c in cfgs.items()}
    assert sorted(len(v) for v in incs.values()) == [1, 1], incs
    culprit_node = next(n for n, v in incs.items() if v[0].get("culprit_rank") == 1)
    victim_node = next(n for n in incs if n != culprit_node)
    culprit, victim = incs[culprit_node][0], incs[victim_node][0]

    assert culprit["kind"] == "stall" and culprit["node"] == culprit_node
    assert culprit["summary"].startswith("rank 1 is the culprit: busy loop in Python"), culprit["summary"]
    assert culprit["own_culprit"] is True and "stack-rank1.txt" in culprit["dumps"].values()

    assert victim["kind"] == "peer_restart", victim
    assert victim["summary"].startswith(f"peer node {culprit_node} restarted (rank 1 is the culprit: busy loop"), (
        victim["summary"]
    )
    assert "local ranks were waiting in " in victim["summary"] and victim["own_culprit"] is False
    assert victim["local_ranks"][0]["rank"] == 0 and victim["local_ranks"][0]["collective"]
    assert f"not a failure of node {victim_node}" in victim["decision"]["reason"]
    # the culprit's node paid for its restart; the victim's did not
    assert "not a failure" not in culprit["decision"]["reason"]

    # one coordinated restart: both nodes' second attempt rendezvoused in generation 1
    for cfg in cfgs.values():
        spawned = [
            json.loads(x)
            for x in (run_dir_of(cfg) / "supervisor.log").read_text().splitlines()
            if '"worker_spawned"' in x
        ]
        ids = [s["argv"][s["argv"].index("--rdzv-id") + 1] for s in spawned]
        assert ids == ["pair-g0", "pair-g1"], ids


def test_a_node_done_first_waits_at_torchruns_exit_barrier_for_the_peers_last_save(tmp_path):
    script = Path(__file__).resolve().parents[1] / "fixtures" / "user_scripts" / "ddp_block.py"
    command = [
        sys.executable,
        str(script),
        "--steps",
        "6",
        "--ckpt-dir",
        str(tmp_path / "ckpts"),
        "--linger-rank",
        "0",
        "--linger-s",
        "15",
    ]
    # The exit deadline (3 + 1 s) is far shorter than rank 0's linger: without the exit barrier in view, the node done
    # first would be killed at it.
    cfgs = run_pair(
        tmp_path,
        [],
        worker={"command": command},
        watchdog={"exit_after_stop_s": 3, "term_grace_s": 1, "step_timeout_s": 60},
    )
    explain = {n: (tmp_path / f"{n}.out").read_text()[-3000:] for n in cfgs}

    runs = {n: run_dir_of(c) for n, c in cfgs.items()}
    for n, run_dir in runs.items():
        state = json.loads((run_dir / "state.json").read_text())
        assert state["state"] == "finished" and state["attempt"] == 1 and state["restarts"] == 0, (n, state)
        assert incidents_of(run_dir) == [], (n, [i["summary"] for i in incidents_of(run_dir)])
        assert steps_seen(run_dir) == 6
    first = next(n for n, d in runs.items() if not (d / "attempts" / "0001" / "heartbeat-rank0.jsonl").exists())
    last = next(n for n in runs if n != first)
    assert not log_events(runs[last], "torchrun_exit_barrier")
    waited = log_events(runs[first], "torchrun_exit_barrier")
    # torch's gloo aborts a finished rank on its way out now and then (docs/your-own-script.md): then torchrun skips
    # its barrier, and that node's run ends as a crash in teardown, finished all the same.
    assert waited or log_events(runs[first], "worker_teardown_crash"), explain
    if waited:
        assert waited[0]["attempt"] == 1 and waited[0]["wait_s"] >= 300, waited


def tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p] + p.children(recursive=True)


@pytest.mark.parametrize("lost", ["a", "b"], ids=["the-store-host", "the-other-node"])
def test_sigkill_of_a_whole_node_is_reported_as_a_lost_peer_and_the_run_finishes_when_it_returns(tmp_path, lost):
    alerts = tmp_path / "alerts.jsonl"
    command = [sys.executable, "-c", f"import sys; open({str(alerts)!r}, 'a').write(sys.stdin.read() + '\\n')"]
    # no node_name: the default names the nodes (<hostname>:<run dir>), as a user who sets none gets
    cfgs = node_configs(
        tmp_path,
        max_steps=14,
        worker={"rdzv_timeout_s": 15},
        named=False,
        alerts={"command": command, "on": ["lost_peer"]},
    )
    logs = {n: tmp_path / f"{n}.out" for n in cfgs}
    procs = {"a": start_node(cfgs["a"], logs["a"])}  # first: its peer link hosts the rendezvous store
    time.sleep(0.5)
    procs["b"] = start_node(cfgs["b"], logs["b"])
    survivor = "b" if lost == "a" else "a"
    run_lost, run_survivor = run_dir_of(cfgs[lost]), run_dir_of(cfgs[survivor])
    wait_for(lambda: steps_seen(run_lost) >= 4, 240, f"node {lost} at step 4")

    doomed = tree(procs[lost].pid)
    assert len(doomed) >= 4, [p.cmdline() for p in doomed]  # supervisor, peer link, torchrun, rank
    killed_at = time.time()
    for p in doomed:
        try:
            p.kill()
        except psutil.Error:
            pass
    procs[lost].wait(10)
    for p in doomed:
        try:
            p.wait(10)
        except psutil.Error:
            pass

    def reported():
        return [i for i in incidents_of(run_survivor) if i["kind"] == "lost_peer"]

    wait_for(lambda: reported(), 15 + 45, f"node {survivor}'s lost_peer incident")
    inc = reported()[0]
    assert inc["summary"].startswith("waiting for 1 of 2 nodes at the rendezvous since "), inc["summary"]
    assert f"missing: {socket.gethostname()}:{run_lost.resolve()} (last seen" in inc["summary"], inc["summary"]
    assert inc["time_unix"] - killed_at < 15 + 30, "not reported within the rendezvous deadline"
    assert procs[survivor].poll() is None, "the surviving node gave up"
    wait_for(lambda: alerts.exists() and '"lost_peer"' in alerts.read_text(), 20, "the lost_peer alert")
    sent = [json.loads(x) for x in alerts.read_text().splitlines() if x.strip()]
    assert sent[0]["event"] == "lost_peer" and "waiting for 1 of 2 nodes" in sent[0]["why"], sent

    # its restart budget did not pay for the lost peer
    for i in incidents_of(run_survivor):
        if i["kind"] != "lost_peer":
            assert "not a failure of node" in i["decision"]["reason"], i

    procs[lost] = start_node(cfgs[lost], logs[lost])
    codes = wait_all(procs, 300, logs)
    assert codes == {"a": 0, "b": 0}, {n: l.read_text()[-3000:] for n, l in logs.items()}
    assert (shared_dir_of(cfgs["a"]) / "final" / "adapter_model.safetensors").exists()
    state = json.loads((run_survivor / "state.json").read_text())
    assert state["state"] == "finished" and state["nodes"]["generation"] >= 1
    assert max(steps_seen(run_dir_of(c)) for c in cfgs.values()) == 14
