"""The systemd notification protocol (sd_notify(3)), without libsystemd.

A message is one AF_UNIX datagram of newline-separated ``KEY=value`` lines sent
to the socket named by ``$NOTIFY_SOCKET``: a filesystem path, or an abstract
socket written with a leading ``@``. systemd identifies the sender by the
kernel-attached credentials, so with ``NotifyAccess=main`` only the daemon's
own process (any of its threads) is heard.

Outside systemd ``$NOTIFY_SOCKET`` is unset and the notifier is a no-op, so the
daemon calls it unconditionally. A failed send is logged once and otherwise
ignored: losing a status line must never take the daemon down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from collections.abc import MutableMapping

from hicache.errors import ProtocolError

logger = logging.getLogger(__name__)

# A datagram to systemd almost never blocks (its socket has a large receive
# buffer); bound the rare stall so the event loop is never held for long.
_SEND_TIMEOUT_S = 1.0
_FIELD_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


def _parse_address(value: str) -> str | bytes | None:
    """The sockaddr for ``$NOTIFY_SOCKET``, or None when it names no AF_UNIX socket."""
    if value.startswith("@"):
        # Abstract namespace: '@' stands for the leading NUL byte.
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    # Relative paths are rejected by sd_notify too; vsock: addresses (systemd
    # 254+, VMs) are not supported here.
    return None


def watchdog_interval_s(environ: MutableMapping[str, str] | None = None) -> float | None:
    """How often to send ``WATCHDOG=1``, in seconds, or None when no watchdog is armed.

    Half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled(3) advises. Following
    sd_watchdog_enabled, a set ``$WATCHDOG_PID`` must equal our pid (a child
    that inherited the variables must not ping for its parent).
    """
    env = os.environ if environ is None else environ
    usec_text = env.get("WATCHDOG_USEC")
    if not usec_text:
        return None
    pid_text = env.get("WATCHDOG_PID")
    if pid_text:
        try:
            pid = int(pid_text)
        except ValueError:
            logger.warning("ignoring watchdog: WATCHDOG_PID=%r is not a pid", pid_text)
            return None
        if pid != os.getpid():
            return None
    try:
        usec = int(usec_text)
    except ValueError:
        logger.warning("ignoring watchdog: WATCHDOG_USEC=%r is not an integer", usec_text)
        return None
    if usec <= 0:
        logger.warning("ignoring watchdog: WATCHDOG_USEC=%d is not positive", usec)
        return None
    return usec / 2 / 1_000_000


class Notifier:
    """Sends state changes to the service manager; a no-op when ``address`` is None."""

    def __init__(self, address: str | bytes | None, watchdog_interval_s: float | None = None) -> None:
        self._address = address
        self.watchdog_interval_s = watchdog_interval_s
        self._sock: socket.socket | None = None
        self._failure_logged = False

    @classmethod
    def from_env(
        cls, environ: MutableMapping[str, str] | None = None, unset_environment: bool = True
    ) -> Notifier:
        """Read ``$NOTIFY_SOCKET`` and the watchdog variables.

        With ``unset_environment`` (the default) the variables are removed
        afterwards, so processes the daemon starts do not inherit them and
        talk to systemd in its name.
        """
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        address = _parse_address(raw) if raw else None
        if raw and address is None:
            logger.warning("ignoring NOTIFY_SOCKET=%r: not an absolute path or @abstract name", raw)
        interval_s = watchdog_interval_s(env) if address is not None else None
        if unset_environment:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                env.pop(name, None)
        return cls(address, interval_s)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=value`` fields in one datagram; True when it was sent.

        Raises ProtocolError for a malformed field (a lower-case or empty
        name, a newline in a value), since that is a bug in the caller, not a
        transient failure.
        """
        if not fields:
            raise ProtocolError("sd_notify message needs at least one field")
        lines = []
        for name, value in fields.items():
            if not _FIELD_NAME.fullmatch(name):
                raise ProtocolError(f"sd_notify field name {name!r} must match [A-Z][A-Z0-9_]*")
            text = str(value)
            if "\n" in text:
                raise ProtocolError(f"sd_notify field {name} contains a newline")
            lines.append(f"{name}={text}")
        return self._send(("\n".join(lines) + "\n").encode())

    def ready(self, status: str | None = None) -> bool:
        """Startup finished: the socket accepts requests."""
        if status is None:
            return self.notify(READY=1)
        return self.notify(READY=1, STATUS=_one_line(status))

    def status(self, text: str) -> bool:
        """A free-form status line shown by ``systemctl status``."""
        return self.notify(STATUS=_one_line(text))

    def stopping(self, status: str | None = None) -> bool:
        """Shutdown began (draining and flushing follow)."""
        if status is None:
            return self.notify(STOPPING=1)
        return self.notify(STOPPING=1, STATUS=_one_line(status))

    def reloading(self) -> bool:
        return self.notify(RELOADING=1)

    def watchdog(self) -> bool:
        """Keep-alive: the event loop is still running."""
        return self.notify(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for more time in the current start/stop phase (long disk rebuild or flush)."""
        if seconds <= 0:
            raise ProtocolError(f"extend_timeout needs a positive duration, got {seconds}")
        return self.notify(EXTEND_TIMEOUT_USEC=int(seconds * 1_000_000))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, payload: bytes) -> bool:
        if self._address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.settimeout(_SEND_TIMEOUT_S)
            self._sock.sendto(payload, self._address)
        except OSError as e:
            if not self._failure_logged:
                self._failure_logged = True
                logger.warning("sd_notify to %r failed: %s (further failures not logged)", self._address, e)
            else:
                logger.debug("sd_notify to %r failed: %s", self._address, e)
            return False
        return True

    def __repr__(self) -> str:
        return f"Notifier(address={self._address!r}, watchdog_interval_s={self.watchdog_interval_s})"


def _one_line(text: str) -> str:
    # A newline would start a new field; a status is one line.
    return " ".join(text.splitlines())


async def watchdog_loop(notifier: Notifier, interval_s: float) -> None:
    """Ping the watchdog every ``interval_s`` until cancelled.

    Run it as a task on the daemon's event loop: a loop that stops turning
    stops the pings, and systemd restarts the service.
    """
    if not interval_s > 0:
        raise ProtocolError(f"watchdog interval must be positive, got {interval_s}")
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval_s)
