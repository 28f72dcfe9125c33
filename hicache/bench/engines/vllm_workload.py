"""The workloads of `hicache bench vllm`: token-id prompts, and when each is sent.

Every conversation starts with one shared system prompt; each turn appends a new user message
to everything said so far and, after the turn, the assistant's reply as the client resends it
(random ids of a fixed length, so every configuration sees the same prompts whatever it
generates).

Arrivals (`--arrivals poisson --rate R`): conversations open as a Poisson process of rate R
(exponential gaps of mean 1/R between first turns); after each answer a conversation waits an
exponential think time of mean N/R (N conversations) before its next turn, so while answers are
quick the requests of all conversations together arrive at about R per second, and a
conversation never sends a turn before it has its previous answer.

Concurrent requests (`--concurrency N`, hicache/bench/engines/vllm_steps.py): N prompts sent at once,
each one of a few shared prefixes (a system prompt, a few-shot header) and a suffix of its own.
"""

from __future__ import annotations

import random


def conversations(n: int, turns: int, system_tokens: int, user_tokens: int, reply_tokens: int,
                  seed: int = 0) -> list[list[list[int]]]:
    """rounds[t][c]: the prompt of conversation c at turn t."""
    if min(n, turns, system_tokens, user_tokens) < 1 or reply_tokens < 0:
        raise ValueError("conversations, turns, system and user tokens must be >= 1, reply tokens >= 0")
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(1, 500) for _ in range(k)]  # noqa: E731
    system = tok(system_tokens)
    history = [list(system) for _ in range(n)]
    rounds = []
    for _ in range(turns):
        prompts = []
        for h in history:
            h += tok(user_tokens)
            prompts.append(list(h))
            h += tok(reply_tokens)  # the assistant's answer, as the client resends it next turn
        rounds.append(prompts)
    return rounds


def poisson_gaps(n: int, turns: int, rate: float, seed: int = 0) -> list[list[float]]:
    """gaps[c][t], seconds: for t = 0 when conversation c opens (from the start), for t > 0 the
    think time between its answer to turn t-1 and sending turn t."""
    if rate <= 0 or n < 1 or turns < 1:
        raise ValueError(f"need rate > 0 and at least one conversation and turn (rate={rate}, n={n}, turns={turns})")
    rng = random.Random(seed)
    gaps, opened = [], 0.0
    for _ in range(n):
        opened += rng.expovariate(rate)
        gaps.append([opened] + [rng.expovariate(rate / n) for _ in range(turns - 1)])
    return gaps


def shared_prefix_prompts(n: int, prefixes: int, prefix_tokens: int, min_tokens: int, max_tokens: int,
                          seed: int = 0) -> list[list[int]]:
    """`n` prompts of `min_tokens`..`max_tokens` tokens (uniform): prompt i is shared prefix
    i % `prefixes` (`prefix_tokens` long) and a suffix of its own. A new seed draws new
    prefixes too, so no prompt of one seed shares a block with another seed's."""
    if min(n, prefixes, prefix_tokens) < 1 or not prefix_tokens < min_tokens <= max_tokens:
        raise ValueError(f"need n, prefixes, prefix tokens >= 1 and prefix tokens < min tokens <= max tokens "
                         f"(n={n}, prefixes={prefixes}, prefix_tokens={prefix_tokens}, "
                         f"tokens={min_tokens}..{max_tokens})")
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(1, 500) for _ in range(k)]  # noqa: E731
    shared = [tok(prefix_tokens) for _ in range(prefixes)]
    return [shared[i % prefixes] + tok(rng.randint(min_tokens, max_tokens) - prefix_tokens) for i in range(n)]
