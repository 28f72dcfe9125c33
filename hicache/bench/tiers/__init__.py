"""Each tier's and each copy path's throughput against a raw baseline measured beside it.

Modules:
  blockcopy_bench.py        `hicache bench blockcopy`: the vLLM connector's block copies against a plain...
  blockcopy_cuda_bench.py   `hicache bench blockcopy --device cuda`.
  device_transfer_bench.py  Host arena <-> device pool copies on a GPU.
  disk_baselines.py         What disk_bench sets the disk tier against (raw py-lmdb, dd, preadv), and its tools.
  disk_bench.py             Disk tier throughput against raw py-lmdb and dd, measured side by side.
  disk_rebuild_bench.py     The disk tier's start-up rebuild for disk_bench: iter_meta, the index's restore.
  mooncake_bench.py         `hicache bench remote --backend mooncake`.
  remote_bench.py           `hicache bench remote`: the remote tier's put / get throughput and lookup...
  transfer_bench.py         Host arena <-> CPU device pool copy bandwidth, against a contiguous copy.
"""
