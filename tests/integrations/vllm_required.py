"""Imported first by every test module that runs vLLM: where vLLM is missing the module is
skipped, except under CI=true, where a missing vLLM fails the suite (scripts/setup.sh installs
it, and the vLLM proofs must run in CI)."""

from __future__ import annotations

import os

import pytest

try:
    import vllm  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise RuntimeError("vLLM is not installed: scripts/setup.sh installs it (the vLLM proof must run in CI)") \
            from None
    pytest.skip("vLLM is not installed (scripts/setup.sh installs it)", allow_module_level=True)
