"""Keyed (SGLang) pages are chains in the radix index (hicache/daemon/ingest/keyed.py):
a prompt's tail is evicted before its head, a page stored before its parent is linked
when the parent arrives, and lookups starting mid-prefix stay one call per batch."""

from __future__ import annotations

import numpy as np

from hicache.client.client import HiCacheClient
from hicache.client.connection import RpcConnection
from hicache.client.keyed import KeyedPagesClient, named_page
from hicache.layout import KVLayout

LAYOUT = KVLayout("mha", 32, 8, "float16", num_kv_heads=2, head_dim=16)  # 32 KiB pages
SMALL_HOST = ("--host-capacity", "1MiB", "--no-disk")  # 32 pages of LAYOUT


def stats(sock: str) -> dict:
    return RpcConnection.one_call(sock, "stats", None, timeout_s=5.0)


def host_capacity_pages(sock: str) -> int:
    return stats(sock)["tiers"]["host"]["capacity_bytes"] // LAYOUT.page_bytes


def keyed(sock: str) -> KeyedPagesClient:
    client = HiCacheClient(LAYOUT, 1, model="m", socket_path=sock)
    assert client.connect()
    return KeyedPagesClient(client)


def names(kc: KeyedPagesClient, *labels: str) -> tuple[list[bytes], np.ndarray]:
    pairs = [named_page(kc.client.salt, s.encode(), LAYOUT.page_size) for s in labels]
    return [k for k, _ in pairs], np.concatenate([t for _, t in pairs])


def write(kc: KeyedPagesClient, slot: int, fill: int) -> None:
    pb = LAYOUT.page_bytes
    kc.client.arena.array[slot * pb:(slot + 1) * pb] = fill


def read(kc: KeyedPagesClient, slot: int) -> bytes:
    pb = LAYOUT.page_bytes
    return bytes(kc.client.arena.array[slot * pb:(slot + 1) * pb])


def store(kc: KeyedPagesClient, labels: list[str], fill: int, parent: str | None = None) -> int | None:
    keys, tokens = names(kc, *labels)
    parent_key = names(kc, parent)[0][0] if parent is not None else None
    r = kc.store(keys, tokens, parent_key)
    assert r is not None and kc.mapped(r.host_pages)
    for slot in r.host_pages[r.host_pages >= 0].tolist():
        write(kc, slot, fill)
    return kc.store_done(r)


def prompt(name: str, n: int) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


def still_stored(kc: KeyedPagesClient, labels: list[str]) -> list[bool]:
    keys, _ = names(kc, *labels)
    return [kc.exists([k]) == 1 for k in keys]


def test_a_prompts_tail_is_evicted_before_its_head(daemon_factory):
    d = daemon_factory(*SMALL_HOST).start()
    kc = keyed(d.socket)
    n_host = host_capacity_pages(d.socket)
    # prompt A in three batches, each naming the last page of the one before (SGLang's prefix_keys)
    a = prompt("a", 12)
    assert store(kc, a[:4], fill=1) == 4
    assert store(kc, a[4:8], fill=2, parent=a[3]) == 4
    assert store(kc, a[8:], fill=3, parent=a[7]) == 4
    # a newer prompt fills the rest of the host tier and then some: A's oldest pages must go
    b = prompt("b", n_host - 6)
    for i in range(0, len(b), 4):
        assert store(kc, b[i:i + 4], fill=4, parent=b[i - 1] if i else None) is not None
    left = still_stored(kc, a)
    kept = sum(left)
    assert 0 < kept < len(a), left  # some of A went, not all
    # a flat layout evicts A's head first (its oldest page): every later page useless
    assert left == [True] * kept + [False] * (len(a) - kept), f"a hole in A's prefix: {left}"
    keys, _ = names(kc, *a)
    assert kc.exists(keys) == kept
    kc.client.close()


def test_mid_prefix_exists_and_fetch_are_one_call_per_batch(daemon_factory):
    daemon = daemon_factory(*SMALL_HOST).start()
    a, b = keyed(daemon.socket), keyed(daemon.socket)
    labels = prompt("p", 12)
    assert store(a, labels[:6], fill=11) == 6
    assert store(a, labels[6:], fill=12, parent=labels[5]) == 6
    keys, _ = names(b, *labels)
    before = stats(daemon.socket)["requests"]
    assert b.exists(keys[7:]) == 5  # starts inside the second batch: no walk from the chain's head
    assert b.exists(keys[3:] + names(b, "nope")[0]) == 9
    after = stats(daemon.socket)["requests"]
    assert after["matches"] - before["matches"] == 2  # one lookup per call
    assert after["requested_pages"] - before["requested_pages"] == 5 + 10
    f = b.fetch(keys[4:10])
    assert f is not None and (f.host_pages >= 0).all()
    assert [read(b, s)[:1] for s in f.host_pages.tolist()] == [b"\x0b"] * 2 + [b"\x0c"] * 4
    b.release(f)
    assert stats(daemon.socket)["requests"]["matches"] == after["matches"]  # fetch walks nothing either
    a.client.close()
    b.client.close()


def test_a_page_stored_before_its_parent_is_linked_when_the_parent_arrives(daemon_factory):
    d = daemon_factory(*SMALL_HOST).start()
    kc = keyed(d.socket)
    n_host = host_capacity_pages(d.socket)
    a = prompt("a", 12)
    assert store(kc, a[6:], fill=1, parent=a[5]) == 6  # the tail first: its parent is not stored yet
    assert store(kc, a[:6], fill=2) == 6  # the head arrives: the tail's chain hangs under it
    assert kc.exists(names(kc, *a[6:])[0]) == 6  # the tail is now the most recently used half
    b = prompt("b", n_host - 6)
    for i in range(0, len(b), 4):
        store(kc, b[i:i + 4], fill=3, parent=b[i - 1] if i else None)
    left = still_stored(kc, a)
    kept = sum(left)
    assert 0 < kept < len(a), left
    # unlinked, the head (least recently used) would go first; linked, only leaves are candidates
    assert left == [True] * kept + [False] * (len(a) - kept), f"a hole in A: {left}"
    kc.client.close()


def test_a_bad_parent_is_refused_and_changes_nothing(daemon_factory):
    daemon = daemon_factory(*SMALL_HOST).start()
    kc = keyed(daemon.socket)
    keys, tokens = names(kc, "x")
    r = RpcConnection.one_call(daemon.socket, "stats", None, timeout_s=5.0)
    assert kc.store(keys, tokens, parent=b"short") is None  # BAD_PARAMS: answered as "no room"
    assert kc.exists(keys) == 0
    assert stats(daemon.socket)["tiers"]["host"]["pages"] == r["tiers"]["host"]["pages"]
    kc.client.close()
    assert np.array_equal(tokens, names(kc, "x")[1])
