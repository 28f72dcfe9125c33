"""The engine-side transfer executor: per-layer host->device loads and
all-layer device->host backups, run off the compute path.

CUDA pools: loads go on a side (load) stream with one CUDA event per layer;
`LoadHandle.wait_layer(l)` makes the *current* stream wait on event `l`, a
GPU-side wait, so attention for layer `l` starts as soon as its bytes are in
place and the host never blocks. Backups go on a second stream that first
waits on the current stream (the pages were just written by compute).

CPU pools: one reused worker thread runs jobs in submission order (so a
backup and a later load of the same pages stay ordered); each load has a
`threading.Event` per layer. An exception on the worker is stored on the
handle and raised, wrapped in `TransferError`, by `wait`/`wait_layer`;
the layers after the failure are released so nobody waits forever.

The caller owns page lifetimes: device pages being loaded or backed up, and
host slots being read or written, must not be reused until the handle is done.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from hicache.errors import HiCacheError
from hicache.tiers.device.pool import DevicePool
from hicache.tiers.host.kv_cache import HostKVCache, PagePlan

log = logging.getLogger(__name__)

LayerHook = Callable[[int], None]


class TransferError(HiCacheError):
    """A copy failed on the transfer worker; the cause is chained."""


# ---------------------------------------------------------------------------
# Handles
# ---------------------------------------------------------------------------

class LoadHandle:
    """Progress of one per-layer load (CPU worker version)."""

    __slots__ = ("num_layers", "_events", "_error", "_failed_layer")

    def __init__(self, num_layers: int, done: bool = False) -> None:
        self.num_layers = num_layers
        self._events = [threading.Event() for _ in range(num_layers)]
        self._error: BaseException | None = None
        self._failed_layer = num_layers
        if done:
            for ev in self._events:
                ev.set()

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.num_layers:
            raise HiCacheError(f"layer_id must be in [0, {self.num_layers}), got {layer_id}")

    def _raise_if_failed(self, layer_id: int) -> None:
        if self._error is not None and layer_id >= self._failed_layer:
            raise TransferError(f"host->device load failed at layer {self._failed_layer}") from self._error

    def wait_layer(self, layer_id: int) -> None:
        """Return once layer `layer_id` is in place (layers complete in order)."""
        self._check_layer(layer_id)
        self._events[layer_id].wait()
        self._raise_if_failed(layer_id)

    def layer_ready(self, layer_id: int) -> bool:
        """Poll: is layer `layer_id` finished (copied, or failed)?"""
        self._check_layer(layer_id)
        return self._events[layer_id].is_set()

    def done(self) -> bool:
        """Poll: has every layer finished (copied, or failed)?"""
        return self.num_layers == 0 or self._events[-1].is_set()

    def wait(self) -> None:
        """Block until every layer is in place; raise TransferError if the copy failed."""
        if self.num_layers:
            self.wait_layer(self.num_layers - 1)

    # worker side
    def _layer_done(self, layer_id: int) -> None:
        self._events[layer_id].set()

    def _fail(self, layer_id: int, exc: BaseException) -> None:
        self._error = exc
        self._failed_layer = layer_id
        for ev in self._events[layer_id:]:
            ev.set()


class CudaLoadHandle(LoadHandle):
    """Progress of one per-layer load on the load stream: one CUDA event per layer."""

    __slots__ = ("_cuda_events", "_plan", "_device")

    def __init__(self, cuda_events: list[torch.cuda.Event], plan: PagePlan) -> None:
        super().__init__(0)
        self.num_layers = len(cuda_events)
        self._cuda_events = cuda_events
        self._plan = plan  # keeps the page-id tensors alive while kernels read them
        self._device = plan.pool.device

    def wait_layer(self, layer_id: int) -> None:
        """Make the current stream wait for layer `layer_id` (no host synchronization)."""
        self._check_layer(layer_id)
        torch.cuda.current_stream(self._device).wait_event(self._cuda_events[layer_id])

    def layer_ready(self, layer_id: int) -> bool:
        self._check_layer(layer_id)
        return self._cuda_events[layer_id].query()

    def done(self) -> bool:
        return self._cuda_events[-1].query()

    def wait(self) -> None:
        """Block the host until every layer is in place, and order the current stream after it."""
        self._cuda_events[-1].synchronize()
        torch.cuda.current_stream(self._device).wait_event(self._cuda_events[-1])


class BackupHandle:
    """Progress of one all-layer backup (CPU worker version)."""

    __slots__ = ("_event", "_error")

    def __init__(self, done: bool = False) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None
        if done:
            self._event.set()

    def done(self) -> bool:
        """Poll: has the backup finished (copied, or failed)?"""
        return self._event.is_set()

    def wait(self) -> None:
        """Block until the host pages hold the bytes; raise TransferError if the copy failed."""
        self._event.wait()
        if self._error is not None:
            raise TransferError("device->host backup failed") from self._error

    def _finish(self, exc: BaseException | None = None) -> None:
        self._error = exc
        self._event.set()


class CudaBackupHandle(BackupHandle):
    __slots__ = ("_cuda_event", "_plan")

    def __init__(self, cuda_event: torch.cuda.Event, plan: PagePlan) -> None:
        super().__init__()
        self._cuda_event = cuda_event
        self._plan = plan

    def done(self) -> bool:
        return self._cuda_event.query()

    def wait(self) -> None:
        self._cuda_event.synchronize()


# ---------------------------------------------------------------------------
# Executor
# ---------------------------------------------------------------------------

class TransferExecutor:
    """Runs `HostKVCache` copies for one device pool asynchronously.

    `on_layer_done(l)` (optional) is called after each load layer: on CPU by the
    worker once layer `l` is in place, on CUDA after layer `l` is enqueued. An
    exception from it fails the load like a copy error would. For tests and metrics.
    """

    def __init__(self, host_cache: HostKVCache, device_pool: DevicePool, *,
                 on_layer_done: LayerHook | None = None) -> None:
        if device_pool.layout != host_cache.layout:
            raise HiCacheError("device pool and host cache have different layouts")
        self.host = host_cache
        self.pool = device_pool
        self.num_layers = device_pool.layout.num_layers
        self.on_layer_done = on_layer_done
        self.is_cuda = device_pool.device.type == "cuda"
        self._closed = False
        self._lock = threading.Lock()
        host_cache.bind(device_pool)  # registers the arena on CUDA: at setup, not on a request
        if self.is_cuda:
            self._load_stream = torch.cuda.Stream(device_pool.device)
            self._backup_stream = torch.cuda.Stream(device_pool.device)
        else:
            self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="hicache-transfer", daemon=True)
            self._thread.start()

    # -- public --------------------------------------------------------------------
    def load(self, host_pages: object, device_pages: object) -> LoadHandle:
        """Start copying host slots `host_pages` into device pages `device_pages`, layer by
        layer. Bad ids raise here (HostCacheError) and nothing is copied."""
        self._check_open()
        if self.is_cuda:
            return self._load_cuda(host_pages, device_pages)
        plan = self.host.prepare(self.pool, host_pages, device_pages)
        if len(plan) == 0:
            return LoadHandle(self.num_layers, done=True)
        handle = LoadHandle(self.num_layers)
        self._submit(lambda: self._load_job(plan, handle))
        return handle

    def backup(self, host_pages: object, device_pages: object) -> BackupHandle:
        """Start copying every layer of device pages `device_pages` into host slots
        `host_pages`; poll `done()`. Bad ids raise here and nothing is copied."""
        self._check_open()
        if self.is_cuda:
            return self._backup_cuda(host_pages, device_pages)
        plan = self.host.prepare(self.pool, host_pages, device_pages)
        if len(plan) == 0:
            return BackupHandle(done=True)
        handle = BackupHandle()
        self._submit(lambda: self._backup_job(plan, handle))
        return handle

    def wait_idle(self) -> None:
        """Block until every copy submitted so far has finished (or failed)."""
        if self.is_cuda:
            self._load_stream.synchronize()
            self._backup_stream.synchronize()
            return
        idle = threading.Event()
        try:
            self._submit(idle.set)  # jobs run in submission order
        except HiCacheError:  # closed: close() ran every queued job
            return
        idle.wait()

    def close(self) -> None:
        """Finish queued jobs, then stop. Idempotent; handles stay usable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.is_cuda:
            self._load_stream.synchronize()
            self._backup_stream.synchronize()
        else:
            self._jobs.put(None)
            self._thread.join()

    def __enter__(self) -> TransferExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- CPU worker ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise HiCacheError("transfer executor is closed")

    def _submit(self, job: Callable[[], None]) -> None:
        with self._lock:  # no job may slip in behind close()'s stop marker
            self._check_open()
            self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def _load_job(self, plan: PagePlan, handle: LoadHandle) -> None:
        layer = 0
        try:
            for layer in range(self.num_layers):
                self.host.load_layer(plan, layer)
                handle._layer_done(layer)
                if self.on_layer_done is not None:
                    self.on_layer_done(layer)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter, never swallowed
            log.debug("load failed at layer %d: %r", layer, e)
            # A hook failure comes after its layer is in place; the next layer fails.
            failed = layer + 1 if handle.layer_ready(layer) else layer
            if failed < self.num_layers:
                handle._fail(failed, e)
            else:
                handle._error = e  # every layer is in place; wait() still reports it
                handle._failed_layer = self.num_layers - 1

    def _backup_job(self, plan: PagePlan, handle: BackupHandle) -> None:
        try:
            self.host.backup(plan)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            log.debug("backup failed: %r", e)
            handle._finish(e)
        else:
            handle._finish()

    # -- CUDA streams ----------------------------------------------------------------
    def _load_cuda(self, host_pages: object, device_pages: object) -> LoadHandle:
        stream = self._load_stream
        # The target pages may have just been released by work queued on the compute stream.
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(stream):
            plan = self.host.prepare(self.pool, host_pages, device_pages)
            if len(plan) == 0:
                return LoadHandle(self.num_layers, done=True)
            events = []
            for layer in range(self.num_layers):
                self.host.load_layer(plan, layer)
                ev = torch.cuda.Event()
                ev.record(stream)
                events.append(ev)
                if self.on_layer_done is not None:
                    self.on_layer_done(layer)
        return CudaLoadHandle(events, plan)

    def _backup_cuda(self, host_pages: object, device_pages: object) -> BackupHandle:
        stream = self._backup_stream
        # Order after the compute that produced the pages.
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(stream):
            plan = self.host.prepare(self.pool, host_pages, device_pages)
            if len(plan) == 0:
                return BackupHandle(done=True)
            self.host.backup(plan)
            ev = torch.cuda.Event()
            ev.record(stream)
        return CudaBackupHandle(ev, plan)
