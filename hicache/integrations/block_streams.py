"""Copies of an engine's own KV blocks on CUDA (the vLLM worker's): side streams and
events, never the step's stream.

The same plan as the reference engine's executor (hicache/transfer/executor.py),
for per-layer block tensors (the copies themselves: BlockCopier's kernel path,
straight between the KV tensors and the registered arena). Torch-only, no vLLM
import, so the GPU check runs it on a machine without vLLM:

- loads go on the load stream, which first waits for the work already queued on
  the step's stream (the blocks may have been read by it: they were just
  allocated). One event per layer is recorded after that layer's copy;
  `wait_layer` makes the step's stream wait on that event only, a GPU-side
  wait: the host never blocks, attention of layer l starts when its bytes are in.
- saves go on the save stream, which first waits on an event recorded on the
  step's stream after the forward pass (its writes are what is saved).
- a copy is reported done (pages handed to the daemon, pins released, blocks
  handed back to vLLM) only once its last event has completed: `poll` asks the
  events (`query`, never a host synchronization on the step's path).
- `order_after_saves` makes the step's stream wait for every save queued so far,
  GPU side: what vLLM needs before it reuses blocks a save still reads (a
  preempted request's, a sliding window's), without the host waiting.

A failure while queueing (bad ids, pages not mapped here) is returned to the
caller at once; events of the layers after it are still recorded, so whatever
waits on them is ordered after the copies that were queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hicache.integrations.block_copy import BlockCopier


class StreamApi(Protocol):
    """The part of `torch.cuda` used here, and all of it (tests stand in a recorder)."""

    def Stream(self, device: torch.device) -> Any: ...  # noqa: N802 - torch's names
    def Event(self, enable_timing: bool = False) -> Any: ...  # noqa: N802
    def current_stream(self, device: torch.device) -> Any: ...
    def stream(self, stream: Any) -> AbstractContextManager[Any]: ...


@dataclass(slots=True, eq=False)
class _InFlight:
    """Copies queued on a side stream, until their last event completes."""

    start: Any  # timing events around the copies
    done: Any
    on_done: Callable[[float], None]  # told the copies' GPU seconds


class StreamCopies:
    """Loads and saves of one worker on its own two CUDA streams."""

    def __init__(self, copier: BlockCopier, api: StreamApi | None = None) -> None:
        self.copier = copier
        self.api: StreamApi = api if api is not None else torch.cuda  # type: ignore[assignment]
        self.device = copier.device
        self.load_stream = self.api.Stream(self.device)
        self.save_stream = self.api.Stream(self.device)
        self._lock = threading.Lock()
        self._in_flight: list[_InFlight] = []
        self._last_save: Any = None  # the event of the newest save queued
        # Per-layer load events, reused every step: a stream's wait takes the event's state
        # when it is queued, so recording it again for the next step's load is safe.
        self._layer_events: list[Any] = []

    def _step_stream(self) -> Any:
        return self.api.current_stream(self.device)

    # -- loads --------------------------------------------------------------------------
    def load(self, per_layer: Sequence[tuple[list[int], list[int]]],
             on_done: Callable[[float, Exception | None], None]) -> tuple[list[Any], Exception | None]:
        """Queue layer l's (blocks, pages) copy for every layer: (an event per layer, the
        error that stopped the queueing or None). `on_done(seconds, error)` runs once
        what was queued has completed."""
        api, s = self.api, self.load_stream
        s.wait_stream(self._step_stream())
        while len(self._layer_events) < len(per_layer):
            self._layer_events.append(api.Event())
        events = self._layer_events[:len(per_layer)]
        start, done = api.Event(enable_timing=True), api.Event(enable_timing=True)
        error: Exception | None = None
        with api.stream(s):
            start.record(s)
            for layer, (blocks, pages) in enumerate(per_layer):
                if error is None:
                    try:
                        self.copier.load_layer(layer, blocks, pages)
                    except Exception as e:  # noqa: BLE001 - returned to the caller, which reports it
                        error = e
                events[layer].record(s)
            done.record(s)
        self._track(start, done, lambda seconds: on_done(seconds, error))
        return events, error

    def wait_layer(self, event: Any) -> None:
        """The step's stream waits for a layer's event (the host does not)."""
        self._step_stream().wait_event(event)

    # -- saves --------------------------------------------------------------------------
    def save(self, copies: Sequence[Callable[[], None]], after: Sequence[Any],
             on_done: Callable[[float, list[Exception | None]], None]) -> None:
        """Queue `copies` (each one save's copy calls) on the save stream, after what the
        step's stream has queued so far and the events `after`. `on_done(seconds, errors)`
        runs once they completed: per copy, None or the error that stopped its queueing."""
        api, s = self.api, self.save_stream
        forward = api.Event()
        forward.record(self._step_stream())
        s.wait_event(forward)
        for ev in after:
            s.wait_event(ev)
        start, done = api.Event(enable_timing=True), api.Event(enable_timing=True)
        errors: list[Exception | None] = []
        with api.stream(s):
            start.record(s)
            for copy in copies:
                try:
                    copy()
                    errors.append(None)
                except Exception as e:  # noqa: BLE001 - the caller reports that save failed
                    errors.append(e)
            done.record(s)
        self._last_save = done
        self._track(start, done, lambda seconds: on_done(seconds, errors))

    def order_after_saves(self) -> None:
        """The step's stream waits for every save queued so far (GPU side)."""
        if self._last_save is not None:
            self._step_stream().wait_event(self._last_save)

    # -- completion ---------------------------------------------------------------------
    def _track(self, start: Any, done: Any, on_done: Callable[[float], None]) -> None:
        with self._lock:
            self._in_flight.append(_InFlight(start, done, on_done))

    def poll(self) -> None:
        """Report the copies whose last event has completed."""
        with self._lock:
            finished = [f for f in self._in_flight if f.done.query()]
            if not finished:
                return
            self._in_flight = [f for f in self._in_flight if f not in finished]
        for f in finished:
            f.on_done(f.start.elapsed_time(f.done) / 1000.0)

    def sync(self) -> None:
        """Block until every queued copy has completed, and report them (a daemon
        restart, shutdown: the arena they use is about to go)."""
        with self._lock:
            pending = list(self._in_flight)
        for f in pending:
            f.done.synchronize()
        self.poll()

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._in_flight)
