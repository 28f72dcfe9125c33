"""Wire protocol: version, method names and stable error codes.

Request  `{"id": int, "method": str, "params": map}`, optionally `"noreply": true`
Response `{"id": int, "result": any}` or `{"id": int, "error": {"code": str, "message": str}}`
Event    `{"event": map}` (pushed to connections that called `subscribe`)

A `noreply` request (a client's posted call: a release, a finished copy) gets an
answer only when it fails: a success would be a frame to write and to read, and
in a client's tight loop a wake-up, for nothing. A connection's requests are
handled in order, so the answer to any later request tells its sender that the
earlier ones were handled; `sync` is the no-op for that. A daemon that predates
`noreply` answers every request, which the client reads and drops.
"""

from __future__ import annotations

from enum import Enum

PROTOCOL_VERSION = 2  # 2: slab fds by namespace (map_slabs), none with hello
# The largest prefill rate (tokens/s) an engine may report (`register`, `report`): beyond any
# real engine, far short of what would overflow the daemon's arithmetic.
MAX_PREFILL_RATE = 1e12


class Code(str, Enum):
    BAD_REQUEST = "BAD_REQUEST"          # not a well-formed request map
    UNKNOWN_METHOD = "UNKNOWN_METHOD"
    BAD_PARAMS = "BAD_PARAMS"            # wrong types, lengths, out-of-range ids
    NOT_REGISTERED = "NOT_REGISTERED"    # unknown engine, or an engine of another connection
    NOT_FOUND = "NOT_FOUND"              # unknown match / backup handle (e.g. released twice)
    VERSION = "VERSION"                  # protocol version not supported
    BUSY = "BUSY"                        # too many requests in flight on this connection, or fds cannot go now
    HELLO_REQUIRED = "HELLO_REQUIRED"    # a request before a successful hello
    FORBIDDEN = "FORBIDDEN"              # the peer lacks the admin role, or the namespace is not its own
    SHUTTING_DOWN = "SHUTTING_DOWN"
    INTERNAL = "INTERNAL"


class RpcError(Exception):
    """Raised by handlers; the server turns it into an error response."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
