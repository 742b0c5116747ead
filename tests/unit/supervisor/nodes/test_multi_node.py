"""A multi-node supervisor on fakes: the generation, peers' restarts, free and counted restarts, the lost peer.

The supervisor is the real one (fake clock, fake process table, fake spawn); the peer-link helper is a
record of what it was ordered (`FakeHelper`), and the test speaks for it (`feed`): the store's generation,
a peer's notice, the peers' records, the reply to a bump.
"""

from __future__ import annotations

import json

import pytest
from fixtures.fakes.fake_supervisor import FakeHelper, Harness

from hangwatch.supervisor.nodes.multi_node import (
    EXIT_BARRIER_MARGIN_S,
    EXIT_BARRIER_S,
    missing_words,
    peer_cause,
    present_nodes,
)

NODE = {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:29400", "rdzv_id": "pair", "node_name": "a", "rdzv_timeout_s": 20}


def harness(tmp_path, **kw) -> tuple[Harness, FakeHelper]:
    helper = FakeHelper()
    h = Harness(tmp_path, worker_cfg={**NODE, **kw.pop("worker", {})}, peer_spawn=helper.spawn, **kw)
    helper.link = h.sup.nodes.link
    return h, helper


def say(h: Harness, **event) -> None:
    h.sup.nodes.link.feed(json.dumps(event).encode() + b"\n")


def store_up(h: Harness, gen: int = 0, peers: tuple = ("a", "b")) -> None:
    say(h, ev="store", ok=True, role="host", endpoint="127.0.0.1:29400")
    say(h, ev="gen", gen=gen, notice=None)
    nodes_at(h, gen, peers)


def incidents(h: Harness) -> list[dict]:
    return [json.loads((d / "incident.json").read_text()) for d in sorted((h.tmp_path / "run" / "incidents").glob("*"))]


def nodes_at(h: Harness, gen: int, names: tuple, age: float = 0.1) -> None:
    say(h, ev="peers", nodes={n: {"age_s": age, "record": {"node": n, "gen": gen, "state": "running"}} for n in names})


def test_no_attempt_until_the_store_is_reached_then_generation_in_the_rendezvous_id(tmp_path):
    h, helper = harness(tmp_path)
    for _ in range(5):
        h.tick(1.0)
    assert not h.spawn.workers, "spawned before the rendezvous store was reached"
    store_up(h, gen=3)
    h.until(lambda: h.spawn.workers)
    argv = h.sup.current.worker.argv
    assert argv[argv.index("--rdzv-id") + 1] == "pair-g3"
    assert argv[argv.index("--nnodes") + 1] == "2" and "is_host=false" in argv[argv.index("--rdzv-conf") + 1]
    assert helper.ops("status")[-1]["record"]["state"] == "rendezvous"


def test_a_peers_restart_is_joined_at_once_and_costs_no_restart_budget(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h)
    w = h.running()
    notice = {"node": "b", "kind": "stall", "summary": "rank 1 is the culprit: busy loop in Python", "rank": 1}
    say(h, ev="gen", gen=1, notice=notice)
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting", within_s=30)
    assert "-SIGTERM" in h.table.signals(), "the local tree was not ended"
    argv = h.sup.current.worker.argv
    assert argv[argv.index("--rdzv-id") + 1] == "pair-g1"
    inc = incidents(h)[-1]
    assert inc["kind"] == "peer_restart"
    assert inc["summary"].startswith("peer node b restarted (rank 1 is the culprit: busy loop in Python)")
    assert inc["peer_notice"]["node"] == "b"
    assert h.sup.policy.total_restarts == 0, "a peer's restart was counted against this node"
    assert not helper.ops("bump"), "a node that follows a peer bumped the generation itself"
    assert w.proc.status is not None


def test_own_crash_tells_the_peers_counts_and_waits_for_the_new_generation(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h)
    h.running().exit(1, last_words={"kind": "crash", "message": "RuntimeError: boom", "rank": 0})
    h.until(lambda: helper.ops("bump"), within_s=10)
    bump = helper.ops("bump")[0]
    assert bump["from"] == 0 and bump["notice"]["node"] == "a" and bump["notice"]["kind"] == "crash"
    for _ in range(4):
        h.tick(0.5)
    assert h.sup.attempt == 1, "respawned before the new generation existed (gen 0's rendezvous is closed)"
    say(h, ev="bumped", id=bump["id"], **{"from": 0}, gen=1, mine=True, notice=bump["notice"])
    h.until(lambda: h.sup.attempt == 2, within_s=10)
    argv = h.sup.current.worker.argv
    assert argv[argv.index("--rdzv-id") + 1] == "pair-g1"
    assert h.sup.policy.total_restarts == 1, "this node's own crash must count against its budget"


def test_a_rank_whose_collective_broke_is_a_victim_restarted_for_free(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h)
    h.running().exit(
        1,
        last_words={
            "kind": "crash",
            "message": "RuntimeError: Connection closed by peer",
            "rank": 0,
            "collective_error": True,
        },
    )
    h.until(lambda: helper.ops("bump"), within_s=10)  # nobody else bumped: the victim makes the new generation
    bump = helper.ops("bump")[0]
    say(h, ev="bumped", id=bump["id"], **{"from": 0}, gen=1, mine=True, notice=bump["notice"])
    h.until(lambda: h.sup.attempt == 2, within_s=10)
    assert h.sup.policy.total_restarts == 0
    inc = incidents(h)[-1]
    assert inc["own_culprit"] is False and "victims" in inc["decision"]["reason"]


def test_waiting_for_a_lost_peer_gives_one_lost_peer_incident_and_holds_the_startup_deadline(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h, peers=("a",))
    h.until(lambda: h.spawn.workers)
    nodes_at(h, 0, ("a",))
    say(
        h,
        ev="peers",
        nodes={
            "a": {"age_s": 0.0, "record": {"gen": 0, "state": "rendezvous"}},
            "b": {"age_s": 40.0, "record": {"gen": 0, "state": "running"}},
        },
    )
    for _ in range(200):  # 100 s: well past rdzv_timeout_s (20) and startup_timeout_s (15)
        h.tick(0.5)
    incs = incidents(h)
    assert [i["kind"] for i in incs] == ["lost_peer"], incs
    words = incs[0]["summary"]
    assert words.startswith("waiting for 1 of 2 nodes at the rendezvous since ")
    assert "pair-g0 at 127.0.0.1:29400" in words and "missing: b (last seen 40.0 s ago" in words
    assert h.state == "starting" and h.sup.attempt == 1, "the waiting attempt was killed"
    # the peer comes back: the ranks start; then the startup deadline counts from when everyone was there
    say(h, ev="peers", nodes={n: {"age_s": 0.1, "record": {"gen": 0, "state": "rendezvous"}} for n in ("a", "b")})
    h.worker.start()
    h.until(lambda: h.state == "running")
    assert [i["kind"] for i in incidents(h)] == ["lost_peer"]


def test_torchrun_restarting_its_ranks_within_an_attempt_is_a_round_not_a_fault(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h)
    h.until(lambda: h.spawn.workers)
    w = h.worker
    w.beat("start", torchrun={"restart_count": 0, "run_id": "pair-g0"})
    w.step(2)
    h.until(lambda: h.state == "running")
    w.beat("start", torchrun={"restart_count": 1, "run_id": "pair-g0"}, pid=w.pid + 7)
    w.step(1)
    h.tick()
    assert incidents(h) == []
    st = h.sup.nodes.status()
    assert st["torchrun_round_changes"] == 1 and st["torchrun_rounds"] == {0: 1}
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["nodes"]["torchrun_round_changes"] == 1


@pytest.mark.parametrize(
    "own, notice, won, lost, expected",
    [
        (True, {"node": "b"}, False, None, None),  # our culprit: counted, whoever bumped first
        (False, {"node": "b"}, False, None, "peer node b restarted first"),
        (None, {"node": "b"}, False, None, "peer node b restarted first"),  # cannot tell, a peer restarted first
        (None, {"node": "b"}, True, None, None),  # cannot tell, and we restarted first: counted
        (False, None, True, None, "local ranks were only waiting for their peers (victims)"),
        (None, None, None, "connection reset", "the rendezvous store was lost (connection reset)"),
        (None, None, None, None, None),
    ],
)
def test_peer_cause_table(own, notice, won, lost, expected):
    assert peer_cause(own, notice, won, lost) == expected


def test_present_and_missing_words():
    nodes = {
        "a": {"age_s": 0.2, "record": {"gen": 2, "state": "rendezvous"}},
        "b": {"age_s": 9.0, "record": {"gen": 1, "state": "running"}},
        "c": {"age_s": 0.1, "record": {"gen": 1, "state": "running"}},
    }  # alive but still in an older generation
    assert present_nodes(nodes, 2) == ["a"]
    words = missing_words(3, ["a"], nodes, 0.0, "x-g2 at h:1")
    assert words.startswith("waiting for 2 of 3 nodes at the rendezvous since ")
    assert "missing: b (last seen 9.0 s ago, generation 1, state running), c (last seen 0.1 s ago" in words
    assert "never seen" not in words
    assert "1 node(s) never seen" in missing_words(2, ["a"], {"a": nodes["a"]}, 0.0, "x")


def test_the_resume_point_is_the_one_agreed_for_the_generation_on_every_node(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h)
    h.running()
    # peer b (rank 0 ran there) offers a newer good checkpoint than this node's ledger knows
    say(
        h,
        ev="peers",
        nodes={
            "a": {"age_s": 0.0, "record": {"gen": 0, "state": "running"}},
            "b": {
                "age_s": 0.2,
                "record": {"gen": 0, "state": "running", "resume": {"path": "/shared/step-00000006", "step": 6}},
            },
        },
    )
    say(h, ev="gen", gen=1, notice={"node": "b", "kind": "stall", "summary": "rank 1 stuck"})
    h.until(lambda: h.sup.attempt == 2, within_s=30)
    proposal = helper.ops("agree_resume")[-1]
    assert proposal["gen"] == 1 and proposal["proposal"] == {"path": "/shared/step-00000006", "step": 6}
    assert h.spawn.envs[-1]["HANGWATCH_RESUME_FROM"] == "/shared/step-00000006"


def test_a_peers_earlier_proposal_decides_for_every_node(tmp_path):
    h, helper = harness(tmp_path)
    helper.resume[1] = {"path": "/shared/step-00000004", "step": 4, "by": "b"}  # b proposed first for generation 1
    store_up(h)
    h.running()
    say(h, ev="gen", gen=1, notice={"node": "b", "kind": "crash", "summary": "rank 1 crashed"})
    h.until(lambda: h.sup.attempt == 2, within_s=30)
    assert h.spawn.envs[-1]["HANGWATCH_RESUME_FROM"] == "/shared/step-00000004"


def test_a_peer_that_failed_ends_this_node_failed_too(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h)
    h.running()
    say(
        h,
        ev="peers",
        nodes={
            "a": {"age_s": 0.0, "record": {"gen": 0, "state": "running"}},
            "b": {"age_s": 0.3, "record": {"gen": 0, "state": "failed", "why": "crash loop: 3 restart(s) within 600s"}},
        },
    )
    h.until(lambda: h.state == "failed", within_s=60)
    assert h.sup.exit_code == 1
    assert helper.ops("status")[-1]["record"]["state"] == "failed"
    assert "peer node b failed" in helper.ops("status")[-1]["record"]["why"]


def test_a_stop_while_waiting_for_the_store_ends_at_once(tmp_path):
    h, helper = harness(tmp_path)
    h.tick(1.0)
    h.request(cmd="stop")
    h.until(lambda: h.state == "stopped", within_s=10)
    assert not h.spawn.workers and h.sup.exit_code == 0


def test_a_victims_incident_learns_the_peers_reason_when_it_comes_later(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h)
    h.running().exit(
        1,
        last_words={
            "kind": "crash",
            "message": "RuntimeError: Connection closed by peer",
            "rank": 0,
            "collective_error": True,
        },
    )
    h.until(lambda: helper.ops("bump"), within_s=10)  # after the tree is gone: the culprit's node had its chance first
    assert [i["kind"] for i in incidents(h)] == ["crash"]
    notice = {"node": "b", "kind": "crash", "summary": "rank 1 crashed: RuntimeError: boom", "rank": 1}
    bump = helper.ops("bump")[0]
    say(h, ev="bumped", id=bump["id"], **{"from": 0}, gen=1, mine=False, notice=notice)
    h.until(lambda: h.sup.attempt == 2, within_s=10)
    inc = incidents(h)[-1]
    assert inc["kind"] == "peer_restart" and inc["peer_notice"]["node"] == "b"
    assert inc["summary"].startswith("peer node b restarted (rank 1 crashed: RuntimeError: boom); ")
    assert h.sup.policy.total_restarts == 0


def test_a_rank_torchrun_ended_and_restarts_is_a_round_gap_not_a_stall(tmp_path):
    h, helper = harness(tmp_path, worker={"max_restarts": 2})
    store_up(h)
    h.until(lambda: h.spawn.workers)
    w = h.worker
    rank = h.table.add(ppid=w.pid)  # the rank torchrun started
    w.beat("start", pid=rank.pid, torchrun={"restart_count": 0})
    w.step(3)
    h.until(lambda: h.state == "running")
    h.table.end(rank.pid, 1)  # the rank failed; torchrun lives and starts a new round
    for _ in range(20):  # 10 s: well past the 2 s step deadline (the startup deadline is 15 s)
        h.tick(0.5)
    assert incidents(h) == [] and h.state == "running" and not h.table.sent
    again = h.table.add(ppid=w.pid)
    w.beat("start", pid=again.pid, torchrun={"restart_count": 1})
    w.step(1)
    h.tick()
    assert h.sup.nodes.status()["torchrun_round_changes"] == 1
    # a rank that stops stepping while its process lives is still a stall
    for _ in range(12):
        h.tick(0.5)
    assert [i["kind"] for i in incidents(h)] == ["stall"]


def test_a_peers_restart_before_any_local_rank_started_is_joined_quietly(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h)
    h.until(lambda: h.spawn.workers)  # torchrun at the rendezvous of generation 0, no rank yet
    say(h, ev="gen", gen=1, notice={"node": "b", "kind": "restart", "summary": "restarting"})
    h.until(lambda: h.sup.attempt == 2, within_s=20)
    argv = h.sup.current.worker.argv
    assert argv[argv.index("--rdzv-id") + 1] == "pair-g1"
    assert incidents(h) == [] and h.sup.policy.total_restarts == 0


def test_a_helper_that_keeps_dying_is_restarted_ever_less_often(tmp_path):
    h, helper = harness(tmp_path)
    link = h.sup.nodes.link
    starts = []
    for _ in range(6):
        helper.returncode = 1  # it dies at once (a broken environment)
        t0, n = h.clock(), link.starts
        h.until(lambda: link.starts > n, within_s=120)
        starts.append(h.clock() - t0)
    assert starts[-1] > starts[0] * 4, starts  # 1 s, 2 s, 4 s, … (capped at 30 s)
    assert max(starts) <= 31


def test_ranks_stopped_by_a_peers_stop_wait_for_it_without_burning_the_budget(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h)
    w = h.running()
    w.stop("terminated")  # every rank stops at the same boundary when any rank was asked to
    w.exit(0)
    h.until(lambda: helper.ops("bump"), within_s=10)
    bump = helper.ops("bump")[0]
    say(h, ev="bumped", id=bump["id"], **{"from": 0}, gen=1, mine=True, notice=bump["notice"])
    h.until(lambda: h.sup.attempt == 2, within_s=10)
    assert h.sup.policy.total_restarts == 0 and incidents(h) == []


def test_a_victims_only_node_leaves_the_bump_to_the_culprits_node(tmp_path):
    h, helper = harness(tmp_path)
    store_up(h)
    h.running().exit(
        1,
        last_words={
            "kind": "crash",
            "message": "RuntimeError: Connection reset by peer",
            "rank": 0,
            "collective_error": True,
        },
    )
    h.until(lambda: h.state == "starting" and h.sup.awaiting_rendezvous, within_s=10)
    h.tick(1.0)
    assert not helper.ops("bump"), "a node with only victims bumped before the culprit's node could"
    say(h, ev="gen", gen=1, notice={"node": "b", "kind": "stall", "summary": "rank 1 is the culprit: busy loop"})
    h.until(lambda: h.sup.attempt == 2, within_s=10)
    assert not helper.ops("bump")
    inc = incidents(h)[-1]
    assert inc["kind"] == "peer_restart" and inc["summary"].startswith("peer node b restarted (rank 1 is the culprit")


def ranks_said_done(h: Harness, *, exited: bool):
    """Attempt 1's one local rank (torchrun's child) steps, beats the exit line with status 0, and — `exited` — is
    gone, torchrun's agent living on; returns (agent, rank)."""
    store_up(h)
    h.until(lambda: h.spawn.workers)
    w = h.worker
    rank = h.table.add(ppid=w.pid)
    w.beat("start", pid=rank.pid)
    w.step(3)
    h.until(lambda: h.state == "running")
    w.beat("stop", pid=rank.pid, reason="exit", code=0)
    if exited:
        h.table.end(rank.pid, 0)
    return w, rank


def test_an_agent_waiting_at_torchruns_exit_barrier_is_left_to_it(tmp_path):
    h, helper = harness(tmp_path)
    w, rank = ranks_said_done(h, exited=True)
    for _ in range(40):  # 20 s: well past the exit deadline (exit_after_stop 4 + term_grace 1)
        h.tick(0.5)
    assert incidents(h) == [] and not h.table.sent and h.state == "running"
    assert h.sup.deadlines.extra["exit"][1:] == (EXIT_BARRIER_S + EXIT_BARRIER_MARGIN_S, "torchrun's exit barrier")
    w.exit(0)  # the other nodes came: the barrier opened
    h.until(lambda: h.state == "finished", within_s=10)
    assert incidents(h) == [] and h.sup.attempt == 1


def test_an_agent_still_there_after_the_barrier_is_killed_and_the_run_finished(tmp_path):
    h, helper = harness(tmp_path)
    ranks_said_done(h, exited=True)
    waited = h.until(lambda: h.table.sent, within_s=EXIT_BARRIER_S + EXIT_BARRIER_MARGIN_S + 10)
    assert waited >= EXIT_BARRIER_S + EXIT_BARRIER_MARGIN_S
    h.until(lambda: h.state == "finished", within_s=60)
    (inc,) = incidents(h)
    assert inc["deadline"]["name"] == "exit" and h.sup.attempt == 1
    assert not helper.ops("bump")  # this node's work was done: the peers are not restarted for its way out


def test_a_rank_that_lives_on_after_its_exit_line_is_no_barrier_wait(tmp_path):
    h, helper = harness(tmp_path)
    ranks_said_done(h, exited=False)
    waited = h.until(lambda: h.table.sent, within_s=10)
    assert 4 <= waited <= 6  # the exit deadline itself: exit_after_stop 4 + term_grace 1
    h.until(lambda: h.state == "finished", within_s=60)
    assert [i["kind"] for i in incidents(h)] == ["stall"] and h.sup.attempt == 1 and not helper.ops("bump")
