"""Authenticated remote records, end to end on a real redis-server. Anyone who can write
to the store can build a record whose checksums and key chain hold: without a secret a
daemon serves it (the poisoning is real), with one it refuses it, counts it, and the
engine recomputes the page. After a rotation, records under the old secret still read."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hicache.errors import HiCacheError
from hicache.tiers.remote import record as rr
from hicache.tiers.remote.auth import RecordAuth
from hicache.tiers.remote.redis_store import record_key
from hicache.tiers.remote.store import address
from tests.daemon.test_isolation import LAYOUT, engine, store, tokens
from tests.remote.test_faults import PAGES
from tests.remote.util import DAEMON_FLAGS, load_remote, remote_env, remote_stats, wait_remote_up, wait_written

SECRET = b"cluster-secret-6f1d2c3b4a5e6f708192a3b4"
NEW_SECRET = b"cluster-secret-rotated-0a1b2c3d4e5f6a7b"
ATTACKER = b"a-secret-of-the-attackers-own-choosing"
FORGED_AT = 5


def _secret_file(tmp_path, name: str, *secrets: bytes) -> str:
    f = tmp_path / name
    f.write_bytes(b"".join(s + b"\n" for s in secrets))
    f.chmod(0o600)
    return str(f)


def _daemon(daemon_factory, url: str, secret_file: str | None):
    env = remote_env(url, **({"HICACHE_REMOTE_SECRET_FILE": secret_file} if secret_file else {}))
    d = daemon_factory(*DAEMON_FLAGS, env=env).start()
    wait_remote_up(d.socket)
    return d


def _forge(server, cache, toks: np.ndarray, auth: RecordAuth | None) -> None:
    """Overwrite page FORGED_AT's record with arbitrary KV whose checksums and key chain
    hold, as any writer to the store can; signed with `auth` if given."""
    import redis

    keys = cache.client.page_keys(toks)
    ps = LAYOUT.page_size
    junk = np.random.default_rng(666).integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8)
    rec = rr.encode(cache.client.salt, keys[FORGED_AT], keys[FORGED_AT - 1], LAYOUT.fingerprint(),
                    toks[FORGED_AT * ps:(FORGED_AT + 1) * ps], junk, auth=auth)
    redis.Redis.from_url(server.url).set(record_key(address(cache.client.salt, keys, FORGED_AT)), bytes(rec))


@pytest.mark.parametrize("forger", ["unsigned", "another_secret"])
def test_a_forged_record_is_refused_counted_and_recomputed(forger, redis_standalone, daemon_factory, tmp_path):
    secret = _secret_file(tmp_path, "secret", SECRET)
    a = _daemon(daemon_factory, redis_standalone.url, secret)
    b = _daemon(daemon_factory, redis_standalone.url, secret)
    open_c = _daemon(daemon_factory, redis_standalone.url, None)  # unauthenticated: trusts the store
    ea, eb, ec = engine(a.socket, "t"), engine(b.socket, "t"), engine(open_c.socket, "t")
    toks = tokens(501, PAGES)
    store(ea, toks)
    wait_written(a.socket, PAGES)
    _forge(redis_standalone, ea, toks, None if forger == "unsigned" else RecordAuth([ATTACKER]))

    # B serves the pages before the forged one, each checked byte for byte, and nothing from it on:
    # the engine computes those pages itself
    assert load_remote(eb, toks) == FORGED_AT
    st = remote_stats(b.socket)
    reason = "unsigned" if forger == "unsigned" else "mac"
    assert st["corrupt_records"] == 1 and st["corrupt_reasons"] == {reason: 1}, st
    assert st["hit_pages"] == FORGED_AT
    # the threat is real: a daemon without a secret serves the forged KV
    with pytest.raises(AssertionError, match="KV came back changed"):
        load_remote(ec, toks)
    for e in (ea, eb, ec):
        e.close()


def test_records_under_the_old_secret_still_read_after_rotation(redis_standalone, daemon_factory, tmp_path):
    a = _daemon(daemon_factory, redis_standalone.url, _secret_file(tmp_path, "old", SECRET))
    b = _daemon(daemon_factory, redis_standalone.url, _secret_file(tmp_path, "rotated", NEW_SECRET, SECRET))
    ea, eb = engine(a.socket, "t"), engine(b.socket, "t")
    old = tokens(601, PAGES)
    store(ea, old)
    wait_written(a.socket, PAGES)
    assert load_remote(eb, old) == PAGES  # signed with the old secret, read by a rotated node
    new = tokens(602, PAGES)
    store(eb, new)  # a rotated node signs with the new secret...
    wait_written(b.socket, PAGES)
    assert load_remote(ea, new) == 0  # ...which a node not yet rotated cannot verify: a miss, counted
    assert remote_stats(a.socket)["corrupt_reasons"] == {"mac": 1}
    assert remote_stats(b.socket)["corrupt_records"] == 0
    ea.close()
    eb.close()


def test_records_written_before_a_secret_was_set_are_refused(redis_standalone, daemon_factory, tmp_path):
    before = _daemon(daemon_factory, redis_standalone.url, None)
    after = _daemon(daemon_factory, redis_standalone.url, _secret_file(tmp_path, "secret", SECRET))
    e0, e1 = engine(before.socket, "t"), engine(after.socket, "t")
    toks = tokens(701, PAGES)
    store(e0, toks)
    wait_written(before.socket, PAGES)
    assert load_remote(e1, toks) == 0
    assert remote_stats(after.socket)["corrupt_reasons"] == {"unsigned": 1}
    e0.close()
    e1.close()


def test_an_unauthenticated_tier_says_so_at_start_and_in_stats(redis_standalone, daemon_factory, tmp_path):
    plain = _daemon(daemon_factory, redis_standalone.url, None)
    signed = _daemon(daemon_factory, redis_standalone.url, _secret_file(tmp_path, "secret", SECRET, NEW_SECRET))
    assert plain.read_log().count("records are NOT authenticated") == 1
    assert "NOT authenticated" not in signed.read_log()
    for d, shown in ((plain, "auth none (unauthenticated records)"), (signed, "auth hmac-sha256, 2 secret(s)")):
        out = subprocess.run([sys.executable, "-m", "hicache.cli", "stats", "--socket", d.socket],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and shown in out.stdout, out.stdout + out.stderr
        assert SECRET.decode() not in out.stdout + d.read_log()


def test_a_bad_secret_file_stops_the_daemon_with_a_clear_error(tmp_path, daemon_factory):
    short = tmp_path / "short"
    short.write_text("too-short\n")
    d = daemon_factory(*DAEMON_FLAGS, env=remote_env("redis://127.0.0.1:1", HICACHE_REMOTE_SECRET_FILE=str(short)))
    with pytest.raises(HiCacheError, match="exited"):
        d.start()
    assert "remote_secret_file" in d.read_log() and "shorter than 16 bytes" in d.read_log()
