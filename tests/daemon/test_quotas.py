"""Tenant quotas on the engine cycle: a real CacheService over a real 4-slab host tier,
tenants storing sequences as engines do (insert, backup, device eviction). Each test
reads as a script: fill -- flood -- count what each tenant kept."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.config import parse_quota
from hicache.daemon.core.host_tier import HostTier
from hicache.daemon.core.quotas import TenantQuotas
from hicache.daemon.core.service import CacheService
from hicache.errors import ConfigError
from hicache.index.keys import Namespace
from hicache.index.node import Tier
from hicache.layout import KVLayout
from tests.daemon.test_service import Clock, seq

LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=8, head_dim=128)  # 32 KiB
PB = LAYOUT.page_bytes
PER_SLAB = (1 << 20) // PB  # 32 pages: the 4 MiB tier has 4 slabs of 1 MiB, 128 pages


class Tenants:
    """Namespaces of model `m`, one per extra key, sharing a 4-slab host tier under `quotas`."""

    def __init__(self, *quotas: str, names: tuple[str, ...] = ("a", "b", "c")) -> None:
        self.svc = CacheService(HostTier(4 << 20, mlock=False), clock=Clock())
        self.svc.quotas = TenantQuotas(self.svc, {"host": self.svc.host.capacity_bytes, "disk": None})
        self.svc.quotas.replace_all(parse_quota(q) for q in quotas)
        self.owners = {n: object() for n in names}
        self.recs = {n: self.svc.register(o, Namespace("m", LAYOUT, extra_key=n), device_pages=1 << 16)
                     for n, o in self.owners.items()}
        self.seqs: dict[str, list[list[bytes]]] = {n: [] for n in names}
        self.next_dev = dict.fromkeys(names, 1)
        self.seed = 0

    def store(self, name: str, pages: int = 8) -> bool:
        """One new sequence of `pages` pages, backed up to host; False when the host refused it."""
        rec, owner = self.recs[name], self.owners[name]
        self.seed += 1
        keys, toks = seq(self.seed, pages, rec.ns.salt)
        dev = np.arange(self.next_dev[name], self.next_dev[name] + pages)
        self.next_dev[name] += pages
        _, _, bk = self.svc.insert(owner, rec.engine_id, keys, toks, dev)
        if bk is not None:
            self.svc.backup_done(owner, bk.backup_id, ok=True)
        self.svc.evict_device(owner, rec.engine_id, pages)  # host only from now on
        self.seqs[name].append(keys)
        return bk is not None

    def kept(self, name: str) -> int:
        """Pages of the tenant's sequences still on host (a match touches them)."""
        rec, owner = self.recs[name], self.owners[name]
        n = 0
        for keys in self.seqs[name]:
            pin = self.svc.match(owner, rec.engine_id, keys)
            n += pin.host_len
            self.svc.release(owner, pin.pin_id)
        return n

    def host_pages(self, name: str) -> int:
        return self.recs[name].ns.page_class.used_pages


def test_a_flood_cannot_push_a_tenant_below_its_minimum():
    t = Tenants("model=m,extra_key=a,tier=host,min=50%")
    for _ in range(6):
        assert t.store("a")  # 48 pages: below its minimum of 64
    for _ in range(40):  # 320 one-shot pages from b, more than the whole tier
        assert t.store("b")
    assert t.kept("a") == 48
    assert t.svc.quotas.within_quota(t.recs["a"].ns, Tier.HOST)


def test_without_a_quota_the_same_flood_pushes_the_tenant_out():
    t = Tenants()
    for _ in range(6):
        assert t.store("a")
    for _ in range(40):
        assert t.store("b")
    assert t.kept("a") < 48 // 2


def test_a_tenant_at_its_max_evicts_its_own_pages_for_its_new_ones():
    t = Tenants("model=m,extra_key=b,tier=host,max=25%")
    for _ in range(4):
        assert t.store("a")
    for _ in range(12):
        assert t.store("b")  # it stores, at the cost of its own oldest pages
        assert t.host_pages("b") <= PER_SLAB  # 25% of 128 pages
        assert t.svc.quotas.within_quota(t.recs["b"].ns, "host")
    assert t.kept("a") == 32  # nobody else paid
    assert t.kept("b") == PER_SLAB
    assert t.svc.quotas.throttled_pages["host"] >= 8 * 8


def test_idle_share_is_lent_out_and_taken_back_when_its_owner_stores():
    t = Tenants("model=m,extra_key=a,tier=host,min=50%")
    for _ in range(14):
        assert t.store("b")  # a is idle: b takes 112 of the 128 pages, a's share included
    assert t.host_pages("b") == 112
    for _ in range(8):
        assert t.store("a")  # a comes back: 64 pages, b gives them up
    assert t.kept("a") == 64 and t.host_pages("b") <= 128 - 64
    for _ in range(10):
        assert t.store("b")
    assert t.kept("a") == 64  # and keeps them under b's flood


def test_victims_come_first_from_the_tenant_most_over_its_minimum():
    t = Tenants("model=m,extra_key=a,tier=host,min=20%", "model=m,extra_key=b,tier=host,min=20%",
                names=("a", "b", "c", "d"))
    for name, seqs in (("a", 4), ("b", 4), ("c", 8)):  # a and b 6 pages over their 25.6; c 64 over none
        for _ in range(seqs):
            assert t.store(name)
    assert t.svc.host.free_slabs == 0
    for _ in range(4):
        assert t.store("d")  # 32 new pages of a tenant with no quota
    assert t.kept("a") == 32 and t.kept("b") == 32  # c, the most over, paid
    assert t.kept("c") <= 32


def test_a_tenant_above_a_lowered_max_is_the_first_victim_and_shrinks_as_it_stores():
    t = Tenants("model=m,extra_key=a,tier=host,min=10%", names=("a", "c"))
    for _ in range(8):
        assert t.store("a")
        assert t.store("c")  # the tier is full: 64 pages each
    a = t.recs["a"].ns
    t.svc.quotas.set(parse_quota("model=m,extra_key=a,tier=host,min=10%,max=25%"))
    assert not t.svc.quotas.within_quota(a, Tier.HOST)  # 64 pages, max 32: nothing evicted at once
    assert t.host_pages("a") == 64
    assert t.store("c")  # c is more over its minimum, but a is over its maximum: a pays
    assert t.host_pages("a") <= PER_SLAB and t.kept("c") == 72
    assert t.svc.quotas.within_quota(a, Tier.HOST)
    for _ in range(3):
        assert t.store("a")  # at its max: its own pages make room
        assert t.host_pages("a") <= PER_SLAB


def test_the_most_specific_quota_names_a_namespace():
    t = Tenants("model=m,tier=host,min=10%", "model=m,extra_key=b,tier=host,min=20%")
    q = t.svc.quotas
    by_salt = parse_quota(f"namespace={t.recs['c'].ns.salt.hex()},tier=host,max=50%")
    q.set(by_salt)
    assert q.quota_of(t.recs["a"].ns, "host").spec.extra_key is None  # the model's
    assert q.quota_of(t.recs["b"].ns, "host").spec.extra_key == "b"
    assert q.quota_of(t.recs["c"].ns, "host").spec is by_salt
    rows = {r["tenant"]: r for r in q.rows()}
    assert rows["model=m"]["namespaces"] == [t.recs["a"].ns.salt.hex()]


@pytest.mark.parametrize("spec, why", [
    ("model=m,tier=host,min=60%,max=50%", "more than max"),
    ("model=n,tier=host,min=70%", "add up to"),  # with the standing 40% of model m
    ("model=m,tier=disk,min=1%", "no disk tier"),
])
def test_a_bad_quota_is_refused_and_the_table_is_unchanged(spec, why):
    t = Tenants("model=m,tier=host,min=40%")
    before = t.svc.quotas.rows()
    with pytest.raises(ConfigError, match=why):
        t.svc.quotas.set(parse_quota(spec))
    assert t.svc.quotas.rows() == before


def test_without_quotas_nothing_of_them_runs():
    t = Tenants()
    assert not t.svc.quotas.active and t.svc.quotas.within_quota(t.recs["a"].ns, Tier.HOST)
    assert t.svc.quotas.rows() == []
