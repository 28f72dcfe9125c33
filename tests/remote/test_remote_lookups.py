"""A match never waits for the remote store; the engine asks again (`load`, `until`).

The scene of issue 41: two daemons on one Redis Cluster, A computed three prompts that
share a 160-token prefix, B serves them in order. With a fixed 5 ms lookup deadline B hit
39 to 60 of the 60 pages, run to run, on a loaded machine; now a probe that answers late
still counts, and B gets every page with the default settings. Then the store is stopped
(SIGSTOP: connections hang, nothing is refused): a match answers at once with `pending`,
`load until=now` at once, `until=complete` once the store is back or its op timeout passed,
on a connection that stays usable."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from hicache.errors import ClientError
from hicache.rpc.protocol import Code
from tests.daemon.test_isolation import engine, load_exact, store, tokens
from tests.remote.util import fetch_remote, remote_stats, two_daemons, wait_remote_up, wait_written
from tests.wait import wait_until

PREFIX_PAGES = 10  # 160 tokens of 16
OWN_PAGES = 10  # after the prefix, each prompt's own
PROMPTS = 3


def scene_prompts(seed: int) -> list[np.ndarray]:
    prefix = tokens(seed, PREFIX_PAGES)
    return [np.concatenate([prefix, tokens(seed + 1 + i, OWN_PAGES)]) for i in range(PROMPTS)]


def test_the_scene_every_remote_page_is_a_hit_with_the_default_settings(redis_cluster, daemon_factory):
    flags = ("--host-capacity", "16MiB", "--disk-capacity", "64MiB")
    a = daemon_factory(*flags, env={"HICACHE_REMOTE_URL": redis_cluster.url}).start()
    wait_remote_up(a.socket)
    ea = engine(a.socket, "t")
    prompts = scene_prompts(4100)
    for p in prompts:
        store(ea, p)
    wait_written(a.socket, PREFIX_PAGES + PROMPTS * OWN_PAGES, 60)  # every record in the cluster
    b = daemon_factory(*flags, env={"HICACHE_REMOTE_URL": redis_cluster.url}).start()
    wait_remote_up(b.socket)
    eb = engine(b.socket, "t")
    # B's client asks as the engine's does: while a lookup is pending (or a part below host
    # remains), `load until=complete`. Each prompt: its own pages from the store, the shared
    # prefix from B's host after the first one.
    hits = [fetch_remote(eb, p) for p in prompts]
    assert hits == [PREFIX_PAGES + OWN_PAGES] * PROMPTS, hits  # 60 of 60
    for p in prompts:  # and every page is what A computed, byte for byte
        assert load_exact(eb, p) == PREFIX_PAGES + OWN_PAGES
    st = remote_stats(b.socket)
    assert st["hit_pages"] == PREFIX_PAGES + PROMPTS * OWN_PAGES and st["corrupt_records"] == 0, st
    assert st["probes_failed"] == 0 and st["unclaimed_pages"] == 0, st
    ea.close()
    eb.close()


def _match(client, keys: list[bytes]) -> dict:
    return client.conn.call("match", {"engine": client.engine_id, "keys": b"".join(keys)}, timeout_s=30.0)


def test_a_stopped_store_never_delays_a_match_and_load_waits_only_when_asked(redis_standalone, daemon_factory):
    # an op timeout longer than the test: a probe can only end when the store answers
    a, b = two_daemons(daemon_factory, redis_standalone.url, HICACHE_LOAD_POLICY="best_effort",
                       HICACHE_REMOTE_TIMEOUT_S="60")
    ea, eb1, eb2 = engine(a.socket, "t"), engine(b.socket, "t"), engine(b.socket, "t")
    first, second = tokens(4201, 8), tokens(4202, 8)
    store(ea, first)
    store(ea, second)
    wait_written(a.socket, 16)
    asks = [(eb1.client, first), (eb2.client, second)]  # two engines of B, a connection each
    redis = redis_standalone.nodes[0]
    redis.pause()
    try:
        # Both matches answer while the store is stopped: the local part (nothing), and a
        # probe each, running side by side, neither skipped for the other
        matches = [_match(c, c.page_keys(toks)) for c, toks in asks]
        for m in matches:
            assert m["pending"] is True and m["host_pages"] == b"" and m["disk_len"] == 0, m
        c1 = eb1.client
        now = c1.conn.call("load", {"pin": matches[0]["pin"], "until": "now"}, timeout_s=30.0)
        assert now["pending"] is True and now["disk_len"] == 0, now  # the probe still runs
        assert remote_stats(b.socket)["probes_in_flight"] == 2
        replies: dict[int, dict] = {}

        def load_complete(i: int, c, pin: int) -> None:
            replies[i] = c.conn.call("load", {"pin": pin, "until": "complete"}, timeout_s=120.0)

        askers = [threading.Thread(target=load_complete, args=(i, c, m["pin"]))
                  for i, ((c, _), m) in enumerate(zip(asks, matches))]
        for t in askers:
            t.start()
        wait_until(lambda: remote_stats(b.socket)["probe_waits"] >= 2, 30, "both loads to wait for their probes")
        assert not replies  # nothing can answer them while the store is stopped
    finally:
        redis.resume()
    for t in askers:
        t.join(120)
    # complete: the probes answered, the fetches ended, every page is on host, nothing pending
    assert sorted(replies) == [0, 1], replies
    for r in replies.values():
        assert "pending" not in r and len(r["host_pages"]) // 4 == 8 and r["disk_len"] == 0, r
    for (c, _), m in zip(asks, matches):
        c.conn.call("release", {"pin": m["pin"]}, timeout_s=30.0)
    assert load_exact(eb1, first) == 8 and load_exact(eb2, second) == 8
    st = remote_stats(b.socket)
    assert st["probes_failed"] == 0 and st["hit_pages"] == 16 and st["probes_in_flight"] == 0, st
    for e in (ea, eb1, eb2):
        e.close()


def test_a_probe_the_stopped_store_never_answers_ends_at_the_op_timeout(redis_standalone, daemon_factory):
    a, b = two_daemons(daemon_factory, redis_standalone.url)  # the default op timeout, 1 s
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    toks = tokens(4301, 8)
    store(ea, toks)
    wait_written(a.socket, 8)
    c = eb.client
    redis = redis_standalone.nodes[0]
    redis.pause()
    try:
        m = _match(c, c.page_keys(toks))
        assert m["pending"] is True, m
        # answered once the probe failed at the op timeout: a miss, nothing pending, no hang
        r = c.conn.call("load", {"pin": m["pin"], "until": "complete"}, timeout_s=60.0)
        assert "pending" not in r and r["host_pages"] == b"" and r["disk_len"] == 0, r
        st = remote_stats(b.socket)
        assert st["probes_failed"] == 1 and st["probes_in_flight"] == 0, st
        # the same connection carries on
        assert c.conn.call("release", {"pin": m["pin"]}, timeout_s=30.0) is True
        with pytest.raises(ClientError) as e:
            c.conn.call("load", {"pin": m["pin"], "until": "now"}, timeout_s=30.0)
        assert e.value.code == Code.NOT_FOUND.value
    finally:
        redis.resume()
    wait_remote_up(b.socket)
    assert fetch_remote(eb, toks) == 8  # the store back: a hit
    assert load_exact(eb, toks) == 8
    ea.close()
    eb.close()


def test_the_scene_through_the_vllm_connectors_scheduler_side(redis_cluster, daemon_factory):
    """The same scene as vLLM's scheduler side makes its lookups, with the connector's
    defaults: each request asks again until its match, then its remote part, are in; B offers
    vLLM all 60 pages."""
    vllm_scheduler = pytest.importorskip("hicache.integrations.vllm.scheduler", reason="vLLM is not installed")
    from hicache.integrations.vllm.layout import EngineShape, expected_arrangement
    from hicache.integrations.vllm.metadata import HiCacheWorkerMeta
    from hicache.layout import KVLayout
    from tests.integrations.test_vllm_step_puts import ask as vllm_ask

    layout = KVLayout("mha", 2, 16, "float32", num_kv_heads=2, head_dim=32)
    shape = EngineShape("m", layout, 1, "cpu", expected_arrangement(False, 16, 2, 32, "float32"))
    flags = ("--host-capacity", "16MiB", "--disk-capacity", "64MiB")
    a = daemon_factory(*flags, env={"HICACHE_REMOTE_URL": redis_cluster.url}).start()
    wait_remote_up(a.socket)
    prompts = [[int(t) for t in p] + [7] for p in scene_prompts(4300)]  # 20 full pages and one token
    sa = vllm_scheduler.SchedulerSide(shape, 64, a.socket)
    for p in prompts:  # A computed them (the bytes do not matter to the lookups)
        c = sa.clients[0]
        assert c.put_done(c.put(p)) is not None
    wait_written(a.socket, PREFIX_PAGES + PROMPTS * OWN_PAGES, 60)
    sa.close()
    b = daemon_factory(*flags, env={"HICACHE_REMOTE_URL": redis_cluster.url}).start()
    wait_remote_up(b.socket)
    sb = vllm_scheduler.SchedulerSide(shape, 64, b.socket)
    try:
        offered = []
        for i, p in enumerate(prompts):
            req = SimpleNamespace(request_id=f"r{i}", all_token_ids=p, prompt_embeds=None, lora_request=None,
                                  cache_salt=None, mm_features=[], num_prompt_tokens=len(p))
            n = vllm_ask(sb, req)
            offered.append(n // 16)
            sb.after_alloc(req, (list(range(1, 22)),), n)
            sb.build_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, preempted_req_ids=None,
                                          scheduled_cached_reqs=SimpleNamespace(
                                              req_ids=[], num_computed_tokens=[], new_block_ids=[],
                                              resumed_req_ids=set())))
            sb.on_output(HiCacheWorkerMeta(loaded={req.request_id}))  # loaded: the pins go
        assert offered == [PREFIX_PAGES + OWN_PAGES] * PROMPTS, offered  # 60 of 60
        assert sb.lookups.given_up == 0
    finally:
        sb.close()
