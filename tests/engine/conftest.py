"""Fixtures of the reference engine's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hicache.engine.cached import CachedEngine


@pytest.fixture
def engines() -> Iterator[list[CachedEngine]]:
    """A list a test appends the engines it makes to; each is closed after the test."""
    made: list[CachedEngine] = []
    yield made
    for e in made:
        e.close()
