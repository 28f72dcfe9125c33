"""One daemon at production size and under sustained load: memory and CPU next to redis-server, event-loop
pauses, a soak.

Modules:
  pause_bench.py     `hicache bench pauses`: the daemon's tail latency with a large index under write load.
  scale_bench.py     `hicache bench scale`: a daemon filled to production size, next to redis-server.
  scale_index.py     `hicache bench scale --index-only`.
  scale_probe.py     What `hicache bench scale` reads of the processes it measures.
  scale_redis.py     redis-server beside `hicache bench scale`: the same count of values of the page's size.
  scale_workload.py  The engine side of `hicache bench scale`.
  soak_bench.py      `hicache bench soak`: many engines cycling against one daemon for minutes.
"""
