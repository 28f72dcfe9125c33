"""Imported first by every test module that runs vLLM: where vLLM is missing the module is
skipped, except under CI=true, where a missing vLLM fails the suite (scripts/setup.sh installs
it, and the vLLM proofs must run in CI). It also holds what those modules share."""

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

# For tests that count hits exactly: a declared prefill rate so slow that every lookup's answer
# is worth waiting for (a request waits for it as long as computing its tokens would take), and
# deadlines in seconds for the workers' waited calls. On a loaded 2-core machine (TP=2 spins both
# cores) a starved daemon would otherwise take longer to answer than the tiny model takes to
# compute, and the connector rightly computes. The fault tests keep the defaults.
PATIENT = {"deadlines": {"connect_s": 5.0, "match_s": 5.0, "update_s": 5.0}, "prefill_tokens_per_s": 1.0}
