"""sd_notify against a real datagram socket standing in for systemd's NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket

import pytest

from hangwatch.supervisor.ops.notify import Notifier


@pytest.fixture
def systemd(tmp_path):
    """A bound AF_UNIX datagram socket, as systemd provides; yields (address, receive())."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.3)

    def receive():
        try:
            return sock.recv(4096).decode()
        except socket.timeout:
            return None

    yield str(path), receive
    sock.close()


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_ready_status_watchdog_stopping_reach_systemd(systemd):
    address, receive = systemd
    clock = Clock()
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    n = Notifier.from_env(env, clock=clock)
    assert env == {}  # the worker will not inherit them
    assert n.ready("starting worker")
    assert receive() == f"READY=1\nMAINPID={os.getpid()}\nSTATUS=starting worker\n"
    assert n.status("running: step 3/100")
    assert receive() == "STATUS=running: step 3/100\n"
    assert not n.status("running: step 3/100")  # unchanged text is not resent
    assert receive() is None
    # WATCHDOG=1 at most every WATCHDOG_USEC/2 = 1 s, however often the loop calls it.
    assert n.watchdog()
    assert receive() == "WATCHDOG=1\n"
    clock.now += 0.5
    assert not n.watchdog()
    assert receive() is None
    clock.now += 0.6
    assert n.watchdog()
    assert receive() == "WATCHDOG=1\n"
    assert n.stopping("stopping: worker checkpointing")
    assert receive() == "STOPPING=1\nSTATUS=stopping: worker checkpointing\n"


def test_abstract_namespace_address():
    name = f"hangwatch-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        n = Notifier("@" + name)
        assert n.ready()
        assert sock.recv(4096).startswith(b"READY=1\n")
    finally:
        sock.close()


def test_outside_systemd_nothing_happens():
    env = {"PATH": "/bin"}
    n = Notifier.from_env(env)
    assert not n.enabled
    assert (n.ready(), n.status("x"), n.watchdog(), n.stopping()) == (False, False, False, False)
    assert n._sock is None  # not even a socket was created
    assert env == {"PATH": "/bin"}


def test_no_watchdog_pings_without_watchdog_usec_or_for_another_pid(systemd):
    address, receive = systemd
    assert not Notifier.from_env({"NOTIFY_SOCKET": address}).watchdog()
    other = Notifier.from_env({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert not other.watchdog()
    assert receive() is None


def test_a_vanished_notify_socket_never_raises(tmp_path):
    n = Notifier(str(tmp_path / "gone.sock"))
    assert n.ready() is False
    assert n.errors == 1 and "FileNotFoundError" in n.last_error


def test_status_is_one_line(systemd):
    address, receive = systemd
    Notifier(address).status("two\nlines")
    assert receive() == "STATUS=two lines\n"


@pytest.mark.timeout(30)
def test_a_manager_that_does_not_read_never_blocks_the_loop(systemd):
    address, _ = systemd  # bound, never read: its queue fills up
    n = Notifier(address)
    results = [n.status(f"step {i}") for i in range(5000)]
    assert results[0] is True
    assert results[-1] is False and n.errors > 0 and "BlockingIOError" in n.last_error
