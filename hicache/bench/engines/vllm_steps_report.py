"""The numbers of `hicache bench vllm --concurrency N` (hicache/bench/engines/vllm_steps.py): per
configuration and phase, medians over the repeats of

- output tok/s: output tokens / the time from the first `add_request` to the last output;
- TTFT mean / p90: from a request's `add_request` to the step that returned its first token;
- step p50 / p90: the `step()` calls that ran the model (steps that scheduled nothing, while a
  connector looks up asynchronously, are counted apart); decode step p50: those whose every
  request computed one token; step CPU p50: the engine thread's CPU time in those steps (the
  step's own work; the rest of its wall time it waited, for a core or for a daemon);
- connector ms per step, mean / p50 / p99: the sum of the connector calls inside one `step()`
  (hicache/integrations/vllm_call_clock.py), over every step of the phase;
- prefill computed: prompt tokens vLLM computed (prompt length - `num_cached_tokens`, summed);

and, pooled over the repeats, each connector method's calls and milliseconds per call.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hicache.bench.engines.vllm_peers import BASE
from hicache.bench.report import row

LABELS = {"none": "vLLM alone"}
MINOR_SHARE = 0.01  # methods under this share of a phase's connector time share one row


@dataclass
class PhaseRun:
    """One configuration's phase in one repeat, as the step driver reported it."""

    config: str
    repeat: int
    phase: str
    requests: list[dict[str, Any]]  # outputs, cached, prompt_tokens, ttft (s)
    wall_s: float
    steps: list[list[float]]  # [seconds, connector seconds, tokens scheduled, requests scheduled, CPU seconds]
    calls: dict[str, list[float]]  # "role.method" -> seconds per call

    @classmethod
    def from_result(cls, config: str, repeat: int, phase: str, out: dict[str, Any]) -> PhaseRun:
        return cls(config, repeat, phase, out["requests"], out["wall_s"], out["steps"], out["calls"])


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile, nearest rank (0 for no samples)."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)] if s else 0.0


# metric -> (unit, function of a run, shown for vLLM alone)
def _metrics() -> dict[str, tuple[str, Callable[[PhaseRun], float], bool]]:
    def model_steps(r: PhaseRun) -> list[list[float]]:
        return [s for s in r.steps if s[2] > 0]

    def ttfts(r: PhaseRun) -> list[float]:
        return [q["ttft"] * 1e3 for q in r.requests if q["ttft"] is not None]

    return {
        "output tok/s": ("tok/s", lambda r: sum(len(q["outputs"]) for q in r.requests) / r.wall_s, True),
        "ttft mean": ("ms", lambda r: statistics.fmean(ttfts(r)) if ttfts(r) else 0.0, True),
        "ttft p90": ("ms", lambda r: pct(ttfts(r), 90), True),
        "step p50": ("ms", lambda r: pct([s[0] * 1e3 for s in model_steps(r)], 50), True),
        "step p90": ("ms", lambda r: pct([s[0] * 1e3 for s in model_steps(r)], 90), True),
        "decode step p50": ("ms", lambda r: pct([s[0] * 1e3 for s in model_steps(r) if s[2] == s[3]], 50), True),
        # the engine thread's CPU time in those steps: their work, without the waits for a core
        "step CPU p50": ("ms", lambda r: pct([s[4] * 1e3 for s in model_steps(r)], 50), True),
        "steps that ran the model": ("steps", lambda r: float(len(model_steps(r))), True),
        "steps that scheduled nothing": ("steps", lambda r: float(len(r.steps) - len(model_steps(r))), True),
        "connector ms per step, mean": ("ms", lambda r: statistics.fmean(s[1] * 1e3 for s in r.steps), False),
        "connector ms per step, p50": ("ms", lambda r: pct([s[1] * 1e3 for s in r.steps], 50), False),
        "connector ms per step, p99": ("ms", lambda r: pct([s[1] * 1e3 for s in r.steps], 99), False),
        "connector share of step time": (
            "ratio", lambda r: sum(s[1] for s in r.steps) / max(sum(s[0] for s in r.steps), 1e-9), False),
        "prefill computed": ("tokens", lambda r: float(sum(q["prompt_tokens"] - q["cached"] for q in r.requests)),
                             True),
    }


def medians(runs: list[PhaseRun]) -> dict[tuple[str, str], dict[str, tuple[float, list[float]]]]:
    """(config, phase) -> metric -> (median over the repeats, the repeats' values in order)."""
    out: dict[tuple[str, str], dict[str, tuple[float, list[float]]]] = {}
    by_key: dict[tuple[str, str], list[PhaseRun]] = {}
    for r in runs:
        by_key.setdefault((r.config, r.phase), []).append(r)
    for key, rs in by_key.items():
        rs.sort(key=lambda r: r.repeat)
        out[key] = {}
        for metric, (_, fn, for_base) in _metrics().items():
            if key[0] == BASE and not for_base:
                continue
            values = [fn(r) for r in rs]
            out[key][metric] = (statistics.median(values), values)
    return out


def _per_repeat_ratios(values: list[float], base: list[float]) -> str:
    ratios = [v / b for v, b in zip(values, base, strict=True) if b]
    if len(ratios) < 2:
        return ""
    return f"runs {min(ratios):.2f}-{max(ratios):.2f}"


def method_stats(runs: list[PhaseRun]) -> dict[tuple[str, str], list[tuple[str, dict[str, float]]]]:
    """(config, phase) -> [(method, {calls per repeat, mean, p50, p99 ms, ms per repeat})], the
    methods taking most time first; calls pooled over the repeats."""
    pooled: dict[tuple[str, str], dict[str, list[float]]] = {}
    repeats: dict[tuple[str, str], int] = {}
    for r in runs:
        key = (r.config, r.phase)
        repeats[key] = repeats.get(key, 0) + 1
        for method, secs in r.calls.items():
            pooled.setdefault(key, {}).setdefault(method, []).extend(secs)
    out = {}
    for key, methods in pooled.items():
        n = repeats[key]
        stats = [(m, {"calls per repeat": len(v) / n, "mean": statistics.fmean(v) * 1e3, "p50": pct(v, 50) * 1e3,
                      "p99": pct(v, 99) * 1e3, "ms per repeat": sum(v) * 1e3 / n}) for m, v in methods.items()]
        out[key] = sorted(stats, key=lambda kv: -kv[1]["ms per repeat"])
    return out


def rows(runs: list[PhaseRun], counters: dict[str, dict[str, float]], facts: dict[str, float]) -> list[dict]:
    med = medians(runs)
    configs = list(dict.fromkeys(r.config for r in runs))
    phases = list(dict.fromkeys(r.phase for r in runs))
    units = {m: u for m, (u, _, _) in _metrics().items()}
    out = []
    for phase in phases:
        base = med.get((BASE, phase), {})
        for metric, unit in units.items():
            for config in configs:
                got = med.get((config, phase), {}).get(metric)
                if got is None:
                    continue
                name = f"{phase}: {metric} [{config}]"
                b = base.get(metric)
                if config == BASE or b is None:
                    out.append(row(name, got[0], unit))
                else:
                    out.append(row(name, got[0], unit, b[0], "vLLM alone",
                                   note=_per_repeat_ratios(got[1], b[1]) or None))
    for (config, phase), stats in method_stats(runs).items():
        total = sum(s["ms per repeat"] for _, s in stats)
        minor = [(m, s) for m, s in stats if s["ms per repeat"] < MINOR_SHARE * total]
        for method, s in stats:
            if (method, s) not in minor:
                out.append(row(f"{phase}: connector call {method} [{config}]", s["mean"], "ms",
                               note=f"p50 {s['p50']:.3f} ms, p99 {s['p99']:.3f} ms, {s['calls per repeat']:.0f} "
                                    f"calls and {s['ms per repeat']:.1f} ms per repeat"))
        if minor:
            out.append(row(f"{phase}: connector calls, {len(minor)} other methods [{config}]",
                           sum(s["ms per repeat"] for _, s in minor), "ms/repeat",
                           note="each under 1% of the connector's time: " + ", ".join(m for m, _ in minor)))
    for config, cs in counters.items():
        for counter, value in cs.items():
            out.append(row(f"{counter} [{config}]", value, "count"))
    for fact, value in facts.items():
        out.append(row(fact, value, "load" if "load" in fact else "count"))
    return out


def _cell(med: dict, config: str, phase: str, metrics: list[str], fmt: str = "{:.0f}") -> str:
    got = med.get((config, phase), {})
    if not all(m in got for m in metrics):
        return "-"
    return " / ".join(fmt.format(got[m][0]) for m in metrics)


def summary_table(runs: list[PhaseRun], counters: dict[str, dict[str, float]]) -> str:
    """The headline as a Markdown table (docs/benchmarks.md, the README's vLLM row)."""
    med = medians(runs)
    configs = list(dict.fromkeys(r.config for r in runs))
    repeats = len({r.repeat for r in runs})

    def tok_s(config: str, phase: str) -> str:
        got = med.get((config, phase), {}).get("output tok/s")
        if got is None:
            return "-"
        base = med[(BASE, phase)]["output tok/s"]
        if config == BASE:
            return f"{got[0]:.0f}"
        spread = _per_repeat_ratios(got[1], base[1])
        return f"{got[0]:.0f} ({got[0] / base[0]:.2f}{', ' + spread if spread else ''})"

    lines = [f"| median of {repeats} | " + " | ".join(LABELS.get(c, c) for c in configs) + " |",
             "|---" * (len(configs) + 1) + "|"]
    table = [
        ("no reuse: output tok/s (/ alone)", lambda c: tok_s(c, "no reuse")),
        ("no reuse: step p50 / decode step p50 (ms)",
         lambda c: _cell(med, c, "no reuse", ["step p50", "decode step p50"], "{:.1f}")),
        ("no reuse: connector ms per step, mean / p50",
         lambda c: _cell(med, c, "no reuse", ["connector ms per step, mean", "connector ms per step, p50"], "{:.2f}")),
        ("reuse: output tok/s (/ alone)", lambda c: tok_s(c, "reuse")),
        ("reuse: TTFT mean / p90 (ms)", lambda c: _cell(med, c, "reuse", ["ttft mean", "ttft p90"])),
        ("reuse: connector ms per step, mean / p50",
         lambda c: _cell(med, c, "reuse", ["connector ms per step, mean", "connector ms per step, p50"], "{:.2f}")),
        ("reuse: prefill computed", lambda c: _cell(med, c, "reuse", ["prefill computed"])),
    ]
    for label, cell in table:
        lines.append(f"| {label} | " + " | ".join(cell(c) for c in configs) + " |")
    gone = [counters.get(c, {}) for c in configs]
    if any(gone):
        lines.append("| engines gone / outages / puts expired | " + " | ".join(
            f"{g['engines gone (daemon log)']:.0f} / {g['connector outages (engine log)']:.0f} / "
            f"{g['puts expired (stats)']:.0f}" if g else "-" for g in gone) + " |")
    return "\n".join(lines)
