"""How pages come into the host tier: one protocol, four ways in.

protocol.py is the reserve -> copy -> commit protocol (host pages, anchor locks,
leases, ownership, cleanup and the "stored" announcement, written once). The ways in:
backups.py (the engine cycle's device -> host backups), puts.py (vLLM's host puts,
leased to a namespace), keyed.py (SGLang's keyed stores, kept as chains), and the
remote tier's fetches (hicache/daemon/movers/remote_mover.py).
"""
