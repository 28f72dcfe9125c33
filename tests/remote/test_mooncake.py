"""The remote tier on a real Mooncake Store (a master and two storage processes on
loopback: two "machines"). Two daemons share pages bit-exact, the reference engine
served from the store gives the logits of recomputing, damaged and forged records are
refused, and the faults Mooncake has — a killed master (every call blocks ~4 s), a
master restarted empty, a killed storage process (`exist` says yes, `get` fails) —
cost lookups their deadline at most while the engine keeps being served."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from hicache.engine.cached import CachedEngine
from hicache.engine.model import ModelConfig, TinyTransformer
from hicache.errors import ConfigError
from hicache.tiers.remote import record as rr
from hicache.tiers.remote.auth import RecordAuth
from hicache.tiers.remote.mooncake.store import MooncakeStore
from hicache.tiers.remote.record import HEADER_BYTES
from hicache.tiers.remote.store import PageAddress, RemoteStoreError, address, open_store
from tests.daemon.test_isolation import LAYOUT, engine, store, tokens
from tests.remote.test_auth import ATTACKER, SECRET, _secret_file
from tests.remote.test_faults import _misses
from tests.remote.util import (DAEMON_FLAGS, admin, fetch_remote, load_remote, remote_env, remote_stats,
                               wait_remote_up, wait_written)
from tests.wait import wait_until

PAGES = 8
RECORD = rr.record_bytes(LAYOUT.page_size, LAYOUT.page_bytes)


def _daemons(daemon_factory, url: str, n: int = 2, **env: str):
    out = [daemon_factory(*DAEMON_FLAGS, env=remote_env(url, **env)).start() for _ in range(n)]
    for d in out:
        assert wait_remote_up(d.socket)["kind"] == "mooncake"
    return out


def _on_store(url: str, fn):
    """fn(store) on a connected MooncakeStore of our own (the test's view of the store)."""
    async def run():
        st = open_store(url)
        await st.connect()
        try:
            return await fn(st)
        finally:
            await st.close()
    return asyncio.run(run())


def test_store_calls_and_their_semantics(mooncake):
    salt = b"s" * 16
    pages = [PageAddress(salt, bytes([i]) * 16, bytes(16)) for i in range(4)]

    async def calls(st):
        assert await st.put([(p, memoryview(bytes([i]) * 5000)) for i, p in enumerate(pages[:3])], 0) == 3
        assert await st.exists(pages) == [True, True, True, False]
        got = await st.get(pages, 8192)
        assert [bytes(g) if g is not None else None for g in got] == [bytes([i]) * 5000 for i in range(3)] + [None]
        # a write overwrites (upsert): Mooncake's own put would keep the first record forever
        assert await st.put([(pages[0], memoryview(b"Z" * 100))], 86400) == 1
        assert bytes((await st.get(pages[:1], 8192))[0]) == b"Z" * 100
        assert await st.delete_namespace(salt) == 3
        assert await st.exists(pages) == [False] * 4
        assert st.staging.used == 0  # every call gave its staging space back
        return st.describe()

    desc = _on_store(mooncake.url, calls)
    assert desc["kind"] == "mooncake" and desc["master"] == mooncake.master_address and desc["helper_starts"] == 1


def test_a_dead_helper_fails_its_calls_and_the_next_connect_starts_another(mooncake):
    page = PageAddress(b"h" * 16, b"k" * 16, bytes(16))

    async def scenario(st):
        assert await st.put([(page, memoryview(b"x" * 100))], 0) == 1
        first = st._proc
        first.kill()  # as the OOM killer might
        deadline = time.monotonic() + 30  # a hang guard: the reader sees the socket close at once
        with pytest.raises(RemoteStoreError):
            while time.monotonic() < deadline:  # until the reader has seen the socket close
                await st.exists([page])
                await asyncio.sleep(0.01)
        await st.connect()  # what the remote worker's health loop does
        assert st._proc is not first and st.helper_starts == 2
        assert await st.exists([page]) == [True]  # the record lives in the storage process
        assert bytes((await st.get([page], 4096))[0]) == b"x" * 100
        assert st.staging.used == 0

    _on_store(mooncake.url, scenario)


@pytest.mark.parametrize("url", ["mooncake://", "mooncake://h", "mooncake://h:1?bogus=1", "mooncake://u:pw@h:1",
                                 "mooncake://h:1?staging_mib=0"])
def test_a_bad_mooncake_url_is_a_clear_config_error(url):
    with pytest.raises(ConfigError) as e:
        open_store(url)
    assert "pw" not in str(e.value)


def test_mooncake_has_no_password(tmp_path):
    f = tmp_path / "pw"
    f.write_text("x\n")
    with pytest.raises(ConfigError, match="remote_secret_file"):
        MooncakeStore("mooncake://127.0.0.1:1", password_file=str(f))


def test_pages_written_by_one_daemon_load_bit_exact_on_the_other(mooncake, daemon_factory):
    a, b = _daemons(daemon_factory, mooncake.url)
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    shared = tokens(1, 40)
    store(ea, shared)
    wait_written(a.socket, 40)
    assert load_remote(eb, shared) == 40  # every page from the store, verified, byte for byte
    st = remote_stats(b.socket)
    assert st["hit_pages"] == 40 and st["corrupt_records"] == 0 and st["errors"] == 0, st
    assert st["kind"] == "mooncake" and st["written_pages"] == 0
    ea.close()
    eb.close()


def test_reference_engine_served_from_mooncake_is_bitwise_exact(mooncake, daemon_factory):
    page, prompt_len, cached = 8, 61, 56
    model = TinyTransformer(ModelConfig(num_layers=2, hidden=64, head_dim=16, intermediate=128))
    prompt = torch.randint(0, 512, (prompt_len,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = CachedEngine.create(model, page_size=page, device_pages=64, use_cache=False).generate(
        prompt, 6, keep_logits=True)
    a, b = _daemons(daemon_factory, mooncake.url)
    on_a = CachedEngine.create(model, page_size=page, device_pages=32, socket_path=a.socket, backoff_s=(0.01, 0.1))
    on_b = CachedEngine.create(model, page_size=page, device_pages=32, socket_path=b.socket, backoff_s=(0.01, 0.1))
    try:
        assert on_a.generate(prompt, 6, keep_logits=True).computed_tokens == prompt_len
        assert on_a.wait_backups()
        wait_written(a.socket, cached // page)
        assert fetch_remote(on_b.cache, np.asarray(prompt[:-1], dtype=np.int32)) == cached // page
        served = on_b.generate(prompt, 6, keep_logits=True)
        assert served.cached_tokens == cached and served.computed_tokens == prompt_len - cached
        assert served.output_ids == ref.output_ids
        for step, (x, y) in enumerate(zip(served.logits, ref.logits)):
            assert torch.equal(x, y), f"step {step}"
        assert remote_stats(b.socket)["hit_pages"] == cached // page
    finally:
        on_a.close()
        on_b.close()


def test_damaged_and_forged_records_are_refused(mooncake, daemon_factory, tmp_path):
    secret = _secret_file(tmp_path, "secret", SECRET)
    a, b = _daemons(daemon_factory, mooncake.url, HICACHE_REMOTE_SECRET_FILE=secret)
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    damaged, forged = tokens(11, PAGES), tokens(12, PAGES)
    store(ea, damaged)
    store(ea, forged)
    wait_written(a.socket, 2 * PAGES)
    salt, ps = ea.client.salt, LAYOUT.page_size
    keys_d, keys_f = ea.client.page_keys(damaged), ea.client.page_keys(forged)

    async def tamper(st):
        # page 5 of one prompt: A's own record with three page bytes flipped
        victim = address(salt, keys_d, 5)
        rec = bytearray((await st.get([victim], RECORD))[0])
        rec[HEADER_BYTES + 4 * ps + 1000:HEADER_BYTES + 4 * ps + 1003] = b"\xff\x00\xff"
        # page 3 of the other: consistent KV of an attacker's choosing, under another secret
        junk = np.random.default_rng(666).integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8)
        fake = rr.encode(salt, keys_f[3], keys_f[2], LAYOUT.fingerprint(), forged[3 * ps:4 * ps], junk,
                         auth=RecordAuth([ATTACKER]))
        await st.put([(victim, memoryview(rec)), (address(salt, keys_f, 3), fake)], 0)

    _on_store(mooncake.url, tamper)
    assert load_remote(eb, damaged) == 5  # the pages before the bad record, each byte checked
    assert load_remote(eb, forged) == 3
    st = remote_stats(b.socket)
    assert st["corrupt_records"] == 2 and st["corrupt_reasons"] == {"mac": 2}, st
    ea.close()
    eb.close()


def test_a_killed_master_never_delays_a_match_and_a_restarted_one_is_used_again(mooncake, daemon_factory):
    a, b = _daemons(daemon_factory, mooncake.url)
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    old = tokens(21, PAGES)
    store(ea, old)
    wait_written(a.socket, PAGES)

    mooncake.kill_master()  # every Mooncake call now blocks ~4 s or fails
    down = _misses(eb, range(200, 220))
    assert max(down) < 0.5, down  # the daemon's own work: the probes run in the background, never waited for
    store(ea, tokens(22, PAGES))  # writes while down are held, then dropped: never waited for
    wait_until(lambda: remote_stats(b.socket)["state"] == "down", 30, "B to see the master down")
    assert load_remote(eb, old) == 0 and a.running and b.running  # the engine is served: a miss
    assert remote_stats(b.socket)["breaker_opens"] >= 1

    mooncake.start_master()  # same ports, no HA: the index is empty
    mooncake.wait_capacity()  # the storage processes re-register
    wait_remote_up(a.socket, 60)
    wait_remote_up(b.socket, 60)
    assert load_remote(eb, old) == 0  # lost with the master's index: a plain miss
    new = tokens(23, PAGES)
    before = remote_stats(a.socket)["written_pages"]
    store(ea, new)
    wait_until(lambda: remote_stats(a.socket)["written_pages"] >= before + PAGES, 30, "A to write again")
    wait_until(lambda: load_remote(eb, new) == PAGES, 30, "B to load the new pages")
    assert remote_stats(b.socket)["corrupt_records"] == 0
    ea.close()
    eb.close()


def test_killed_storage_processes_leave_lying_hints_that_are_survived(mooncake, daemon_factory):
    a, b = _daemons(daemon_factory, mooncake.url)
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    toks = tokens(31, PAGES)
    store(ea, toks)
    wait_written(a.socket, PAGES)
    for i in range(mooncake.storage):  # the memory holding every record is gone ...
        mooncake.kill_storage(i)
    # ... while the master still says the records exist (until --client_ttl passes)
    assert load_remote(eb, toks) == 0 and b.running
    st = remote_stats(b.socket)
    # the probe found them all, the fetch none: a miss, no corrupt record, no crash
    assert st["hit_pages"] == 0 and st["fetch_missing"] == PAGES and st["corrupt_records"] == 0, st
    for i in range(mooncake.storage):
        mooncake.start_storage(i)
    mooncake.wait_capacity()  # the dead processes' memory is forgotten: new records go to live ones
    again = tokens(32, PAGES)
    store(ea, again)
    wait_until(lambda: load_remote(eb, again) == PAGES, 60, "B to load pages written after the restart")
    ea.close()
    eb.close()


def test_a_daemon_restarted_with_a_warm_disk_publishes_what_the_store_lacks(mooncake, daemon_factory):
    a, b = _daemons(daemon_factory, mooncake.url, HICACHE_REMOTE_PUBLISH_PAGES="16")
    ea = engine(a.socket, "t")
    prompts = [tokens(41 + i, PAGES) for i in range(3)]  # three nodes of 8 pages
    for p in prompts:
        store(ea, p)
    wait_written(a.socket, 3 * PAGES)
    wait_until(lambda: admin(a.socket, "stats")["tiers"]["disk"]["pages"] == 3 * PAGES, 30, "A's disk writes")
    ea.close()
    a.stop()
    mooncake.kill_master()  # the store forgets everything ...
    mooncake.start_master()
    mooncake.wait_capacity()
    a.start()  # ... and A comes back with its pages on disk only
    st = wait_until(lambda: (s := remote_stats(a.socket))["publish_sweeps_done"] and s["queue_pages"] == 0
                    and s, 60, "A's sweep")
    # bounded: the budget's 16 pages probed and published (two whole nodes), no more
    assert st["publish_probed_pages"] == 16 and st["published_pages"] == 16, st
    wait_remote_up(b.socket, 60)
    eb = engine(b.socket, "t")
    # bit-exact, from the store (B never saw them); B's first call after the master's
    # restart may fail once (-900: its client reconnects), a miss for that lookup
    wait_until(lambda: sum(load_remote(eb, p) for p in prompts) == 16, 30, "B to load the published pages")
    eb.close()

    a.stop()
    a.env["HICACHE_REMOTE_PUBLISH_PAGES"] = "4096"
    a.start()  # again, unbounded: the store lacks only the third node now
    st = wait_until(lambda: (s := remote_stats(a.socket))["publish_sweeps_done"] and s["queue_pages"] == 0
                    and s, 60, "A's second sweep")
    assert st["publish_probed_pages"] == 24 and st["publish_present_pages"] == 16, st
    assert st["published_pages"] == 8, st
    eb = engine(b.socket, "t")
    assert sum(load_remote(eb, p) for p in prompts) == 3 * PAGES
    eb.close()
