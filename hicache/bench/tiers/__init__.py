"""Each tier's and each copy path's throughput against a raw baseline measured beside it.

Modules:
  blockcopy_bench.py        `hicache bench blockcopy`: the vLLM connector's block copies against a plain...
  blockcopy_cuda_bench.py   `hicache bench blockcopy --device cuda`.
  device_transfer_bench.py  Host arena <-> device pool copies on a GPU.
  disk_bench.py             Disk tier throughput against raw py-lmdb and dd, measured side by side.
  mooncake_bench.py         `hicache bench remote --backend mooncake`.
  remote_bench.py           `hicache bench remote`: the remote tier's put / get throughput and lookup...
  transfer_bench.py         Host arena <-> CPU device pool copy bandwidth, against a contiguous copy.
"""
