"""The NCCL flight recorder, with fakes (no GPU here): the environment a worker gets, the pipe poke (a FIFO made in
tmp_path, read back the way torch reads it: O_RDONLY|O_NONBLOCK), the dump settle, the data-only decoding.

tests/fixtures/workers/ddp_fr_trace_gloo.pkl is a real flight-recorder dump from torch 2.13 (gloo, 2 ranks, rank
0 with an all_reduce that rank 1 never joined), written by torch's own `_dump_fr_trace`: the same dump code that
serves the NCCL dump pipe."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
from fixtures.fakes.fake_supervisor import FakeProcessTable

from hangwatch.common.config import Config
from hangwatch.supervisor.escalation.dump_collector import StallDumps
from hangwatch.supervisor.escalation.flight_recorder import (
    DataOnlyUnpickler,
    FlightDumps,
    decode,
    into_incident,
    poke,
    summarize,
)
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.processes.attempt import FlightPaths, flight_env, worker_env

REAL_DUMP = Path(__file__).resolve().parents[3] / "fixtures" / "workers" / "ddp_fr_trace_gloo.pkl"


def test_the_worker_gets_torchs_flight_recorder_settings_unless_the_user_set_them(tmp_path):
    env = flight_env(tmp_path, {})
    assert env == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "nccl-trace-rank"),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "nccl-pipe-rank"),
    }
    mine = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_DUMP_TEMP_FILE": "/data/fr_", "TORCH_FR_BUFFER_SIZE": "0"}
    assert flight_env(tmp_path, mine) == {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "nccl-pipe-rank")}
    paths = FlightPaths.from_env({**mine, **flight_env(tmp_path, mine)})
    assert paths.trace(3) == Path("/data/fr_3") and paths.pipe(3) == tmp_path / "nccl-pipe-rank3.pipe"
    assert (
        FlightPaths.from_env({}).trace(0) == Path("/tmp/nccl_trace_rank_0") and FlightPaths.from_env({}).pipe(0) is None
    )


def torch_side_pipe(path: Path) -> int:
    """What a rank's ProcessGroupNCCL does: mkfifo <stem><rank>.pipe and hold it open O_RDONLY|O_NONBLOCK."""
    os.mkfifo(path)
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK)


def test_poking_a_pipe_writes_a_byte_the_rank_reads(tmp_path):
    fd = torch_side_pipe(tmp_path / "p0.pipe")
    try:
        assert poke(tmp_path / "p0.pipe") == "triggered"
        assert os.read(fd, 128) == b"1"  # torch's shouldDump(): read() > 0 → dump
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "setup, words",
    [
        ("missing", "no dump pipe: this rank has no NCCL process group"),
        ("no_reader", "not triggered: nobody reads the dump pipe"),
        ("regular", "is not a FIFO (left alone)"),
        ("unset", "no dump pipe configured"),
    ],
)
def test_a_pipe_that_cannot_be_poked_never_blocks_and_says_why(tmp_path, setup, words):
    path = tmp_path / "p0.pipe"
    if setup == "no_reader":
        os.mkfifo(path)  # a rank that died: nobody holds the FIFO open; a blocking open would hang for ever
    elif setup == "regular":
        path.write_text("keep me")
    assert words in poke(None if setup == "unset" else path)
    if setup == "regular":
        assert path.read_text() == "keep me"


def test_the_dump_settles_once_written_and_unchanged(tmp_path):
    paths = FlightPaths(str(tmp_path / "pipe"), str(tmp_path / "trace"))
    fd = torch_side_pipe(tmp_path / "pipe0.pipe")
    try:
        dumps = FlightDumps(paths, [0, 1])  # rank 1 has no pipe: no NCCL, nothing to wait for
        dumps.trigger(10.0)
        assert dumps.status == {0: "triggered", 1: "no dump pipe: this rank has no NCCL process group"}
        assert not dumps.settled(11.0)  # nothing written yet
        (tmp_path / "trace0").write_bytes(REAL_DUMP.read_bytes())
        assert not dumps.settled(11.1)  # just appeared
        assert dumps.settled(11.5)
        got = dumps.collect()
        assert got[0]["data"] == REAL_DUMP.read_bytes() and got[0]["decoded"] is True and got[1]["data"] is None
    finally:
        os.close(fd)


def test_no_nccl_anywhere_settles_at_once(tmp_path):
    dumps = FlightDumps(FlightPaths(str(tmp_path / "pipe"), str(tmp_path / "trace")), [0, 1])
    dumps.trigger(0.0)
    assert dumps.settled(0.0)


def test_a_dump_older_than_the_trigger_is_not_this_stalls(tmp_path):
    (tmp_path / "trace0").write_bytes(b"an old dump")
    dumps = FlightDumps(FlightPaths(None, str(tmp_path / "trace")), [0])
    dumps.trigger(0.0)
    assert dumps.collect()[0]["data"] is None


def test_the_real_dump_decodes_to_plain_data_and_a_short_summary():
    obj, problem = decode(REAL_DUMP.read_bytes())
    assert problem == "" and obj["version"] == "2.10" and len(obj["entries"]) == 4
    s = summarize((obj, problem))
    assert s["decoded"] and s["last_enqueued"] == 4
    assert s["summary"] == (
        "version 2.10: pg 0: enqueued #4, completed #3, pending gloo:all_reduce #4 (scheduled, sizes [[4096]])"
    )


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_global_in_the_dump_is_refused_never_loaded():
    with pytest.raises(pickle.UnpicklingError, match="refused global posix.system"):
        DataOnlyUnpickler(io.BytesIO(pickle.dumps(Boom()))).load()


@pytest.mark.parametrize(
    "data, why",
    [
        (pickle.dumps(Boom()), "UnpicklingError: refused global posix.system"),
        (b"\x80\x02garbage", "UnpicklingError"),
        (pickle.dumps([1, 2]), "not a flight-recorder dump (a list)"),
    ],
)
def test_anything_but_plain_data_is_kept_raw_and_said(data, why):
    s = summarize(decode(data))
    assert s["decoded"] is False and s["last_enqueued"] is None
    assert s["summary"].startswith("kept raw, could not be decoded: ") and why in s["summary"], s["summary"]


def test_into_the_incident_raw_file_and_summary(tmp_path):
    inc = IncidentStore(tmp_path).create("stall")
    results = {
        0: {
            "status": "triggered",
            "data": REAL_DUMP.read_bytes(),
            "path": "/x/trace0",
            **summarize(decode(REAL_DUMP.read_bytes())),
        },
        1: {"status": "triggered", "data": None, "path": "/x/trace1", "summary": "no dump written"},
    }
    rec = into_incident(inc, results)
    assert (
        rec["0"]["file"] == "nccl-trace-rank0.pkl"
        and (inc.dir / "nccl-trace-rank0.pkl").read_bytes() == REAL_DUMP.read_bytes()
    )
    assert "data" not in rec["0"] and rec["1"]["summary"] == "no dump written" and "file" not in rec["1"]
    none = {0: {"status": "no dump pipe: this rank has no NCCL process group", "data": None}}
    assert into_incident(inc, none) == "no dump pipe: this rank has no NCCL process group"


def test_the_stall_waits_for_the_flight_recorder_within_the_dump_grace(tmp_path):
    """Stacks settled, the flight recorder still writing: the dumps are not done until it settles, or grace_s."""
    table = FakeProcessTable()
    fd = torch_side_pipe(tmp_path / "pipe0.pipe")
    try:
        flight = FlightDumps(FlightPaths(str(tmp_path / "pipe"), str(tmp_path / "trace")), [0])
        dumps = StallDumps([], grace_s=5.0, table=table, py_spy=False, flight=flight)
        dumps.begin(0.0)
        assert not dumps.advance(1.0)  # no stack targets (settled), but rank 0's NCCL dump is not written yet
        (tmp_path / "trace0").write_bytes(b"x")
        assert not dumps.advance(1.1)
        assert dumps.advance(1.5) and dumps.done
        late = StallDumps(
            [],
            grace_s=2.0,
            table=table,
            py_spy=False,
            flight=FlightDumps(FlightPaths(str(tmp_path / "pipe"), str(tmp_path / "never")), [0]),
        )
        late.begin(0.0)
        assert not late.advance(1.0) and late.advance(2.0)  # bounded by grace_s
    finally:
        os.close(fd)


def test_worker_env_carries_the_settings_and_keeps_the_users(tmp_path):
    cfg = Config.model_validate(
        {"run_dir": str(tmp_path / "run"), "worker": {"command": ["x"], "env": {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}}}
    )
    env = worker_env(cfg, 3, environ={"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
    adir = tmp_path / "run" / "attempts" / "0003"
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # the user's
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == str(adir / "nccl-pipe-rank")
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(adir / "nccl-trace-rank")
