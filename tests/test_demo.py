"""`hicache demo` end to end: a real daemon, the reference engines, a clean stop."""

from __future__ import annotations

import re
import subprocess
import sys


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache.cli", "demo", *args], capture_output=True, text=True,
                          timeout=240)


def hit_rates(out: str) -> dict[str, float]:
    return {tier: float(pct) for tier, pct in re.findall(r"^\s+(device|host|disk)\s+([\d.]+)%", out, re.M)}


def test_demo_reports_hit_rates_per_tier_and_stops_the_daemon_cleanly():
    r = run_demo("--requests", "12", "--host-capacity", "64MiB", "--disk-capacity", "256MiB")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tier hit rates" in r.stdout
    rates = hit_rates(r.stdout)
    assert set(rates) == {"device", "host", "disk"}
    # 3 conversations x 4 turns: turns 2-3 hop engines (host), turn 4 follows a daemon restart (disk)
    assert rates["device"] > 0 and rates["host"] > 0 and rates["disk"] > 0
    saved = re.search(r"prefill\s+([\d,]+) of ([\d,]+) prompt tokens computed", r.stdout)
    assert saved is not None
    computed, prompt = (int(x.replace(",", "")) for x in saved.groups())
    assert 0 < computed < prompt
    assert "stopped cleanly (SIGTERM, exit 0)" in r.stdout


def test_demo_without_a_disk_tier():
    r = run_demo("--requests", "6", "--host-capacity", "64MiB", "--disk-capacity", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no disk tier" in r.stdout
    assert hit_rates(r.stdout)["host"] > 0


def test_demo_rejects_bad_arguments():
    r = run_demo("--requests", "0")
    assert r.returncode != 0 and "requests" in r.stderr
    r = run_demo("--host-capacity", "lots")
    assert r.returncode != 0 and "not a size" in r.stderr
