"""Who may talk to the control socket: SO_PEERCRED against our uid, root and an optional group.

The socket's file mode (0600, or 0660 with a group) already keeps others out; this is the second
lock, for a socket whose mode was widened or whose directory is shared.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass
from typing import Optional


class ControlSocketError(OSError):
    """The control socket cannot be set up (in use by a live supervisor, not a socket, no such group, …).

    An OSError, so that whoever opens the control socket treats it like any other failure to bind.
    """


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return PeerCred(*struct.unpack("3i", raw))


@dataclass(frozen=True)
class PeerPolicy:
    """Our own uid and root always; with a group, its members (primary or supplementary) too."""

    owner_uid: int
    group_gid: Optional[int] = None
    group_members: frozenset[str] = frozenset()

    @classmethod
    def for_group(cls, group: Optional[str], owner_uid: Optional[int] = None) -> "PeerPolicy":
        owner = os.geteuid() if owner_uid is None else owner_uid
        if group is None:
            return cls(owner)
        try:
            entry = grp.getgrnam(group)
        except KeyError:
            raise ControlSocketError(f"control.group: no such group {group!r}") from None
        return cls(owner, entry.gr_gid, frozenset(entry.gr_mem))

    def refusal(self, cred: PeerCred) -> Optional[str]:
        """None when `cred` may use the socket, else why not."""
        if cred.uid in (0, self.owner_uid):
            return None
        if self.group_gid is not None:
            if cred.gid == self.group_gid:
                return None
            try:
                name = pwd.getpwuid(cred.uid).pw_name
            except KeyError:
                name = None
            if name is not None and name in self.group_members:
                return None
            return f"unauthorised: uid {cred.uid} is neither uid {self.owner_uid} nor in the control group"
        return f"unauthorised: uid {cred.uid} is not uid {self.owner_uid}"
