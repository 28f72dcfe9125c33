"""Copy and allocation kernels: Triton kernels with torch twins, DMA page-run copies, the native modules' table
and loader.

Modules:
  alloc.py           Slot allocation for a batch of requests: the vectorized torch twin.
  alloc_triton.py    Triton kernels for batch slot allocation.
  copy.py            Page copies between the host arena and a device pool: the torch twins.
  copy_triton.py     Triton kernels for page copies between the host arena and a device pool.
  dma.py             Strided DMA copies for runs of consecutive pages: the copy engine instead of a kernel.
  native_build.py    Loading hicache's native modules: C compiled at build time by setup.py.
  native_copy.py     A batched chunk copy in C: one call copies a whole list of (src, dst, nbytes) chunks...
  native_modules.py  hicache's native modules: what setup.py compiles into the platform wheel.
  triton_env.py      Where the Triton kernels can run, shared by every kernel module: Triton installed.
"""
