"""Portable export files: one namespace's disk tier as a self-checking stream.

Modules:
  files.py   Opening export and import files without being fooled by what another local user planted.
  format.py  The portable export file format: one namespace's disk tier, as a self-checking stream.
"""
