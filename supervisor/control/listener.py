"""Creating the control socket safely: never reachable by others, never beside a live supervisor.

The socket file is created mode 0600 (0660, group-owned, with a configured group) under a restrictive
umask, so there is no instant at which another user could connect.  A socket left by a dead
supervisor is replaced; a live one, or anything that is not a socket, is never touched.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

import structlog

from hangwatch.supervisor.control.paths import unix_address
from hangwatch.supervisor.control.peer import ControlSocketError, PeerPolicy

# Connections the kernel queues until the loop's next pass accepts them (it caps this at
# net.core.somaxconn).  A burst of clients must fit: when the queue is full, a client whose
# socket has a timeout is refused at once with EAGAIN rather than made to wait.
BACKLOG = 1024
STALE_PROBE_TIMEOUT_S = 2.0

log = structlog.get_logger("hangwatch.control")


def open_listener(path: Path, policy: PeerPolicy) -> socket.socket:
    """A non-blocking listening socket bound at `path`; raises ControlSocketError when that cannot be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    # The umask makes bind() create the file 0600: a chmod afterwards would leave a window.
    old = os.umask(0o177)
    try:
        with unix_address(path) as addr:
            sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ControlSocketError(f"cannot create control socket {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old)
    try:
        if policy.group_gid is not None:
            os.chown(path, -1, policy.group_gid)
            os.chmod(path, 0o660)
        else:
            os.chmod(path, 0o600)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise ControlSocketError(f"cannot set up control socket {path}: {exc.strerror or exc}") from None
    return sock


def replace_stale(path: Path) -> None:
    """Remove a socket left by a dead supervisor; refuse to start beside a live one."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlSocketError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(STALE_PROBE_TIMEOUT_S)
    try:
        with unix_address(path) as addr:
            probe.connect(addr)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        log.info("stale control socket replaced", path=str(path))
        return
    except OSError as exc:
        raise ControlSocketError(f"cannot tell whether {path} is in use: {exc.strerror or exc}") from None
    finally:
        probe.close()
    raise ControlSocketError(
        f"another hangwatch is already running on {path} (it accepted a connection); "
        f"stop it first: hangwatch stop --socket {path}"
    )
