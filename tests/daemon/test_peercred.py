"""Peer credentials: only allowed uids / gids (primary or supplementary) get served."""

from __future__ import annotations

import os
import tempfile

import pytest

from hicache.client.connection import RpcConnection

# On each of the daemon's frame loops (tests/conftest.py).
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run clients as other users"),
              pytest.mark.usefixtures("frame_loop")]

def as_user(socket: str, uid: int, gid: int, groups: list[int]) -> str:
    """Connect from a forked child running as uid/gid/groups (no exec: the
    interpreter under /root is not readable by other users)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            c = RpcConnection.connect(socket, timeout_s=10)
            c.hello()
            c.call("stats")
            msg = "served"
        except Exception as e:  # noqa: BLE001 - reported to the parent
            msg = f"refused {type(e).__name__}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def test_allowed_by_uid_primary_or_supplementary_group(daemon_factory):
    public = tempfile.mkdtemp(prefix="hicache-peercred-")  # pytest's tmp dirs are private to root
    os.chmod(public, 0o755)
    d = daemon_factory("--host-capacity", "16MiB", "--no-disk",
                       env={"HICACHE_ALLOWED_GIDS": "4242", "HICACHE_ALLOWED_UIDS": "0,4343"})
    d.socket = os.path.join(public, "hicache.sock")
    d.start("--socket", d.socket)
    os.chmod(d.socket, 0o666)  # let every test user reach the socket: the peer check alone decides
    assert as_user(d.socket, 4444, 4444, [4242]) == "served"  # supplementary group
    assert as_user(d.socket, 4445, 4242, []) == "served"  # primary group
    assert as_user(d.socket, 4343, 5000, []) == "served"  # allowed uid
    assert as_user(d.socket, 4446, 4446, [4446]).startswith("refused")  # nobody we know
