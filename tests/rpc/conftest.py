"""Every test of the RPC layer runs on both frame loops (see `frame_loop` in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _on_each_frame_loop(frame_loop):
    return frame_loop
