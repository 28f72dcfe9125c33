"""Generated traces in the Mooncake format (`input_length`, `hash_ids`), for `bench trace --workload`.

A request is a list of block contents; `hash_ids` chain them, so an id names a
block and everything before it, as in the real trace (the same document after a
different prefix is a different block). Each generator is deterministic in its
seed. Block = 512 tokens; every prompt ends with a partial block.

- chat:  multi-turn conversations (about 48 live) under a short shared system
         prompt; any live conversation may speak next, so reuse distances vary.
- agent: 32 agent types (Zipf-popular) with 24-block system prompts, about 24
         live sessions each taking steps that append one block.
- rag:   a system prompt, then one retrieved document (Zipf-popular, several
         blocks), then a fresh question.
- scan:  the chat workload with one-shot documents (32-96 blocks) interleaved (a third of
         the requests), which must not flush the conversations' hot set.
- mixed: all four interleaved, as tenants sharing one cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

BLOCK = 512


class _Namer:
    """(parent id, content) -> block id, so equal prefixes get equal ids."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}

    def chain(self, contents: list[object]) -> list[int]:
        out, parent = [], -1
        for c in contents:
            key = (parent, c)
            parent = self._ids.setdefault(key, len(self._ids))
            out.append(parent)
        return out


def _record(namer: _Namer, contents: list[object], rng: np.random.Generator) -> dict:
    ids = namer.chain(contents)
    return {"timestamp": 0, "input_length": len(ids) * BLOCK + int(rng.integers(1, BLOCK)), "output_length": 256,
            "hash_ids": [*ids, namer.chain([*contents, ("tail", len(contents))])[-1]]}


def chat(n: int, rng: np.random.Generator, tag: str = "chat") -> Iterator[list[object]]:
    system = [(tag, "sys", i) for i in range(2)]
    live: list[tuple[int, list[object]]] = []  # (serial, blocks so far)
    started = 0
    for _ in range(n):
        if len(live) < 48 or rng.random() < 0.1:
            live.append((started, [*system, (tag, started, 0)]))
            started += 1
            c = len(live) - 1
        else:  # users answer at their own pace: any live conversation may be next
            c = int(rng.integers(len(live)))
            serial, conv = live[c]
            conv += [(tag, serial, len(conv) + k) for k in range(int(rng.integers(1, 3)))]
        yield list(live[c][1])
        if len(live[c][1]) > 40:
            live.pop(c)


def agent(n: int, rng: np.random.Generator, tag: str = "agent") -> Iterator[list[object]]:
    systems = [[(tag, "sys", a, i) for i in range(24)] for a in range(32)]
    sessions: list[tuple[int, list[object]]] = []  # (serial, blocks so far)
    made = 0
    for _ in range(n):
        if len(sessions) < 24 or rng.random() < 0.1:
            kind = min(int(rng.zipf(1.3)), len(systems)) - 1  # a few agent types dominate
            sessions.append((made, [*systems[kind], (tag, made, 0)]))
            made += 1
            s = len(sessions) - 1
        else:
            s = int(rng.integers(len(sessions)))
            serial, steps = sessions[s]
            steps.append((tag, serial, len(steps)))
        yield list(sessions[s][1])
        if len(sessions[s][1]) > 60:
            sessions.pop(s)


def rag(n: int, rng: np.random.Generator, tag: str = "rag") -> Iterator[list[object]]:
    system = [(tag, "sys", i) for i in range(3)]
    num_docs = 400
    for q in range(n):
        doc = int(rng.zipf(1.2)) % num_docs
        yield [*system, *[(tag, "doc", doc, i) for i in range(6)], (tag, "q", q)]


def scan(n: int, rng: np.random.Generator, tag: str = "scan") -> Iterator[list[object]]:
    conversations = chat(n, rng, tag)
    for q in range(n):
        if rng.random() < 1 / 3:
            yield [(tag, "once", q, i) for i in range(int(rng.integers(32, 96)))]
        else:
            yield next(conversations)


def mixed(n: int, rng: np.random.Generator, tag: str = "mixed") -> Iterator[list[object]]:
    gens = [g(n, rng, f"{tag}-{g.__name__}") for g in (chat, agent, rag, scan)]
    for _ in range(n):
        yield next(gens[int(rng.integers(len(gens)))])


WORKLOADS: dict[str, Callable[[int, np.random.Generator], Iterator[list[object]]]] = {
    "chat": chat, "agent": agent, "rag": rag, "scan": scan, "mixed": mixed}


def generate(name: str, num_requests: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    namer = _Namer()
    return [_record(namer, contents, rng) for contents in WORKLOADS[name](num_requests, rng)]
