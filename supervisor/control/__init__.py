"""The control socket: a Unix stream socket speaking newline-delimited JSON (docs/control-protocol.md).

    paths.py         where the socket lives and how a client finds it (the one resolver; stdlib only)
    peer.py          who may talk to it (SO_PEERCRED policy)
    wire.py          request parsing, reply encoding, `Pending` (a reply answered in a later pass)
    conversation.py  one client's requests and replies, without the socket
    listener.py      creating the socket file safely
    server.py        the non-blocking `ControlServer` the supervisor loop polls

Only `paths` loads with the package; the names of the others load on first use, so that a client
(`hangwatch status`), which needs only `paths`, imports neither the server and its logging stack nor the
peer policy and the wire format.
"""

from __future__ import annotations

import importlib
from typing import Any

from hangwatch.supervisor.control.paths import (
    DEFAULT_SOCKET_NAME,
    SOCKET_PATH_FILE,
    record_socket_path,
    socket_path_for,
    socket_path_in,
    unix_address,
)

_LATER = {  # name → the submodule it loads from, at first use
    **dict.fromkeys(("ControlSocketError", "PeerCred", "PeerPolicy", "peer_credentials"), "peer"),
    **dict.fromkeys(("Handler", "Pending", "encode_reply", "error_reply", "parse_request"), "wire"),
    **dict.fromkeys(("ControlServer", "make_control"), "server"),
}

__all__ = [
    "DEFAULT_SOCKET_NAME",
    "SOCKET_PATH_FILE",
    "record_socket_path",
    "socket_path_for",
    "socket_path_in",
    "unix_address",
    *_LATER,
]


def __getattr__(name: str) -> Any:
    if name not in _LATER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LATER[name]}"), name)
    globals()[name] = value
    return value


# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ()
