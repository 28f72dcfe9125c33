"""Hybrid models (Mamba / linear attention layers): state checkpoints beside the KV.

states.py (HybridStates: which checkpoints are stored, matched and evicted),
disk.py (their disk movement), records.py (the records both share).
"""
