"""The fault-and-abuse suite's switches: `--long` (see tests/conftest.py) runs it at
full length, so those tests get a longer per-test timeout than CI's default."""

from __future__ import annotations

import pytest

LONG_TIMEOUT_S = 3 * 3600


@pytest.fixture
def long_mode(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--long"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--long"):
        return
    for item in items:
        if "robustness" in item.nodeid.split("/"):
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))
