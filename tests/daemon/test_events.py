"""KV events for routers: an asyncio subscriber sees pages stored and removed."""

from __future__ import annotations

import asyncio

import pytest

from hicache.client.async_client import AsyncRpcConnection
from hicache.index.keys import Namespace, page_keys

from tests.daemon.engine_worker import LAYOUTS, tokens_for
from tests.daemon.test_cycle import run_worker
from tests.wait import events_until_quiet

# Each test runs on both of the daemon's frame loops (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("frame_loop")


def test_subscriber_sees_stored_and_removed_events(daemon):
    async def scenario() -> list[dict]:
        sub = await AsyncRpcConnection.connect(daemon.socket)
        await sub.subscribe()
        # many requests in flight on one connection, answered by id
        results = await asyncio.gather(*(sub.call("stats") for _ in range(20)))
        assert all(r["pid"] == results[0]["pid"] for r in results)
        await asyncio.to_thread(run_worker, daemon.socket, "store:11:40")
        admin = await AsyncRpcConnection.connect(daemon.socket)
        await admin.call("flush", {"tier": "host"})
        await admin.close()
        return await events_until_quiet(sub)

    events = asyncio.run(scenario())
    salt = Namespace("test-model", LAYOUTS["mha"]).salt()
    keys = page_keys(salt, tokens_for(11, 40), 4)
    stored = {(e["tier"]) for e in events if e["type"] == "stored" and set(e["keys"]) <= set(keys)}
    removed = {(e["tier"]) for e in events if e["type"] == "removed"}
    assert {"device", "host"} <= stored
    assert "host" in removed and "device" in removed  # flushed, and the engine's exit dropped its pages
    all_stored = [k for e in events if e["type"] == "stored" and e["tier"] == "host" for k in e["keys"]]
    assert sorted(all_stored) == sorted(keys)
    assert all(e["namespace"] == salt.hex() for e in events)
