"""What the cache keeps: policies simulated on a trace's block sequence, and a daemon's pins and quotas under
floods.

Modules:
  device_host_sim.py  Device and host pools simulated on a trace's block sequence: placement between them.
  pin_bench.py        `hicache bench pins`: pinned prefixes under a flood of one-shot prompts.
  policy_sim.py       Cache policies simulated on a trace's block sequence.
  quota_bench.py      `hicache bench quota`: a victim tenant's hit rate while another tenant floods.
  signal_sim.py       Structure signals as eviction priorities, simulated on a trace's block sequence.
  tiered_sim.py       hicache's host + disk tiers simulated on a trace's block sequence.
"""
