"""The Grafana dashboard shipped in the package queries only metrics a real daemon exports.

A daemon with an engine registered is scraped over /metrics; every metric name in every
PromQL expression of the dashboard (panels and variables) and of the docs' ```promql
blocks must be one the scrape has. A renamed or dropped metric fails here, not on a
user's empty panel."""

from __future__ import annotations

import json
import re
from importlib.resources import files
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from hicache.client.client import HiCacheClient
from hicache.layout import KVLayout
from tests.daemon.disk_faults_util import free_port, metrics_text
from tests.wait import wait_until

DASHBOARD = files("hicache") / "data" / "grafana" / "hicache-dashboard.json"
DOCS = Path(__file__).resolve().parent.parent / "docs"
LAYOUT = KVLayout("mha", num_layers=2, page_size=4, dtype="float16", num_kv_heads=1, head_dim=8)

# PromQL words that are not metric names: functions and aggregations are followed by "(",
# these are the rest.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, labels, strings or durations)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings: label values
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations ($__rate_interval too)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = m.group(), text[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in KEYWORDS:
            continue
        names.add(word)
    return names


def dashboard_expressions() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = []

    def panels(items: list[dict]) -> None:
        for p in items:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            panels(p.get("panels", []))

    panels(doc["panels"])
    for var in doc["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict) and "label_values(" in q.get("query", ""):
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", q["query"]))
    return exprs


def docs_promql() -> list[str]:
    out = []
    for page in DOCS.rglob("*.md"):
        for block in re.findall(r"```promql\n(.*?)```", page.read_text(), re.S):
            out += [line for line in block.splitlines() if line.strip()]
    return out


def exported_names(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ())
        names.update(family.name + s for s in suffixes)
        names.update(s.name for s in family.samples)
    return names


def test_the_parser_finds_metric_names_and_nothing_else():
    expr = ('sum by (tier) (rate(hicache_hits_total{instance=~"$instance",tier="disk"}[$__rate_interval])) '
            '/ scalar(sum(rate(hicache_misses_total[5m])) + on (job) topk(3, process_open_fds))')
    assert metric_names(expr) == {"hicache_hits_total", "hicache_misses_total", "process_open_fds"}


def test_every_metric_the_dashboard_queries_is_exported(daemon_factory):
    exprs = dashboard_expressions()
    wanted = set().union(*(metric_names(e) for e in exprs))
    # the panels the operations kit promises: hit rate and bytes per tier, load latency, disk and
    # remote errors, the breaker, per-namespace usage
    for must in ("hicache_hits_total", "hicache_misses_total", "hicache_tier_used_bytes",
                 "hicache_rpc_latency_seconds_bucket", "hicache_disk_faults_total", "hicache_remote_pages_total",
                 "hicache_remote_up", "hicache_namespace_bytes", "hicache_namespace_pages"):
        assert must in wanted, f"the dashboard has no panel on {must}"
    port = free_port()
    d = daemon_factory("--host-capacity", "16MiB", "--disk-capacity", "64MiB", "--metrics-port", str(port)).start()
    client = HiCacheClient(LAYOUT, 64, model="dash-model", socket_path=d.socket, timeout_s=30)
    try:
        assert client.connect(), "the engine could not register"
        # the per-namespace gauges are sampled once a second: wait for this engine's namespace
        def with_namespace() -> str | None:
            text = metrics_text(port)
            return text if 'model="dash-model"' in text else None

        text = wait_until(with_namespace, 30, "the namespace's series on /metrics")
    finally:
        client.close()
    exported = exported_names(text)
    missing = sorted(wanted - exported)
    assert not missing, f"the dashboard queries metrics the daemon does not export: {missing}"
    doc_missing = sorted(set().union(*(metric_names(e) for e in docs_promql())) - exported)
    assert not doc_missing, f"the docs' PromQL examples name metrics the daemon does not export: {doc_missing}"


def test_the_dashboard_is_importable_json():
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in doc["panels"]:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
