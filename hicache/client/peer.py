"""Which daemons a client talks to: the server's SO_PEERCRED, checked right after
`connect()` and before a single byte is sent.

A socket path is only a name. Another local user can create the directory of a
default path first (or bind a stale one) and listen there; an engine that talks
to it sends its prompts' keys and loads KV from it. The kernel says who listens:
a connected Unix socket carries the credentials of the process that called
`listen()`. The daemon must run as this user, as root (also what systemd socket
activation shows: PID 1 listens), or as a uid configured here: the argument,
else `$HICACHE_DAEMON_UIDS` (uids or user names, comma-separated), else the
packaged service's `hicache` user when this machine has one (only root creates
system users, so its existence is root's word).
"""

from __future__ import annotations

import functools
import os
import pwd
import socket
import struct
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from hicache.errors import ConfigError, DaemonUntrusted

DAEMON_UIDS_ENV = "HICACHE_DAEMON_UIDS"
SERVICE_USER = "hicache"  # User= of systemd/hicache.service

_UCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred:
    return PeerCred(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))


def _uid(item: str | int) -> int:
    if isinstance(item, int) and not isinstance(item, bool):
        return item
    text = str(item).strip()
    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise ConfigError(f"{DAEMON_UIDS_ENV}: no such user {text!r}") from None


@functools.lru_cache(maxsize=8)
def _configured(env_value: str | None) -> frozenset[int]:
    if env_value is not None and env_value.strip():
        return frozenset(_uid(x) for x in env_value.split(",") if x.strip())
    try:
        return frozenset({pwd.getpwnam(SERVICE_USER).pw_uid})
    except KeyError:
        return frozenset()


def trusted_daemon_uids(extra: Iterable[int | str] | None = None) -> frozenset[int]:
    """This user, root, and `extra` (default: $HICACHE_DAEMON_UIDS, else the `hicache` user)."""
    configured = _configured(os.environ.get(DAEMON_UIDS_ENV)) if extra is None else {_uid(x) for x in extra}
    return frozenset({os.getuid(), 0, *configured})


def check_daemon(sock: socket.socket, path: str, trusted: Collection[int] | None = None) -> PeerCred:
    """The listener's credentials when its uid is trusted; DaemonUntrusted otherwise."""
    allowed = trusted_daemon_uids() if trusted is None else trusted
    try:
        peer = peer_credentials(sock)
    except OSError as e:
        raise DaemonUntrusted(f"cannot read the credentials of the process serving {path}: {e.strerror or e}") from e
    if peer.uid not in allowed:
        raise DaemonUntrusted(f"the process serving {path} runs as uid {peer.uid}, which is not this user, root "
                              f"or a trusted daemon uid; nothing was sent to it (if it is your daemon, set "
                              f"{DAEMON_UIDS_ENV}={peer.uid})")
    return peer
