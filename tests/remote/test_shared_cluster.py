"""Two daemons — two machines: their own sockets, arenas and disks — share one real
Redis Cluster (3 masters with a replica each). Pages one computes are hits for the
other, verified and loaded bit-exact end to end; the reference engine served from the
remote tier gives the logits of recomputing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from hicache.engine.cached import CachedEngine
from hicache.engine.model import ModelConfig, TinyTransformer
from tests.daemon.test_isolation import engine, store, tokens
from tests.remote.conftest import PASSWORD
from tests.remote.util import (DAEMON_FLAGS, admin, fetch_remote, load_remote, remote_env, remote_stats,
                               two_daemons, wait_remote_up, wait_written)

PAGES = 40  # 2.5 runs of 16 pages: a prefix spread over several hash slots


def test_pages_written_by_one_daemon_are_hits_for_the_other(redis_cluster, daemon_factory, tmp_path):
    pw_file = tmp_path / "redis.pw"
    pw_file.write_text(PASSWORD + "\n")
    a = daemon_factory(*DAEMON_FLAGS, env=remote_env(redis_cluster.url)).start()  # password in the URL
    b = daemon_factory(*DAEMON_FLAGS, env=remote_env(redis_cluster.url_without_password(),
                                                     HICACHE_REMOTE_PASSWORD_FILE=str(pw_file))).start()
    for d in (a, b):
        assert wait_remote_up(d.socket)["mode"] == "cluster"
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    shared, other = tokens(1, PAGES), tokens(2, 8)
    store(ea, shared)
    store(ea, other)
    wait_written(a.socket, PAGES + 8)

    # B never saw these prompts: every page comes from the store, verified, bit-exact
    assert load_remote(eb, shared) == PAGES
    st = remote_stats(b.socket)
    assert st["hit_pages"] == PAGES and st["corrupt_records"] == 0 and st["errors"] == 0
    assert load_remote(eb, other) == 8
    # a continuation nobody computed is a miss; the shared prefix still hits (from B's host now)
    longer = torch.cat([torch.from_numpy(shared), torch.from_numpy(tokens(3, 4))]).numpy()
    assert load_remote(eb, longer) == PAGES
    # B's copies went on to B's own disk (write-through), not back to the store
    assert remote_stats(b.socket)["written_pages"] == 0
    ea.close()
    eb.close()

    # the password is in no log, no stats reply, no `hicache stats` output
    for d in (a, b):
        assert PASSWORD not in d.read_log()
        assert PASSWORD not in str(admin(d.socket, "stats"))
        out = subprocess.run([sys.executable, "-m", "hicache.cli", "stats", "--socket", d.socket],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "remote" in out.stdout and PASSWORD not in out.stdout + out.stderr
    assert remote_stats(b.socket)["password"] == "file"


PAGE = 8
PROMPT_LEN = 61  # 7 full pages cached, 5 tokens to compute
CACHED = 56


def test_reference_engine_served_from_the_remote_tier_is_bitwise_exact(redis_cluster, daemon_factory):
    model = TinyTransformer(ModelConfig(num_layers=2, hidden=64, head_dim=16, intermediate=128))
    prompt = torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    scratch = CachedEngine.create(model, page_size=PAGE, device_pages=64, use_cache=False)
    ref = scratch.generate(prompt, 6, keep_logits=True)
    a, b = two_daemons(daemon_factory, redis_cluster.url)
    on_a = CachedEngine.create(model, page_size=PAGE, device_pages=32, socket_path=a.socket, backoff_s=(0.01, 0.1))
    on_b = CachedEngine.create(model, page_size=PAGE, device_pages=32, socket_path=b.socket, backoff_s=(0.01, 0.1))
    try:
        first = on_a.generate(prompt, 6, keep_logits=True)
        assert first.computed_tokens == PROMPT_LEN
        assert on_a.wait_backups()
        wait_written(a.socket, CACHED // PAGE)
        # B's client asks until its lookup ended (as an engine that waits for its lookups does),
        # so the store's pages are on B's host when the engine looks the prompt up
        assert fetch_remote(on_b.cache, np.asarray(prompt[:-1], dtype=np.int32)) == CACHED // PAGE
        served = on_b.generate(prompt, 6, keep_logits=True)
        # the daemon's remote pages come to the engine as its disk part does
        assert served.cached_tokens == CACHED and served.computed_tokens == PROMPT_LEN - CACHED
        assert served.output_ids == ref.output_ids
        for step, (x, y) in enumerate(zip(served.logits, ref.logits)):
            assert torch.equal(x, y), f"step {step}"
        assert remote_stats(b.socket)["hit_pages"] == CACHED // PAGE
    finally:
        on_a.close()
        on_b.close()
