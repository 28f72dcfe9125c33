"""32 engines cycling match / load / insert / release / evict / disconnect against one daemon.

The daemon's heap must stay flat between the end of the warm-up and the moment every
client has gone, and at the end every host slot must be accounted for: the host pages
in use are the ones the index holds, with no pin and no planned backup left behind.
CI soaks ~25 s; `--long` a few minutes (the driver is `hicache bench soak`).
"""

from __future__ import annotations

from hicache.bench.daemon.soak_bench import run_soak

CI_SECONDS = 25.0
LONG_SECONDS = 240.0
CLIENTS = 32
# Generous: the heap of a loaded daemon moves by a few MiB with allocator and GC timing;
# a leak per request or per connection grows it by tens of MiB over the soak.
HEAP_SLACK_KIB = 24 << 10
HEAP_SLACK_SHARE = 0.25


def test_32_clients_soak_keeps_memory_flat_and_every_host_slot_accounted_for(daemon_factory, long_mode):
    seconds = LONG_SECONDS if long_mode else CI_SECONDS
    d = daemon_factory("--host-capacity", "4MiB", "--disk-capacity", "8MiB").start()  # both fill in the warm-up
    res = run_soak(d.socket, clients=CLIENTS, duration_s=seconds, warmup_s=seconds * 0.3, seed=14)
    print("\n" + res.summary())
    assert d.running, f"the daemon died during the soak:\n{d.read_log()[-3000:]}"
    assert not res.errors, f"clients failed during the soak: {res.errors[:5]}"
    assert res.requests > CLIENTS, f"only {res.requests} requests in {seconds:.0f}s: {res.summary()}"
    assert res.pins == 0 and res.pending_backups == 0 and res.engines == 0, (
        f"after every client disconnected the daemon still holds: {res.summary()}")
    assert res.host_pages_used == res.host_pages_indexed, (
        f"{res.host_pages_used} host pages in use but the index holds {res.host_pages_indexed}: "
        f"{res.host_pages_used - res.host_pages_indexed} slots leaked ({res.summary()})")
    warm, end = res.memory_warm_kib["RssAnon"], res.memory_end_kib["RssAnon"]
    assert end <= warm * (1 + HEAP_SLACK_SHARE) + HEAP_SLACK_KIB, (
        f"the daemon's heap grew from {warm} KiB after warm-up to {end} KiB after the soak: {res.summary()}")
