"""A stand-in for exactly the part of `torch.cuda` the vLLM worker's stream path uses
(`hicache.integrations.block_streams.StreamApi`: Stream, Event, current_stream,
stream), so its ordering logic runs on a machine without a GPU.

It records every call in `log` as tuples naming streams and events, e.g.
("record", "ev3", "load"), ("wait_event", "step", "ev3"), ("copy", "save"):
the copies themselves are the real kernels (run by Triton's interpreter on CPU
tensors, synchronously), spied on by `spy` to note which stream was current.
An event completes only when the test says so (`complete`), or when the code
blocks on it (`synchronize`, logged). Any other attribute of the stand-in, its
streams or its events fails the test: the code must use nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class _Strict:
    _what = "object"

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the stream path used {self._what}.{name}, which the recorder does not stand in for")


class RecStream(_Strict):
    _what = "torch.cuda.Stream"

    def __init__(self, rec: StreamRecorder, name: str) -> None:
        self.rec = rec
        self.name = name

    def wait_event(self, event: RecEvent) -> None:
        self.rec.log.append(("wait_event", self.name, event.name))

    def wait_stream(self, other: RecStream) -> None:
        self.rec.log.append(("wait_stream", self.name, other.name))


class RecEvent(_Strict):
    _what = "torch.cuda.Event"

    def __init__(self, rec: StreamRecorder, name: str, timing: bool) -> None:
        self.rec = rec
        self.name = name
        self.timing = timing
        self.stream: str | None = None
        self.seq = -1  # when it was recorded
        self.completed = False

    def record(self, stream: RecStream) -> None:
        assert isinstance(stream, RecStream), "events are recorded on a named stream"
        self.stream = stream.name
        self.completed = False
        self.rec.clock += 1
        self.seq = self.rec.clock
        self.rec.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        assert self.stream is not None, f"{self.name} queried but never recorded"
        return self.completed

    def synchronize(self) -> None:
        assert self.stream is not None, f"{self.name} synchronized but never recorded"
        self.rec.log.append(("synchronize", self.name))
        for ev in self.rec.events:  # a stream runs in order: what was recorded before is done too
            if ev.stream == self.stream and ev.seq <= self.seq:
                ev.completed = True

    def elapsed_time(self, end: RecEvent) -> float:
        assert self.timing and end.timing, "elapsed_time needs timing events at both ends"
        assert self.completed and end.completed, "elapsed_time of events not completed"
        return 1.0  # milliseconds


class StreamRecorder(_Strict):
    _what = "torch.cuda"

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.events: list[RecEvent] = []
        self.clock = 0  # counts records
        self.step = RecStream(self, "step")  # the stream vLLM runs the step on
        self._names = iter(["load", "save"])  # the order StreamCopies makes its streams in
        self._current = self.step

    def Stream(self, device: Any) -> RecStream:  # noqa: N802 - torch's name
        return RecStream(self, next(self._names))

    def Event(self, enable_timing: bool = False) -> RecEvent:  # noqa: N802
        ev = RecEvent(self, f"ev{len(self.events)}", enable_timing)
        self.events.append(ev)
        return ev

    def current_stream(self, device: Any = None) -> RecStream:
        return self._current

    @contextmanager
    def stream(self, stream: RecStream) -> Iterator[RecStream]:
        prev, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = prev

    # -- for the tests ---------------------------------------------------------------------
    def spy(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, logging ("copy", current stream) before each call."""
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.log.append(("copy", self._current.name))
            return fn(*args, **kwargs)
        return wrapper

    def complete(self) -> None:
        """Every event recorded so far has completed on the device."""
        for ev in self.events:
            if ev.stream is not None:
                ev.completed = True

    def take(self) -> list[tuple[str, ...]]:
        out, self.log = self.log, []
        return out
