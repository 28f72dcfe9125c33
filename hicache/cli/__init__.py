"""The `hicache` command line: `python -m hicache.cli` and the `hicache` entry point run main.py.

Modules:
  __main__.py  `python -m hicache.cli`: runs main.py's `main`.
  admin.py     Admin commands beyond one RPC: `hicache export`, `hicache import`.
  doctor.py    `hicache doctor`: checks the socket (reachable, mode 0660, owner), the daemon (pid, version).
  main.py      `hicache` command line: serve, admin commands, benchmarks, demo.
  pins.py      `hicache pin` / `unpin` / `prioritize`: an admin keeps a prefix in a tier for a time.
  quota.py     `hicache quota`: show and change tenant quotas on a running daemon.
"""
