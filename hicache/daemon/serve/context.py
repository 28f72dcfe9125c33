"""What the RPC handlers see of the daemon: a protocol, so they need not import the daemon.

hicache.daemon.serve.app builds the handlers (handlers.py, portable.py) and passes itself in;
typing that argument with app.Daemon made handlers and portable import app back. They
type it with DaemonContext instead, which app.Daemon satisfies structurally, so imports
flow one way: app -> handlers -> portable -> context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from hicache.config import Config
    from hicache.daemon.core.host_tier import HostTier
    from hicache.daemon.core.retention import Retention
    from hicache.daemon.hybrid.states import HybridStates
    from hicache.daemon.ingest.puts import HostPuts
    from hicache.daemon.core.service import CacheService


@runtime_checkable
class DaemonContext(Protocol):
    """The daemon's parts the handlers use; a tier not up yet (or disabled) is None."""

    config: Config
    started_at: float  # unix seconds
    host: HostTier | None
    service: CacheService | None
    disk: Any  # DiskMover once the disk tier is up (the disk tier is optional)
    remote: Any  # RemoteMover with --remote-url (redis-py stays optional)
    hybrid: HybridStates | None
    puts: HostPuts | None
    retention: Retention | None  # pinned prefixes
    instance: str  # random per daemon start: a new instance has a new arena

    def stats(self) -> dict: ...
