"""The KV event bridge without a running engine: a real daemon, real clients and vLLM's own
`Request` (its block hasher gives the hashes), scripted as a scheduler drives it:

put 6 pages -> 6 blocks announced CPU with the request's hashes; flush host -> removed;
a small map -> the least recent announced blocks leave it, announced removed;
the daemon restarts -> every announced block removed, then announced again when touched.
"""

from __future__ import annotations

import os

import pytest

try:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
    from vllm.v1.request import Request

    from hicache.integrations.vllm.events import KVEventBridge
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)

from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.daemon.serve.launcher import LocalDaemon
from hicache.layout import KVLayout

from tests.wait import wait_until

PAGE = 16
LAYOUT = KVLayout("mha", 2, PAGE, "float32", num_kv_heads=2, head_dim=16)


def request(rid: str, tokens: list[int]) -> Request:
    init_none_hash(sha256)
    return Request(rid, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(PAGE, sha256))


def hashes(req: Request, n: int) -> list:
    return [maybe_convert_block_hash(h) for h in req.block_hashes[:n]]


class Events:
    """What the bridge has given vLLM so far, taken as vLLM's scheduler does, once per step."""

    def __init__(self, bridge: KVEventBridge) -> None:
        self.bridge = bridge
        self.seen: list = []

    def held(self, medium: str) -> list:
        for ev in self.bridge.take_events():
            self.seen.append(ev)
        out: list = []
        for ev in self.seen:
            if ev.medium != medium:
                continue
            if isinstance(ev, BlockStored):
                out += ev.block_hashes
            elif isinstance(ev, BlockRemoved):
                out = [h for h in out if h not in ev.block_hashes]
        return out


def put(client: HiCacheClient, bridge: KVEventBridge, req: Request) -> None:
    """What the scheduler side does for a step's full pages: put, note, copy, put_done."""
    n = len(req.all_token_ids) // PAGE
    keys = client.page_keys(req.all_token_ids[:n * PAGE])
    plan = client.put(req.all_token_ids[:n * PAGE], keys=keys)
    assert plan is not None
    bridge.note_put(0, req, keys, plan.present)
    if plan.put is not None:
        assert client.put_done(plan) is not None


def test_stored_removed_lru_and_restart(tmp_path):
    with LocalDaemon(tmp_path / "d", "--host-capacity", "64MiB", "--no-disk") as d:
        client = HiCacheClient(LAYOUT, 64, model="events", socket_path=d.socket)
        assert client.connect()
        bridge = KVEventBridge({0: client}, PAGE, PAGE, max_blocks=8)
        ev = Events(bridge)
        try:
            a = request("a", list(range(1, 6 * PAGE + 5)))

            def resynced(times: int) -> bool:
                ev.held("CPU")  # the (re)subscription is seen where events are taken
                return bridge.resyncs >= times
            wait_until(lambda: resynced(1), 30, "the bridge to subscribe")
            put(client, bridge, a)
            wait_until(lambda: ev.held("CPU") == hashes(a, 6), 30, "a's 6 blocks announced on CPU")
            first = next(e for e in ev.seen if isinstance(e, BlockStored))
            assert first.parent_block_hash is None and first.token_ids == a.all_token_ids[:6 * PAGE]
            assert first.block_size == PAGE and first.locality == "LOCAL"

            RpcConnection.one_call(d.socket, "flush", {"tier": "host"})
            wait_until(lambda: ev.held("CPU") == [], 30, "a's blocks removed after the flush")

            put(client, bridge, a)  # stored again: announced again
            wait_until(lambda: ev.held("CPU") == hashes(a, 6), 30, "a's blocks announced again")
            b = request("b", list(range(500, 500 + 3 * PAGE)))
            put(client, bridge, b)  # 9 blocks in a map of 8: a's first leaves, announced removed
            wait_until(lambda: set(ev.held("CPU")) == set(hashes(a, 6)[1:] + hashes(b, 3)), 30,
                       "a's least recent block removed, b's announced")

            d.stop()
            d.start()  # events were lost: everything announced is removed
            wait_until(lambda: resynced(2) and ev.held("CPU") == [], 60, "removals after the restart")
            client.match(b.all_token_ids)  # fails: the breaker opens and the probe reconnects
            wait_until(client.poll, 30, "the client back")
            put(client, bridge, b)  # touched again (a new put): announced again
            wait_until(lambda: ev.held("CPU") == hashes(b, 3), 30, "b announced after the restart")
        finally:
            bridge.close()
            client.close()


def test_a_block_is_announced_once_every_rank_holds_it(tmp_path):
    """TP: each rank stores its own shard in its own namespace; a router may count on a
    block only when all shards are there."""
    with LocalDaemon(tmp_path / "d", "--host-capacity", "64MiB", "--no-disk") as d:
        clients = {r: HiCacheClient(LAYOUT, 64, model="events-tp", socket_path=d.socket, tp_rank=r, tp_size=2)
                   for r in range(2)}
        assert all(c.connect() for c in clients.values())
        bridge = KVEventBridge(clients, PAGE, PAGE)
        ev = Events(bridge)
        try:
            a = request("a", list(range(1, 4 * PAGE + 1)))
            wait_until(lambda: (ev.held("CPU"), bridge.resyncs)[1] >= 1, 30, "the bridge to subscribe")
            n = 4
            plans = {}
            for r, c in clients.items():
                keys = c.page_keys(a.all_token_ids)
                plans[r] = c.put(a.all_token_ids, keys=keys)
                bridge.note_put(r, a, keys, plans[r].present)
            assert clients[0].put_done(plans[0]) == n

            def rank0_seen() -> bool:
                ev.held("CPU")
                return all(b.held[0] == 0b01 for b in bridge.blocks.values())
            wait_until(rank0_seen, 30, "rank 0's stored event taken")
            assert ev.held("CPU") == []  # rank 1's shards are not there yet
            assert clients[1].put_done(plans[1]) == n
            wait_until(lambda: ev.held("CPU") == hashes(a, n), 30, "a's blocks announced once both ranks hold them")
            assert sum(len(e.block_hashes) for e in ev.seen if isinstance(e, BlockStored)) == n  # once, not per rank
        finally:
            bridge.close()
            for c in clients.values():
                c.close()
