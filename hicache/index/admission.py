"""Which pages enter the disk tier (and the remote tier behind it): admission.

Writing a page to disk costs write bandwidth, flash wear and a disk slot that
some other page loses; on the shared Mooncake trace three first-seen blocks in
four are never requested again. So a page is written only when the policy
expects it back:

- `FrequencySketch`: TinyLFU's count-min sketch (4 rows, counters saturating
  at 15) with aging: after 10 x width increments every counter is halved, so
  the estimate follows the recent past, not the whole history. Fixed memory
  (depth x width bytes) however many pages the daemon ever saw, and it
  remembers pages no tier holds any more: a prompt recomputed after its pages
  left every tier counts as seen twice.
- `DiskAdmission`: admit a page when the sketch has seen it at least
  `min_count` times (reused: the shared system prompts, documents and
  conversations that came back), or when a structure signal the index gives
  for free predicts reuse: the page is new in a request that extended an
  earlier request's whole prompt (a conversation's next turn: its pages start
  the turn after). Measured on the shared trace and the generated workloads
  (`hicache bench trace` ablation rows, docs/benchmarks.md): the next-turn
  signal pays on Mooncake and chat (without it the Mooncake trace loses 0.05 of
  hit rate at 15% capacity) and never costs; "the page ended a request" (its
  tail) helps chat but costs RAG, so it is off; depth in the prompt is not an
  input (it separates reuse less than the next turn on Mooncake) and fan-out is
  a count the sketch already keeps.
- Adaptive: while the disk has room for the page without evicting anything,
  every page is admitted (a write then costs no hit), so light pressure
  behaves as plain write-everything; the filter acts only when a write would
  push a page out.

Keys are ints: the daemon passes the first 8 bytes of a page key (a hash), the
simulator block ids; both are mixed before indexing, so sequential ids spread.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.index import native_index
from hicache.index.keys import KEY_BYTES, PackedKeys

_M64 = (1 << 64) - 1
_HALVE = bytes(x >> 1 for x in range(256))
MAX_COUNT = 15


def admission_key(page_key: bytes) -> int:
    """A page key (a 16-byte hash) as the int the sketches take."""
    return int.from_bytes(page_key[:8], "little")


ADMISSION_MODES = ("all", "reuse")


def _mix(x: int) -> int:
    """splitmix64's finalizer: a fixed (not per-process) hash of an int."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class FrequencySketch:
    """Count-min sketch of recent accesses, with halving every `10 * width` additions.

    The counters are one bytearray, row i at `i * width`. Keys come as ints (`add`,
    `estimate`) or as 16-byte page keys (`add_pages`, `estimate_page`: the int is
    admission_key's), which the index's C module counts without a Python step per key
    (native_sketch.c, the same steps; tests/index/test_admission.py compares the two)."""

    __slots__ = ("width", "depth", "_mask", "_table", "_added", "_sample", "_native_add", "_native_estimate")

    def __init__(self, width: int, depth: int = 4, sample_factor: int = 10) -> None:
        if width < 1 or depth < 1 or sample_factor < 1:
            raise ValueError("width, depth and sample_factor must be >= 1")
        if depth > 16:
            raise ValueError("depth must be <= 16")
        self.width = 1 << max(4, (width - 1).bit_length())  # a power of two: index by mask
        self.depth = depth
        self._mask = self.width - 1
        self._table = bytearray(depth * self.width)
        self._added = 0
        self._sample = sample_factor * self.width
        self.use_native(native_index.load())

    def use_native(self, mod: object) -> None:
        """Count page keys with the C loop of native_sketch.c (None: in Python)."""
        self._native_add = None if mod is None else mod.sketch_add
        self._native_estimate = None if mod is None else mod.sketch_estimate

    def _slots(self, key: int) -> list[int]:
        h = _mix(key)
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1  # double hashing (Kirsch-Mitzenmacher)
        w, mask = self.width, self._mask
        return [i * w + ((h1 + i * h2) & mask) for i in range(self.depth)]

    def add(self, key: int) -> int:
        """Count one access; returns the estimate after it."""
        slots = self._slots(key)
        t = self._table
        low = min(t[s] for s in slots)
        if low < MAX_COUNT:  # conservative update: raise only the counters at the minimum
            for s in slots:
                if t[s] == low:
                    t[s] = low + 1
            low += 1
        self._added += 1
        if self._added >= self._sample:
            self._age()
        return low

    def add_pages(self, blob: bytes) -> None:
        """`add` of every page key packed in `blob` (16 bytes each), in order."""
        if len(blob) % KEY_BYTES:
            raise ValueError("keys must be packed 16-byte page keys")
        if self._native_add is not None:
            self._added = self._native_add(self._table, self.depth, self._mask, blob, self._added, self._sample)
            return
        for i in range(0, len(blob), KEY_BYTES):
            self.add(int.from_bytes(blob[i:i + 8], "little"))

    def estimate(self, key: int) -> int:
        t = self._table
        return min(t[s] for s in self._slots(key))

    def estimate_page(self, page_key: bytes) -> int:
        """`estimate` of a page key (16 bytes)."""
        if self._native_estimate is not None:
            return self._native_estimate(self._table, self.depth, self._mask, page_key)
        return self.estimate(admission_key(page_key))

    def _age(self) -> None:
        self._table = self._table.translate(_HALVE)
        self._added //= 2


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """`mode`: "all" (write every page, as before admission) or "reuse" (the filter).
    The signals are on by default; the bench's ablation turns each off."""

    mode: str = "reuse"
    min_count: int = 2
    tail: bool = False  # a request's last page is admitted (measured: it does not pay)
    next_turn: bool = True  # the new pages of a request that extended an earlier whole prompt
    when_room: bool = True  # admit everything while a write evicts nothing

    def __post_init__(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise ValueError(f"disk admission must be one of {ADMISSION_MODES}, got {self.mode!r}")
        if not 1 <= self.min_count <= MAX_COUNT:
            raise ValueError(f"min_count must be in 1..{MAX_COUNT}")


def admission_capacity_pages(tier_bytes: int, typical_page_bytes: int = 256 << 10) -> int:
    """How many pages the sketches are sized for: the tiers' bytes at a typical page size
    (the daemon learns page sizes per namespace, later), clamped so the sketches stay
    under 5 MiB."""
    return min(1 << 18, max(4096, tier_bytes // typical_page_bytes))


class DiskAdmission:
    """The admission decision for the tier below the host; one per daemon (namespaces
    share the disk). Callers report accesses (`record`) and request shapes
    (`request`), then ask `admit` before queueing a write."""

    def __init__(self, config: AdmissionConfig, capacity_pages: int) -> None:
        self.config = config
        self.sketch = FrequencySketch(max(16384, capacity_pages))
        # Membership sketches (a count > 0 is all they answer), 4x wider than the pages the
        # tiers hold so false positives stay rare; aging forgets what the tiers lost long ago.
        self._tails = FrequencySketch(max(16384, 4 * capacity_pages), depth=2)  # pages that ended a request
        self._hinted = FrequencySketch(max(16384, 4 * capacity_pages), depth=2)  # tail / next-turn pages
        self.admitted_pages = 0
        self.rejected_pages = 0

    def request(self, keys: list[int], matched: int) -> None:
        """A request's page keys in prompt order, `matched` of them already cached:
        counts one access of each, remembers its tail, and hints the new pages of a
        next turn."""
        if not keys:
            return
        cfg = self.config
        for k in keys:
            self.sketch.add(k)
        if cfg.next_turn and 0 < matched < len(keys) and self._tails.estimate(keys[matched - 1]):
            for k in keys[matched:]:
                self._hinted.add(k)
        if cfg.tail:
            self._hinted.add(keys[-1])
        self._tails.add(keys[-1])

    def request_pages(self, keys: list[bytes] | PackedKeys, matched: int) -> None:
        """`request` of page keys as the engines send them (16 bytes each), counted
        without turning each into an int first."""
        blob = keys.blob if type(keys) is PackedKeys else b"".join(keys)
        n = len(blob) // KEY_BYTES
        if not n:
            return
        cfg = self.config
        self.sketch.add_pages(blob)
        if cfg.next_turn and 0 < matched < n and \
                self._tails.estimate_page(blob[(matched - 1) * KEY_BYTES:matched * KEY_BYTES]):
            self._hinted.add_pages(blob[matched * KEY_BYTES:])
        last = blob[-KEY_BYTES:]
        if cfg.tail:
            self._hinted.add_pages(last)
        self._tails.add_pages(last)

    def expects_reuse(self, key: int) -> bool:
        return self.config.mode == "all" or self.predicts_reuse(key)

    def predicts_reuse(self, key: int) -> bool:
        """The filter's verdict whatever the mode (the remote tier has its own mode)."""
        cfg = self.config
        return self.sketch.estimate(key) >= cfg.min_count or self._hinted.estimate(key) > 0

    def admit(self, head: int, num_pages: int, has_room: bool) -> bool:
        """Whether a run of `num_pages` pages (one node) starting with page `head` is
        written; counted. `has_room`: the disk holds it without evicting anything.
        The head speaks for the run: a prefix cache reads a page only after the ones
        before it, so the head is requested at least as often as any page after it
        (and one check per run keeps sketch false positives from adding up)."""
        ok = (has_room and self.config.when_room) or self.expects_reuse(head)
        if ok:
            self.admitted_pages += num_pages
        else:
            self.rejected_pages += num_pages
        return ok

    def stats(self) -> dict[str, int | str]:
        return {"mode": self.config.mode, "admitted_pages": self.admitted_pages,
                "rejected_pages": self.rejected_pages}
