"""Charts of benchmark results (`--plot FILE`, `hicache bench plot RESULTS.json FILE`).

Every chart is drawn from the result rows a bench prints (hicache/bench/report.py), so
the rows of a run and the `--json` file of an earlier one give the same picture.
matplotlib is an optional extra (`pip install 'hicache[plot]'`): it is imported only
here, and `require_matplotlib` fails before a long bench starts, not after it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

from hicache.errors import HiCacheError

PLOT_SUFFIXES = (".png", ".svg")
INSTALL_HINT = "charts need matplotlib: pip install 'hicache[plot]'"

# The comparison lines drawn boldest; every other simulated policy is drawn thin.
TRACE_MAIN = {"OPT": "OPT (offline bound)", "LRU": "LRU", "frecency": "hicache's policy (frecency, simulated)"}


class PlotError(HiCacheError):
    """A chart cannot be drawn: matplotlib is missing, the file name or the results do not fit."""


def require_matplotlib(path: str) -> None:
    """Fail now, with the fix, if `path` cannot be drawn (before a bench spends minutes)."""
    if Path(path).suffix.lower() not in PLOT_SUFFIXES:
        raise PlotError(f"--plot {path}: the file must end in .png or .svg")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(INSTALL_HINT) from None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window, even with a display
    import matplotlib.pyplot as plt

    return plt


def _values(rows: list[dict]) -> dict[str, float]:
    return {r["name"]: float(r["value"]) for r in rows}


def trace_series(rows: list[dict]) -> tuple[dict[str, list[tuple[int, float]]], list[tuple[str, int, float]], float]:
    """From `bench trace` rows: (policy -> [(capacity blocks, hit rate)], hicache replay points
    [(label, capacity, hit rate)], the infinite cache's hit rate)."""
    v = _values(rows)
    caps = {m.group(1): int(val) for name, val in v.items() if (m := re.fullmatch(r"sim @ (.+): capacity", name))}
    series: dict[str, list[tuple[int, float]]] = {}
    for name, val in v.items():
        m = re.fullmatch(r"sim @ (.+): (\S+) hit rate", name)
        if m and m.group(1) in caps:
            series.setdefault(m.group(2), []).append((caps[m.group(1)], val))
    for points in series.values():
        points.sort()
    replay = []
    for label, who in (("host tier", "device + host"), ("all tiers", "all tiers")):
        key = f"hit rate, {who} vs OPT @ {label}"
        if key in v and label in caps:
            replay.append((who, caps[label], v[key]))
    if not series:
        raise PlotError("no simulated policies in these results: run `hicache bench trace` with --sim-fractions")
    return series, replay, v.get("sim infinite cache: hit rate", math.nan)


def plot_trace(rows: list[dict], path: str, title: str | None = None) -> None:
    """Hit rate against capacity: OPT, LRU and hicache's policy simulated on the same blocks,
    the other online policies thin, and the real daemon's replay as points."""
    series, replay, infinite = trace_series(rows)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for name, points in sorted(series.items(), key=lambda kv: kv[0] in TRACE_MAIN):
        xs, ys = zip(*points)
        if name in TRACE_MAIN:
            ax.plot(xs, ys, marker="o", linewidth=2.2, label=TRACE_MAIN[name])
        else:
            ax.plot(xs, ys, linewidth=0.9, alpha=0.55, linestyle="--", label=name)
    for who, cap, rate in replay:
        ax.scatter([cap], [rate], s=90, marker="*", zorder=5, color="black")
        ax.annotate(f"hicache daemon, {who}", (cap, rate), textcoords="offset points", xytext=(6, -12), fontsize=8)
    if not math.isnan(infinite):
        ax.axhline(infinite, color="grey", linewidth=0.8, linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (512-token blocks)")
    ax.set_ylabel("hit rate (share of prompt tokens)")
    ax.set_title(title or "Hit rate against capacity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _by_config(rows: list[dict], metric: str) -> dict[str, float]:
    out = {}
    for r in rows:
        m = re.fullmatch(re.escape(metric) + r" \[(.+)\]", r["name"])
        if m and not math.isnan(float(r["value"])):
            out[m.group(1)] = float(r["value"])
    return out


def _bars(ax: Any, groups: list[str], values: list[dict[str, float]], configs: list[str], unit: str) -> None:
    width = 0.8 / max(1, len(configs))
    for i, config in enumerate(configs):
        xs = [g + i * width for g in range(len(groups))]
        ys = [vals.get(config, 0.0) for vals in values]
        bars = ax.bar(xs, ys, width, label="vLLM alone" if config == "none" else config)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([g + width * (len(configs) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(unit)
    ax.grid(True, axis="y", alpha=0.3)


def plot_vllm(rows: list[dict], path: str, title: str | None = None) -> None:
    """TTFT and prefill tokens computed, cold and warm turns, per configuration."""
    phases = ("cold (turn 1)", "warm (turns 2+)")
    ttft = [_by_config(rows, f"ttft mean, {p}") for p in phases]
    prefill = [_by_config(rows, f"prefill tokens computed, {p}") for p in phases]
    configs = list(dict.fromkeys(c for vals in ttft + prefill for c in vals))
    if not configs:
        raise PlotError("no TTFT rows in these results: they are not `hicache bench vllm`'s")
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 4), dpi=120)
    _bars(a, list(phases), ttft, configs, "ms")
    a.set_title("TTFT, mean")
    _bars(b, list(phases), prefill, configs, "tokens")
    b.set_title("Prefill tokens computed")
    a.legend(fontsize=8)
    fig.suptitle(title or "vLLM with and without hicache")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def multiturn_setups(rows: list[dict]) -> list[str]:
    """The setups of `bench multiturn` rows, in order; the infinite cache is a bound, drawn as a line."""
    return [m.group(1) for r in rows if (m := re.fullmatch(r"(.+): prefill tokens computed", r["name"]))
            and m.group(1) != "infinite cache"]


def plot_multiturn(rows: list[dict], path: str, title: str | None = None) -> None:
    """Prefill tokens computed and TTFT per setup of the reference engine."""
    v = _values(rows)
    setups = multiturn_setups(rows)
    if not setups:
        raise PlotError("no setups in these results: they are not `hicache bench multiturn`'s")
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 4), dpi=120)
    prefill = [v[f"{s}: prefill tokens computed"] for s in setups]
    bars = a.bar(setups, prefill)
    a.bar_label(bars, fmt="%.0f", fontsize=7)
    if "infinite cache: prefill tokens computed" in v:
        a.axhline(v["infinite cache: prefill tokens computed"], color="grey", linestyle=":", label="infinite cache")
        a.legend(fontsize=8)
    a.set_title("Prefill tokens computed")
    ttft = [v.get(f"{s}: TTFT mean", 0.0) for s in setups]
    bars = b.bar(setups, ttft)
    b.bar_label(bars, fmt="%.0f", fontsize=7)
    b.set_title("TTFT, mean (ms)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title or "Reference engine, multi-turn conversations")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


PLOTTERS: dict[str, Callable[[list[dict], str, str | None], None]] = {
    "trace": plot_trace, "vllm": plot_vllm, "multiturn": plot_multiturn,
}


def plot(bench: str, rows: list[dict], path: str, title: str | None = None) -> None:
    if bench not in PLOTTERS:
        raise PlotError(f"no chart for `hicache bench {bench}` (charts: {', '.join(sorted(PLOTTERS))})")
    require_matplotlib(path)
    PLOTTERS[bench](rows, path, title)


def plot_file(results: str, path: str, title: str | None = None) -> str:
    """Draw the chart of a `hicache bench ... --json` output file; returns the bench's name."""
    try:
        with open(results) as f:
            doc = json.loads(f.read().strip().splitlines()[-1])  # the bench's one JSON line, after any log
    except (OSError, ValueError, IndexError) as e:
        raise PlotError(f"{results}: not the output of `hicache bench ... --json` ({e})") from None
    if not isinstance(doc, dict) or "bench" not in doc or not isinstance(doc.get("results"), list):
        raise PlotError(f"{results}: not the output of `hicache bench ... --json` (no bench and results)")
    plot(doc["bench"], doc["results"], path, title)
    return str(doc["bench"])
