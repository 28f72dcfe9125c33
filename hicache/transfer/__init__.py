"""Moving KV between the device pool and the host arena: the per-layer executor and write policies.

Modules:
  executor.py  The engine-side transfer executor.
  policy.py    When device pages are backed up to the host tier.
"""
