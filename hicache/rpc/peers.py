"""Who is on the other end of a daemon connection (SO_PEERCRED, supplementary groups) and
how much of what the daemon sent it has not read yet (SIOCOUTQ)."""

from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
import termios
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(fd: int) -> PeerCred:
    with socket.socket(fileno=os.dup(fd)) as s:
        raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return PeerCred(*struct.unpack("3i", raw))


def supplementary_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def member(peer: PeerCred | None, uids: set[int], gids: set[int]) -> bool:
    """Whether the peer's uid or one of its groups is listed. SO_PEERCRED carries the
    primary group only; supplementary ones are found in /proc (where the daemon may look)."""
    if peer is None:
        return False
    if peer.uid in uids or peer.gid in gids:
        return True
    return bool(gids) and not gids.isdisjoint(supplementary_groups(peer.pid))


def unread_bytes(fd: int) -> int:
    """Bytes sent on this Unix socket that the peer has not read yet (SIOCOUTQ)."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.TIOCOUTQ, buf)
    except OSError:
        return 0
    return buf[0]
