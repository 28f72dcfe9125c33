"""`hicache bench sglang-serve`'s report: its rows from measured requests (the server runs are
the bench itself; tests/integrations/test_sglang_server.py runs the same server for real)."""

from __future__ import annotations

from hicache.bench.engines.sglang_serve_bench import _server_args, rows
from hicache.cli.main import build_parser


def measured(prefill_cached: list[int], storage: list[int], outputs: list[list[int]], ttft: float) -> dict:
    reqs = [{"turn": i // 2, "conversation": i % 2, "ttft_s": ttft, "outputs": out, "prompt_tokens": 100,
             "cached": c, "details": {"storage": s, "host": 0}}
            for i, (c, s, out) in enumerate(zip(prefill_cached, storage, outputs))]
    return {"requests": reqs, "wall_s": 2.0, "start_s": 60.0}


def test_rows_give_ratios_to_sglang_alone_and_hicache_against_sglangs_tiers():
    same = [[1, 2], [3, 4], [5, 6], [7, 8]]
    m = {"sglang": measured([0, 0, 50, 0], [0] * 4, same, 0.2),
         "sglang-host": measured([0, 0, 90, 50], [0] * 4, same, 0.1),
         "hicache": measured([0, 0, 90, 90], [0, 0, 0, 90], [[1, 2], [3, 4], [5, 6], [7, 9]], 0.05)}
    by = {r["name"]: r for r in rows(m)}
    assert by["sglang prefill computed"]["value"] == 350 and by["hicache prefill computed"]["value"] == 220
    assert by["hicache prefill computed"]["ratio"] == 220 / 350
    assert by["hicache prefill computed vs sglang-host"]["ratio"] == 220 / 260
    assert by["hicache cached from storage"]["value"] == 90
    assert by["hicache ttft mean"]["note"] == "OUTPUTS DIFFER from sglang's"
    assert by["sglang-host ttft mean"]["note"] == "outputs equal sglang's"
    assert by["sglang throughput"]["value"] == (400 + 8) / 2.0


def test_each_configuration_is_its_own_server_command():
    args = build_parser().parse_args(["bench", "sglang-serve"])
    flags = {name: _server_args(name, "/m", 1, args, "/s.sock") for name in
             ("sglang", "sglang-host", "sglang-file", "hicache")}
    assert "--enable-hierarchical-cache" not in flags["sglang"]
    assert flags["sglang-host"][flags["sglang-host"].index("--hicache-ratio") + 1] == "4"
    assert flags["sglang-file"][-2:] == ["--hicache-storage-backend", "file"]
    assert flags["hicache"][flags["hicache"].index("--hicache-ratio") + 1] == "2"
    assert '"socket": "/s.sock"' in flags["hicache"][-1]
