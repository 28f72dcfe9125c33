"""Times every call vLLM makes into a KV connector, by method: what a connector adds to the
engine's step, measured the same way for any connector (hicache's, LMCache's), from outside it.

`CallClock.install(connector, role)` replaces, on that one object, each method of vLLM's
connector interface (the classes of vllm/distributed/kv_transfer/kv_connector/v1/base.py the
connector derives from: KVConnectorBase_V1, SupportsHMA) with a timed wrapper. Only the calls
vLLM makes are counted: a connector method calling another of its own runs untimed inside the
outer call, so no second is counted twice. The bench's engine process (vllm_step_driver.py)
installs it on the scheduler's and the worker's connector; nothing else does.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any


def interface_methods(connector: object) -> list[str]:
    """Public methods of vLLM's connector interface classes that `connector` derives from
    (class methods, static methods and properties excluded: vLLM calls those on the class)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    module = KVConnectorBase_V1.__module__
    names: set[str] = set()
    for cls in type(connector).__mro__:
        if cls.__module__ == module:
            names.update(n for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v))
    return sorted(names)


class CallClock:
    """Seconds per connector call, by "role.method", and their sum since the last `take_step`."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}
        self._step_s = 0.0
        self._inside = threading.local()  # in a timed call: nested calls are not timed again

    def install(self, connector: object, role: str) -> list[str]:
        """Time `connector`'s interface methods from now on; the method names wrapped."""
        names = interface_methods(connector)
        for name in names:
            setattr(connector, name, self._timed(f"{role}.{name}", getattr(connector, name)))
        return names

    def _timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "active", False):
                return fn(*args, **kwargs)
            self._inside.active = True
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                self._inside.active = False
                self.calls.setdefault(key, []).append(seconds)
                self._step_s += seconds

        return timed

    def take_step(self) -> float:
        """Seconds in connector calls since the last take (one engine step's, between steps)."""
        s, self._step_s = self._step_s, 0.0
        return s

    def take_calls(self) -> dict[str, list[float]]:
        """Each method's call times since the last take."""
        out, self.calls = self.calls, {}
        return out
