"""Retention hints as requests carry them (hicache/client/hints.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hicache.client.hints import RetainHint


def test_a_vllm_request_hint_is_read_from_its_kv_transfer_params():
    h = RetainHint.from_transfer_params({"hicache": {"pin_ttl_s": 300, "tier": "disk", "priority": -3}})
    assert h == RetainHint(300, "disk", -3) and h.params() == {"ttl_s": 300.0, "tier": "disk", "priority": -3}
    assert RetainHint.from_transfer_params({"hicache": {"pin_ttl_s": 5}}) == RetainHint(5)
    assert RetainHint.from_transfer_params(None) is None
    assert RetainHint.from_transfer_params({"do_remote_prefill": True}) is None  # another connector's


def test_a_priority_only_hint_is_no_pin():
    h = RetainHint.from_transfer_params({"hicache": {"priority": 7}})
    assert h == RetainHint(priority=7) and not h.pins and h.params() == {"priority": 7}
    assert RetainHint(300).pins and RetainHint(priority=0).params() == {"priority": 0}  # 0 drops a priority


@pytest.mark.parametrize("hint", [{"pin_ttl_s": 0}, {"pin_ttl_s": float("inf")}, {"pin_ttl_s": True},
                                  {"pin_ttl_s": 60, "tier": "device"}, {"pin_ttl_s": 60, "priority": 1.5},
                                  {"pin_ttl_s": 60, "priority": 5000}, {"ttl": 60}, {"pin_ttl_s": 60, "x": 1},
                                  "60", {}, {"priority": 2000}, {"priority": 3, "tier": "disk"},
                                  {"pin_ttl_s": None, "priority": 3}])
def test_a_malformed_hint_is_refused_and_a_request_carrying_one_is_served_without_it(hint, caplog):
    with pytest.raises(ValueError):
        RetainHint.from_transfer_params({"hicache": hint})
    import tests.integrations.vllm_required  # noqa: F401  (skips without vLLM; fails under CI)
    from hicache.integrations.vllm.requests import request_hint
    request = SimpleNamespace(request_id="r1", kv_transfer_params={"hicache": hint})
    assert request_hint(request) is None
    assert "hint ignored" in caplog.text
