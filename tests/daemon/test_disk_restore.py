"""A big disk tier's restore while the daemon answers (hicache/daemon/movers/disk_restore.py):
every page comes back, `settle` waits for it, and what runs meanwhile cannot lose the
namespace or hang a page under a parent that left the disk."""

from __future__ import annotations

from hicache.client.connection import RpcConnection
from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.core.service import CacheService
from hicache.index.keys import Namespace
from hicache.layout import KVLayout
from tests.daemon.test_cycle import run_worker


def _stats(sock: str) -> dict:
    c = RpcConnection.connect(sock, timeout_s=30)
    try:
        c.hello(timeout_s=30)
        return c.call("stats", {}, timeout_s=30)
    finally:
        c.close()


def _settle(sock: str) -> bool:
    c = RpcConnection.connect(sock, timeout_s=30)
    try:
        c.hello(timeout_s=30)
        return c.call("settle", {"timeout_s": 60}, timeout_s=90)["settled"]
    finally:
        c.close()


def test_a_restore_while_answering_brings_every_page_back(daemon_factory):
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "256MiB",
                       env={"HICACHE_LOAD_POLICY": "wait_complete", "HICACHE_RESTORE_SYNC_PAGES": "0"}).start()
    run_worker(d.socket, "store:7:64", "store:8:64", "store:9:96")
    assert _settle(d.socket)
    on_disk = _stats(d.socket)["tiers"]["disk"]["pages"]
    assert on_disk == 16 + 16 + 24
    d.kill9()
    d.start()
    assert _settle(d.socket)  # waits for the restore
    disk = _stats(d.socket)["tiers"]["disk"]
    assert not disk["restoring"] and disk["restored_pages"] == on_disk and disk["orphans_dropped"] == 0
    assert "pages to index while the daemon answers" in d.read_log()  # the path under test
    (b,) = run_worker(d.socket, "load:9:96")
    assert b["loaded"] == 24 and b["bad_pages"] == 0


def test_a_namespace_being_restored_is_not_forgotten_for_having_no_engine():
    svc = CacheService(HostTier(4 << 20, mlock=False))
    layout = KVLayout("mha", num_layers=1, page_size=4, dtype="float16", num_kv_heads=1, head_dim=8)
    namespace = Namespace("m", layout)
    ns = svc.namespace_state(namespace)
    ns.restoring = True  # its pages are on their way to its index
    owner = object()
    rec = svc.register(owner, namespace, 16)
    svc.disconnect(owner)  # its last engine leaves while the index is still empty
    assert svc.namespaces.get(ns.salt) is ns
    ns.restoring = False
    rec = svc.register(owner, namespace, 16)
    svc.disconnect(owner)
    assert ns.salt not in svc.namespaces and rec.ns is ns
    assert svc.host.used_bytes == 0
