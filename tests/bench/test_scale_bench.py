"""`hicache bench scale` runs small (20k pages) so it cannot rot: every row it reports for
the docs' million-page run is there, next to redis-server, and the figures that are facts
rather than timings hold (every page stored is on disk after settle, every page counted on
disk is restored after kill -9)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_scale_bench_fills_restarts_and_compares_with_redis(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "scale", "--json", "--pages", "20000",
                          "--host-capacity", "8MiB", "--disk-capacity", "64MiB", "--match-samples", "200",
                          "--workdir", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = {r["name"]: r for r in json.loads(out.stdout)["results"]}
    stored = rows["pages stored (put_done, committed)"]["value"]
    assert stored >= 20000
    written = rows["written-through pages on disk after settle"]
    assert written["value"] == written["baseline"] > 0  # every distinct page stored reached the disk
    restored = rows["disk pages restored after kill -9"]
    assert restored["value"] == restored["baseline"] == written["value"]
    assert "orphans_dropped 0" in restored["note"]
    match = next(r for n, r in rows.items() if n.startswith("match p50 at "))
    assert match["baseline"] > 0 and match["value"] > 0 and match["baseline_name"].startswith("at 10")
    for op in ("stats", "ls", "quota_list", "metrics scrape", "idle second (metrics refresher, gc)"):
        assert rows[f"event loop stall: {op}"]["value"] >= 0
    heap = rows["daemon heap (RssAnon) per page"]
    assert heap["value"] > 0 and heap["baseline"] > 0  # redis-server's bytes per key beside it
    restart = rows["restart to answering"]
    assert restart["baseline"] > 0 and "records checked" in restart["note"]  # the rebuild's parts, from its log
    assert rows["restart until every page is indexed"]["value"] >= restart["value"]
    assert rows["daemon heap per page added after the first pages"]["value"] > 0
    assert rows["heap after restart vs before the kill"]["baseline"] > 0
    assert rows["fill rate"]["value"] > 0 and rows["daemon CPU per page stored"]["value"] > 0
    assert "engine outages during the fill" in rows and "engine deadline misses during the fill" in rows
    assert rows["redis-server: SET rate (pipelined)"]["value"] > 0


def test_the_index_alone_at_a_size_a_daemon_cannot_fill_here(tmp_path):
    """--index-only: the daemon's index in-process (heap per page at checkpoints) and the
    restart's work on its records in a child; every stored page is indexed again."""
    out = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "scale", "--json", "--index-only",
                          "--pages", "20000", "--host-capacity", "4MiB", "--workdir", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = {r["name"]: r for r in json.loads(out.stdout)["results"]}
    (heap,) = [r for n, r in rows.items() if n.startswith("index heap per page at ")]
    stored = int(heap["name"].rsplit(" at ", 1)[1].split()[0])
    assert stored >= 20000 and heap["value"] > 0 and "on disk" in heap["note"]
    on_disk = int(heap["note"].split(" on disk")[0].rsplit(" ", 1)[1])
    (hung,) = [r for n, r in rows.items() if n.endswith("runs hung on a fresh index")]
    assert 0 < on_disk <= stored and hung["note"].startswith(f"{on_disk} pages in ")  # every page on disk came back
    assert rows["heap per page of the rebuilt index"]["value"] > 0
