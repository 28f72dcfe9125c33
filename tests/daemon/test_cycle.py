"""The engine cycle through a real daemon process and real engine processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = [sys.executable, str(Path(__file__).with_name("engine_worker.py"))]


def run_worker(socket: str, *ops: str, layout: str = "mha", extra_key: str = "", model: str = "test-model",
               pool_pages: int = 256) -> list[dict]:
    out = subprocess.run([*WORKER, "--socket", socket, "--layout", layout, "--extra-key", extra_key,
                          "--model", model, "--pool-pages", str(pool_pages), *ops], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_engine_b_loads_what_engine_a_computed(daemon, layout):
    # engine A computes 10 full pages (+2 tokens) and exits; its host copies stay with the daemon
    (a,) = run_worker(daemon.socket, "store:1:42", layout=layout)
    assert a["device_len"] == 0 and a["host_len"] == 0 and a["stored_pages"] == 10
    # engine B, another process, finds them on host and loads every byte as A wrote it
    (b,) = run_worker(daemon.socket, "load:1:42", layout=layout)
    assert b["host_len"] == 10 and b["loaded"] == 10
    assert b["bad_pages"] == 0


def test_shared_prefix_then_divergence(daemon):
    # 24 tokens shared, then different: B hits only the shared full pages (6 of 4 tokens)
    run_worker(daemon.socket, "store:1:40:24")
    (b,) = run_worker(daemon.socket, "load:2:40:24")
    assert b["host_len"] == 6 and b["bad_pages"] == 0


def test_same_engine_hits_its_own_device_pages(daemon):
    res = run_worker(daemon.socket, "store:3:33", "load:3:33")
    assert res[1]["device_len"] == 8 and res[1]["host_len"] == 0 and res[1]["bad_pages"] == 0


def test_namespaces_never_see_each_other(daemon):
    run_worker(daemon.socket, "store:5:40", extra_key="tenant-a")
    (other_tenant,) = run_worker(daemon.socket, "load:5:40", extra_key="tenant-b")
    (other_model,) = run_worker(daemon.socket, "load:5:40", model="another-model")
    (other_layout,) = run_worker(daemon.socket, "load:5:40", layout="mla", extra_key="tenant-a")
    (same,) = run_worker(daemon.socket, "load:5:40", extra_key="tenant-a")
    assert other_tenant["host_len"] == 0 and other_model["host_len"] == 0 and other_layout["host_len"] == 0
    assert same["host_len"] == 10 and same["bad_pages"] == 0
