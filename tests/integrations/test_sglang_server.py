"""SGLang's real server (`python -m sglang.launch_server`, sglang 0.5.23 on CPU) serving from hicache.

One test, two server processes (each start costs minutes on two cores):
  round 1 on server A: four prompts sharing a 320-token prefix, nothing cached
          anywhere yet (the reference outputs: computed from scratch);
  /flush_cache, round 2: SGLang's device and host caches are empty, so the
          cached tokens come from hicache, with outputs equal to round 1's;
  restart: server A and the daemon stop, the daemon restarts on its state dir
          (host empty, pages on disk), server B gets its hits from the disk;
  the daemon is killed mid-round: SGLang keeps serving, with the same outputs.
The server runs with the test-only stand-ins of tests/integrations/sglang_standins.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.daemon.disk_faults_util import free_port
from tests.integrations.sglang_util import StorageBackendFactory  # noqa: F401 - fails under CI without sglang
from tests.wait import wait_until

from hicache.bench.engines.tiny_llama import build_tiny_llama
from hicache.bench.procs.sglang_server import SGLangServer, server_args
from hicache.client.connection import RpcConnection

PREFIX, SUFFIX, PROMPTS = 320, 80, 4
STANDIN_ERROR = "not provided by hicache's CPU test stand-in"
REPO = Path(__file__).resolve().parents[2]
# first on the server's path: the CPU stand-ins (their sitecustomize), then this checkout
SERVER_PATH = [str(Path(__file__).resolve().parent / "sglang_standins"), str(REPO)]


def server(model: str, sock: str, log: Path) -> SGLangServer:
    port = free_port()
    # 5 s deadlines, not the backend's 0.5 s: on a loaded 2-core machine a starved daemon would
    # cost a lookup or a store its deadline, and SGLang rightly takes a miss (it never retries
    # a failed backup), which this test would count as a defect
    return SGLangServer(server_args(model, port, sock, extra={"deadlines": 5}), port, log, extra_path=SERVER_PATH)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 500) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(1, 500) for _ in range(SUFFIX)] for _ in range(PROMPTS)]


def stats(sock: str) -> dict:
    return RpcConnection.one_call(sock, "stats", {}, timeout_s=5.0)


def stored_all(sock: str, pages: int) -> bool:
    st = stats(sock)
    return st["tiers"]["host"]["pages"] >= pages and st["tiers"]["disk"]["queue_depth"] == 0


@pytest.mark.slow
def test_sglang_server_serves_from_hicache_across_flush_restart_and_a_dead_daemon(daemon_factory, tmp_path):
    model = str(build_tiny_llama(tmp_path / "tiny-llama"))
    d = daemon_factory("--host-capacity", "64MiB", "--disk-capacity", "256MiB").start()
    work = prompts(seed=27)
    full_pages = PREFIX // 16 + PROMPTS * (SUFFIX // 16)  # distinct full prompt pages: 20 + 4 x 5
    a = server(model, d.socket, tmp_path / "server-a.log")
    try:
        a.start()
        round1 = [a.generate(p) for p in work]
        assert all(c.get("storage", 0) == 0 for _, c in round1), round1  # nothing came from hicache
        reference = [out for out, _ in round1]
        wait_until(lambda: stored_all(d.socket, full_pages - PROMPTS), 120, "round 1's pages stored in hicache")

        a.flush_cache()  # SGLang's device and host caches empty; its storage threads restart
        round2 = [a.generate(p) for p in work]
        assert [out for out, _ in round2] == reference
        first = round2[0][1]
        assert first["device"] == 0 and first["host"] == 0 and first["storage"] >= PREFIX, round2
        st = stats(d.socket)
        assert st["requests"]["loaded_pages"] >= PREFIX // 16 and st["tiers"]["host"]["hit_rate"] > 0
        assert st["puts"]["committed_pages"] >= full_pages - PROMPTS
        mine = [e for e in st["engines"] if e["pid"] is not None]
        assert 1 <= len(mine) <= 4, mine  # pooled connections: not 4 more per flush
    finally:
        a.stop()
    assert STANDIN_ERROR not in a.log_tail(10**7)

    d.stop()  # SIGTERM: the disk queue is flushed
    d.start()  # host tier empty: every page is on disk only
    b = server(model, d.socket, tmp_path / "server-b.log")
    try:
        b.start()
        out, cached = b.generate(work[0])
        assert out == reference[0] and cached["storage"] >= PREFIX, cached  # from the daemon's disk
        assert stats(d.socket)["tiers"]["disk"]["prefetched_pages"] >= PREFIX // 16

        b.flush_cache()
        out, cached = b.generate(work[1])  # mid-round: one answer from hicache, then the daemon dies
        assert out == reference[1] and cached["storage"] >= PREFIX, cached
        d.kill9()
        rest = [b.generate(p) for p in work[2:]] + [b.generate(work[0])]
        assert [o for o, _ in rest] == reference[2:] + reference[:1]
        fresh = prompts(seed=28)[0]  # a new prompt: SGLang asks the dead daemon and computes it
        assert len(b.generate(fresh)[0]) == 8
        assert b._ready()
    finally:
        b.stop()
    assert STANDIN_ERROR not in b.log_tail(10**7)
