"""CPU lists as Linux writes them (`0-3,8`, `cpuset` and `taskset -c` style): parsed and printed.
`hicache serve --cpus` reads one (hicache/daemon/serve/placement.py)."""

from __future__ import annotations

import re


def parse_cpu_list(text: str) -> set[int]:
    """CPU ids of a list like '0-3,8 10' or '0-6:2' (ranges with an optional stride);
    ValueError if it is not one, or names no CPU."""
    cpus: set[int] = set()
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", item)
        if m is None:
            raise ValueError(f"not a CPU list: {text!r} (write e.g. 1, 0-3 or 0,2-3)")
        lo = int(m[1])
        hi = int(m[2]) if m[2] else lo
        step = int(m[3]) if m[3] else 1
        if hi < lo or step < 1:
            raise ValueError(f"not a CPU list: {text!r} (a range goes up: 0-3)")
        cpus.update(range(lo, hi + 1, step))
    if not cpus:
        raise ValueError("an empty CPU list")
    return cpus


def format_cpu_list(cpus: set[int] | list[int] | tuple[int, ...]) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
