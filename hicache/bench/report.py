"""Result rows and how `hicache bench` prints them.

A row is `{"name", "value", "unit"}` plus, where a baseline was measured in the
same run, `"baseline"` and `"ratio"` (value / baseline), and optionally a
`"note"` the table prints after the ratio.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def row(name: str, value: float, unit: str, baseline: float | None = None,
        baseline_name: str | None = None, **extra: Any) -> dict:
    r: dict[str, Any] = {"name": name, "value": float(value), "unit": unit}
    if baseline is not None:
        r["baseline"] = float(baseline)
        r["ratio"] = float(value) / float(baseline) if baseline else None
        if baseline_name:
            r["baseline_name"] = baseline_name
    r.update(extra)
    return r


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1e5 else f"{x:,.0f}"
    return str(x)


def print_rows(bench: str, rows: list[dict], as_json: bool, meta: dict | None = None, out: Any = None) -> None:
    out = out or sys.stdout
    for r in rows:  # every row with a baseline carries its ratio, whichever bench made it
        if r.get("baseline") and "ratio" not in r:
            r["ratio"] = float(r["value"]) / float(r["baseline"])
    if as_json:
        print(json.dumps({"bench": bench, **(meta or {}), "results": rows}), file=out)
        return
    width = max([len(r["name"]) for r in rows] + [4])
    print(f"{'name':<{width}}  {'value':>12} {'unit':<8} {'baseline':>12} {'ratio':>7}", file=out)
    for r in rows:
        base = _fmt(r.get("baseline"))
        if r.get("baseline_name"):
            base = f"{base} ({r['baseline_name']})"
        note = f"  {r['note']}" if r.get("note") else ""
        print(f"{r['name']:<{width}}  {_fmt(r['value']):>12} {r['unit']:<8} {base:>12} {_fmt(r.get('ratio')):>7}"
              f"{note}", file=out)
