"""The error tree. Scarcity (no free slots, cache miss) is a return value on
hot paths, never an exception; these are for misuse and broken state."""


class HiCacheError(Exception):
    """Root of every error hicache raises on purpose."""


class LayoutError(HiCacheError):
    """A KV layout is malformed or does not match the one registered."""


class ConfigError(HiCacheError):
    """A configuration value (flag, TOML key, HICACHE_* variable) is invalid."""


class ProtocolError(HiCacheError):
    """A frame or a message does not follow the wire protocol."""


class DiskTierError(HiCacheError):
    """The LMDB environment is foreign, damaged or unusable."""


class DiskTierDamaged(DiskTierError):
    """The environment's files are damaged, torn, foreign or of another format: an
    owner may move them aside (tiers/disk/env.py's quarantine) and start with an empty tier."""


class ClientError(HiCacheError):
    """Raised by the engine client when the daemon answered with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class DaemonUnavailable(ClientError):
    """The daemon cannot be reached; engines treat this as a miss."""

    def __init__(self, message: str, code: str = "UNAVAILABLE") -> None:
        super().__init__(code, message)


class DaemonUntrusted(DaemonUnavailable):
    """The process serving the socket runs as a uid the client does not trust (not its own,
    not root, not configured): nothing was sent to it. Engines treat it as an absent daemon."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "UNTRUSTED")


class DaemonRefused(DaemonUnavailable):
    """The daemon closed the connection at hello: it refuses this peer (its uid/gid is not
    allowed), or it is shutting down."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "REFUSED")


class DaemonSlow(DaemonUnavailable):
    """The daemon did not answer a call in time. The connection is kept (its answer, when it
    comes, is handled then: hicache/client/connection.py); engines treat it as a miss.
    `sent` False: the call was not even sent (the daemon had not answered an earlier one)."""

    def __init__(self, message: str, sent: bool = True) -> None:
        super().__init__(message, "SLOW")
        self.sent = sent
