"""Socket activation (sd_listen_fds(3)), without libsystemd.

systemd passes listening sockets as fds 3, 4, ... (``SD_LISTEN_FDS_START``)
and describes them in ``$LISTEN_FDS`` (how many), ``$LISTEN_PID`` (for which
process: a child that inherits the variables must not take the fds) and
``$LISTEN_FDNAMES`` (colon-separated ``FileDescriptorName=`` values).

hicache's RPC socket is a Unix stream socket, so anything else passed in is a
misconfigured socket unit and refused with a ConfigError naming the fd.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import MutableMapping

from hicache.errors import ConfigError

logger = logging.getLogger(__name__)

SD_LISTEN_FDS_START = 3
_ENV_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


def listen_fds_with_names(
    environ: MutableMapping[str, str] | None = None, unset_environment: bool = True
) -> list[tuple[str, socket.socket]]:
    """The sockets systemd passed to this process, with their names, in unit order.

    Empty when the process was not socket-activated (variables unset, or
    ``$LISTEN_PID`` names another process). Names default to ``"unknown"``
    (as in sd_listen_fds_with_names) when ``$LISTEN_FDNAMES`` is absent or
    does not match the count. Each fd is made close-on-exec. With
    ``unset_environment`` the variables are removed whatever the outcome, so
    processes the daemon starts never see them.
    """
    env = os.environ if environ is None else environ
    try:
        return _adopt(env)
    finally:
        if unset_environment:
            for name in _ENV_VARS:
                env.pop(name, None)


def listen_fds(
    environ: MutableMapping[str, str] | None = None, unset_environment: bool = True
) -> list[socket.socket]:
    """The passed listening Unix stream sockets, in unit order; [] when not activated."""
    return [sock for _, sock in listen_fds_with_names(environ, unset_environment)]


def _adopt(env: MutableMapping[str, str]) -> list[tuple[str, socket.socket]]:
    pid_text = env.get("LISTEN_PID")
    fds_text = env.get("LISTEN_FDS")
    if not pid_text or not fds_text:
        return []
    try:
        pid = int(pid_text)
    except ValueError:
        raise ConfigError(f"LISTEN_PID={pid_text!r} is not a pid") from None
    if pid != os.getpid():
        logger.debug("LISTEN_PID=%d is not ours (%d); no sockets adopted", pid, os.getpid())
        return []
    try:
        count = int(fds_text)
    except ValueError:
        raise ConfigError(f"LISTEN_FDS={fds_text!r} is not a count") from None
    if count < 0:
        raise ConfigError(f"LISTEN_FDS={count} is negative")
    if count == 0:
        return []

    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    if len(names) != count:
        if names:
            logger.warning("LISTEN_FDNAMES has %d names for %d fds; ignoring the names", len(names), count)
        names = ["unknown"] * count

    fds = range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count)
    # Check every fd before wrapping any, so a bad one leaves no half-adopted
    # socket objects behind (they would close the fds when collected).
    for fd in fds:
        _check_unix_stream_listener(fd)
    adopted = []
    for fd, name in zip(fds, names):
        os.set_inheritable(fd, False)
        adopted.append((name, socket.socket(fileno=fd)))
    logger.info("adopted %d socket-activated fd(s): %s", count, ", ".join(names))
    return adopted


def _check_unix_stream_listener(fd: int) -> None:
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        raise ConfigError(f"socket activation: fd {fd} is not open ({e.strerror})") from None
    if not stat.S_ISSOCK(mode):
        raise ConfigError(
            f"socket activation: fd {fd} is not a socket; hicache needs ListenStream= on a path"
        )
    # A temporary object over a dup, so the check never closes or alters fd.
    probe = socket.socket(fileno=os.dup(fd))
    try:
        family = probe.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN)
        kind = probe.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
        listening = probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    finally:
        probe.close()
    if family != socket.AF_UNIX or kind != socket.SOCK_STREAM:
        raise ConfigError(
            f"socket activation: fd {fd} is {_family_name(family)}/{_type_name(kind)}, "
            "hicache needs an AF_UNIX stream socket (ListenStream=/path, not ListenDatagram= or a port)"
        )
    if not listening:
        raise ConfigError(f"socket activation: fd {fd} is not listening (Accept=yes is not supported)")


def _family_name(family: int) -> str:
    try:
        return socket.AddressFamily(family).name
    except ValueError:
        return f"family {family}"


def _type_name(kind: int) -> str:
    try:
        return socket.SocketKind(kind).name
    except ValueError:
        return f"type {kind}"
