"""Where a supervisor's control socket lives, and how a client finds it: the one resolver.

The supervisor binds `socket_path_for(cfg)`; a client given only the run dir reads `socket_path_in`,
which follows the run dir's `socket-path` record when the socket lives elsewhere (a configured path,
or $RUNTIME_DIRECTORY under systemd).  Standard library only: every `hangwatch status` imports this.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Mapping, Optional

from hangwatch.common.rundir import SOCKET_PATH_FILE

DEFAULT_SOCKET_NAME = "hangwatch.sock"
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes with the terminating NUL


def socket_path_for(
    cfg, run_dir: Optional[os.PathLike | str] = None, environ: Optional[Mapping[str, str]] = None
) -> Path:
    """control.socket when configured; else $RUNTIME_DIRECTORY/hangwatch.sock under systemd; else the run dir's."""
    env = os.environ if environ is None else environ
    if cfg.control.socket:
        return Path(cfg.control.socket)
    runtime = env.get("RUNTIME_DIRECTORY")
    if runtime:
        return Path(runtime.split(":")[0]) / DEFAULT_SOCKET_NAME
    return Path(run_dir if run_dir is not None else cfg.run_dir) / DEFAULT_SOCKET_NAME


def socket_path_in(run_dir: os.PathLike | str) -> Path:
    """The socket of the supervisor that owns `run_dir`: recorded in `socket-path`, else the default."""
    record = Path(run_dir) / SOCKET_PATH_FILE
    try:
        recorded = record.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        recorded = ""
    return Path(recorded) if recorded else Path(run_dir) / DEFAULT_SOCKET_NAME


def record_socket_path(run_dir: os.PathLike | str, socket_path: os.PathLike | str) -> None:
    """Let clients given only --run-dir find a socket that lives elsewhere (`socket_path_in` reads it).

    A socket in the run dir itself needs no record, and a stale one from an earlier run would mislead.
    """
    run_dir, socket_path = Path(run_dir), Path(socket_path)
    record = run_dir / SOCKET_PATH_FILE
    if socket_path.parent.resolve() == run_dir.resolve():
        with contextlib.suppress(FileNotFoundError):
            record.unlink()
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    from hangwatch.common.durable import write_atomic  # only the supervisor writes it: clients stay light

    write_atomic(record, f"{socket_path.resolve()}\n")


@contextlib.contextmanager
def unix_address(path: os.PathLike | str) -> Iterator[str]:
    """An address for bind/connect; long paths go through /proc/self/fd so the 107-byte limit never bites."""
    path = str(path)
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield path
        return
    parent, name = os.path.split(path)
    fd = os.open(parent or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)
