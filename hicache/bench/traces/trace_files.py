"""The trace files the benches replay: the default one shipped in the package, and
opening any trace file, plain or compressed.

The default is the Mooncake conversation trace (kvcache-ai/Mooncake, FAST'25 release,
Apache-2.0; hicache/data/traces/README.md says what it holds), xz-compressed: 2.9 MB of
JSON lines become 0.2 MB in the wheel. A real trace rather than a generated workload,
because the policy numbers hicache reports (hit rate next to LRU and OPT) are only
comparable with other systems' on a trace they also ran; `--workload` generates one.
"""

from __future__ import annotations

import gzip
import io
import lzma
from importlib import resources
from typing import TextIO

__all__ = ["DEFAULT_TRACE", "open_trace"]

_DATA = "hicache.data"
_DEFAULT_NAME = "traces/mooncake_conversation_trace.jsonl.xz"
DEFAULT_TRACE = str(resources.files(_DATA).joinpath(_DEFAULT_NAME))


def open_trace(path: str) -> TextIO:
    """A trace file as text lines: `.xz` and `.gz` are decompressed on the fly."""
    if path.endswith(".xz"):
        return io.TextIOWrapper(lzma.open(path), encoding="utf-8")
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path), encoding="utf-8")
    return open(path, encoding="utf-8")
