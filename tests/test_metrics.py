"""Metrics: values through the real /metrics endpoint, names, bounded labels."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.daemon.serve.metrics import Metrics, MetricsError
from hicache.errors import ConfigError


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_scrape_over_loopback_reports_what_the_daemon_recorded():
    m = Metrics()
    # A short scenario: host tier fills, a match hits 3 host pages and
    # misses 2, the pages are loaded to the device, one host page is evicted.
    m.set_tier("host", capacity_bytes=1 << 30, used_bytes=3 << 16, pages=3)
    m.add_hits("host", 3)
    m.add_misses(2)
    m.add_bytes_moved("host", "device", 3 << 16)
    m.add_evictions("host")
    m.observe_rpc("match", 40e-6)
    m.observe_rpc("match", 3e-3)
    m.observe_rpc("load", 2e-4, code="BUSY")
    m.observe_disk("write", 0.02)
    m.set_engines(2)
    m.set_queue_depth("disk_write", 7)

    with m.start_http(0) as server:
        assert server.addr == "127.0.0.1"
        samples = scrape(server.url)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("hicache_tier_capacity_bytes", tier="host") == 1 << 30
    assert value("hicache_tier_used_bytes", tier="host") == 3 << 16
    assert value("hicache_tier_pages", tier="host") == 3
    assert value("hicache_tier_pages", tier="disk") == 0
    assert value("hicache_hits_total", tier="host") == 3
    assert value("hicache_hits_total", tier="device") == 0
    assert value("hicache_misses_total") == 2
    assert value("hicache_bytes_moved_total", src="host", dst="device") == 3 << 16
    assert value("hicache_bytes_moved_total", src="device", dst="host") == 0
    assert value("hicache_evictions_total", tier="host") == 1
    assert value("hicache_requests_total", method="match", code="OK") == 2
    assert value("hicache_requests_total", method="load", code="BUSY") == 1
    assert value("hicache_rpc_latency_seconds_count", method="match") == 2
    assert value("hicache_rpc_latency_seconds_sum", method="match") == pytest.approx(3.04e-3)
    # 40 us falls in the 50 us bucket, 3 ms only from the 5 ms bucket on.
    assert value("hicache_rpc_latency_seconds_bucket", method="match", le="5e-05") == 1
    assert value("hicache_rpc_latency_seconds_bucket", method="match", le="0.0025") == 1
    assert value("hicache_rpc_latency_seconds_bucket", method="match", le="0.005") == 2
    assert value("hicache_rpc_latency_seconds_count", method="insert") == 0
    assert value("hicache_disk_latency_seconds_count", op="write") == 1
    assert value("hicache_engines_connected") == 2
    assert value("hicache_queue_depth", queue="disk_write") == 7
    # Process metrics come along in the private registry.
    assert value("process_open_fds") > 0


def test_names_follow_prometheus_conventions():
    m = Metrics(process_metrics=False)
    families = {f.name: f.type for f in text_string_to_metric_families(m.render().decode())}
    assert all(name.startswith("hicache_") for name in families)
    for name, kind in families.items():
        if kind == "counter":
            # The parser strips _total from family names; samples carry it.
            assert f"{name}_total".encode() in m.render()
        if kind == "histogram":
            assert name.endswith("_seconds")
    assert families["hicache_rpc_latency_seconds"] == "histogram"
    assert families["hicache_tier_capacity_bytes"] == "gauge"
    assert families["hicache_bytes_moved"] == "counter"


def test_registries_are_private():
    a, b = Metrics(), Metrics()
    a.add_misses(5)
    assert b"hicache_misses_total 0.0" in b.render()
    assert b"hicache_misses_total 5.0" in a.render()


def test_unknown_rpc_methods_share_one_label():
    m = Metrics(process_metrics=False)
    for i in range(50):
        m.observe_rpc(f"probe_{i}", 1e-5, code="UNKNOWN_METHOD")
    text = m.render().decode()
    assert 'hicache_requests_total{code="UNKNOWN_METHOD",method="other"} 50.0' in text
    assert "probe_" not in text


def test_bad_updates_raise_and_change_nothing():
    m = Metrics(process_metrics=False)
    before = m.render()
    with pytest.raises(MetricsError, match="unknown tier 'gpu'"):
        m.set_tier("gpu", 1, 1, 1)
    with pytest.raises(MetricsError):
        m.set_tier("host", 100, -1, 0)
    with pytest.raises(MetricsError):
        m.add_hits("host", -1)
    with pytest.raises(MetricsError):
        m.add_bytes_moved("host", "host", 10)
    with pytest.raises(MetricsError):
        m.observe_rpc("match", -0.5)
    with pytest.raises(MetricsError):
        m.observe_rpc("match", 0.1, code="not ok\n")
    with pytest.raises(MetricsError):
        m.observe_disk("Write Op", 0.1)
    with pytest.raises(MetricsError):
        m.set_queue_depth("disk_write", -3)
    assert m.render() == before
    with pytest.raises(MetricsError):
        Metrics(tiers=["host", "Bad Tier"])


def test_non_loopback_addresses_are_refused():
    m = Metrics(process_metrics=False)
    for addr in ("0.0.0.0", "::", "192.0.2.10", "10.1.2.3"):
        with pytest.raises(ConfigError, match="not loopback"):
            m.start_http(0, addr)
    with pytest.raises(ConfigError, match="out of range"):
        m.start_http(70000)


def test_non_loopback_allowed_explicitly_serves():
    m = Metrics(process_metrics=False)
    with m.start_http(0, "0.0.0.0", allow_non_loopback=True) as server:
        samples = scrape(f"http://127.0.0.1:{server.port}/metrics")
    assert ("hicache_misses_total", ()) in samples


def test_localhost_name_is_accepted_and_close_frees_the_port():
    m = Metrics(process_metrics=False)
    server = m.start_http(0, "localhost")
    port = server.port
    assert ("hicache_engines_connected", ()) in scrape(server.url)
    server.close()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    # A busy port is a configuration error, not a crash.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="cannot serve metrics"):
            m.start_http(taken.getsockname()[1])


def test_namespace_series_follow_the_namespaces_and_stay_bounded():
    m = Metrics(process_metrics=False)
    m.set_namespaces([("aa" * 16, "llama", {"host": (3, 3 << 16), "disk": (5, 5 << 16)}),
                      ("bb" * 16, "qwen", {"host": (1, 1 << 16), "disk": (0, 0)})])
    text = m.render().decode()
    assert 'hicache_namespace_pages{model="llama",namespace="aaaaaaaaaaaa",tier="disk"} 5.0' in text
    assert 'hicache_namespace_bytes{model="qwen",namespace="bbbbbbbbbbbb",tier="host"} 65536.0' in text
    # qwen's namespace went away: its series go too
    m.set_namespaces([("aa" * 16, "llama", {"host": (2, 2 << 16), "disk": (5, 5 << 16)})])
    text = m.render().decode()
    assert 'model="qwen"' not in text
    assert 'hicache_namespace_pages{model="llama",namespace="aaaaaaaaaaaa",tier="host"} 2.0' in text
    # thousands of tenants: only the largest namespaces get series
    from hicache.daemon.serve.metrics import MAX_NAMESPACE_SERIES

    m.set_namespaces([(f"{i:012x}" + "0" * 20, "m", {"host": (i, i)}) for i in range(MAX_NAMESPACE_SERIES + 50)])
    text = m.render().decode()
    assert text.count("hicache_namespace_pages{") == MAX_NAMESPACE_SERIES
    assert f'namespace="{MAX_NAMESPACE_SERIES + 49:012x}"' in text and 'namespace="000000000000"' not in text
    before = m.render()
    with pytest.raises(MetricsError):
        m.set_namespaces([("cc" * 16, "m", {"host": (1, 1)}), ("dd" * 16, "m", {"host": (-1, 0)})])
    assert m.render() == before
