"""Write policies: parsing and the backup decisions they make."""

from __future__ import annotations

import pytest

from hicache.errors import ConfigError
from hicache.transfer.policy import BackupPolicy, WritePolicy


def test_parse_accepts_values_and_members():
    assert WritePolicy.parse("write_through") is WritePolicy.WRITE_THROUGH
    assert WritePolicy.parse("Write-Through-Selective") is WritePolicy.WRITE_THROUGH_SELECTIVE
    assert WritePolicy.parse(" write_back ") is WritePolicy.WRITE_BACK
    assert WritePolicy.parse(WritePolicy.WRITE_BACK) is WritePolicy.WRITE_BACK
    assert WritePolicy("write_back") is WritePolicy.WRITE_BACK  # the value constructor works too


@pytest.mark.parametrize("bad", ["write_around", "", None, 3])
def test_parse_rejects_with_the_choices(bad):
    with pytest.raises(ConfigError, match="write_through, write_through_selective, write_back"):
        WritePolicy.parse(bad)


def test_default_is_write_through_and_backs_up_on_insert():
    p = BackupPolicy()
    assert p.policy is WritePolicy.WRITE_THROUGH and p.hit_threshold == 2
    assert p.should_backup_on_insert(0) and p.should_backup_on_insert(5)
    assert not p.should_backup_on_evict()


def test_selective_waits_for_the_hit_threshold():
    p = BackupPolicy(WritePolicy.WRITE_THROUGH_SELECTIVE, hit_threshold=3)
    assert [p.should_backup_on_insert(h) for h in range(5)] == [False, False, False, True, True]
    assert not p.should_backup_on_evict()


def test_write_back_copies_only_on_eviction():
    p = BackupPolicy(WritePolicy.WRITE_BACK)
    assert not p.should_backup_on_insert(100)
    assert p.should_backup_on_evict()


@pytest.mark.parametrize("kw", [dict(hit_threshold=0), dict(hit_threshold=True), dict(policy="write_back")])
def test_bad_backup_policy(kw):
    with pytest.raises(ConfigError):
        BackupPolicy(**kw)


def test_backup_policy_is_frozen():
    p = BackupPolicy()
    with pytest.raises(AttributeError):
        p.hit_threshold = 5
