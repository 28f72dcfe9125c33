"""CallDeadlines from an engine's configuration (the vLLM connector's `deadlines` key)."""

from __future__ import annotations

import pytest

from hicache.client.deadlines import CallDeadlines
from hicache.errors import ConfigError


def test_a_number_is_every_calls_deadline() -> None:
    assert CallDeadlines.from_config(2) == CallDeadlines.uniform(2.0)


def test_a_mapping_overrides_only_the_kinds_it_names() -> None:
    d = CallDeadlines.from_config({"match_s": 1.5})
    assert d.match_s == 1.5
    assert d.update_s == CallDeadlines().update_s


@pytest.mark.parametrize("bad", [{"match": 1.0}, {"match_s": 0}, {"match_s": "1"}, "fast", True, [1.0],
                                 float("inf")])
def test_bad_deadlines_are_refused_clearly(bad: object) -> None:
    with pytest.raises(ConfigError):
        CallDeadlines.from_config(bad)


def test_a_mapping_keeps_the_base_for_the_kinds_it_does_not_name() -> None:
    base = CallDeadlines(match_s=0.5, load_s=2.0)
    d = CallDeadlines.from_config({"update_s": 3.0}, base=base)
    assert (d.match_s, d.load_s, d.update_s) == (0.5, 2.0, 3.0)
