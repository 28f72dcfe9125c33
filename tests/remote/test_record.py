"""Remote records and settings, without a store: every check of a record refuses what
it must, and a password never shows in an error, a URL shown, or the config's repr."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from hicache.config import Config, load_config
from hicache.errors import ConfigError
from hicache.index.keys import page_keys
from hicache.tiers.disk import format as fmt
from hicache.tiers.remote import record as rr
from hicache.tiers.remote.redis_store import record_key
from hicache.tiers.remote.store import redact_url
from hicache.tiers.remote.store import RUN_PAGES, address, addresses

SALT = bytes(range(16))
FP = bytes(range(16, 32))
PAGE_SIZE = 4


def _page(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _chain(n: int = 3) -> tuple[np.ndarray, list[bytes]]:
    toks = np.arange(n * PAGE_SIZE, dtype=np.int32) * 7
    return toks, page_keys(SALT, toks, PAGE_SIZE)


@pytest.mark.parametrize("nbytes", [768, 64 << 10, (64 << 10) + 100])  # copied by memoryview, by numpy
def test_a_record_round_trips_bit_exact(nbytes):
    toks, keys = _chain()
    page = _page(nbytes)
    rec = rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], page)
    assert len(rec) == rr.record_bytes(PAGE_SIZE, nbytes)
    out = np.zeros(nbytes, dtype=np.uint8)
    got = rr.decode_into(bytes(rec), salt=SALT, key=keys[1], parent=keys[0], fingerprint=FP,
                         page_size=PAGE_SIZE, out=out)
    assert np.array_equal(out, page) and np.array_equal(got, toks[4:8])
    first = rr.encode(SALT, keys[0], None, FP, toks[:4], page)  # a first page: no parent
    rr.decode_into(bytes(first), salt=SALT, key=keys[0], parent=None, fingerprint=FP, page_size=PAGE_SIZE, out=out)


def _damaged(edit) -> str:
    toks, keys = _chain()
    rec = bytearray(rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], _page(4096)))
    rec = edit(rec)
    with pytest.raises(rr.RecordError) as e:
        rr.decode_into(bytes(rec), salt=SALT, key=keys[1], parent=keys[0], fingerprint=FP, page_size=PAGE_SIZE,
                       out=np.zeros(4096, dtype=np.uint8))
    return e.value.reason


def _flip(at: int):
    def edit(rec: bytearray) -> bytearray:
        rec[at] ^= 0x40
        return rec
    return edit


def test_every_kind_of_damage_is_refused():
    end = rr.HEADER_BYTES + 4 * PAGE_SIZE
    assert _damaged(_flip(end + 4095)) == "checksum"  # last page byte
    assert _damaged(_flip(end)) == "checksum"  # first page byte
    assert _damaged(_flip(rr.HEADER_BYTES + 1)) == "checksum"  # a token
    assert _damaged(_flip(0)) == "format"  # magic
    assert _damaged(_flip(4)) == "version"
    assert _damaged(_flip(8)) == "namespace"  # salt
    assert _damaged(_flip(24)) == "key"
    assert _damaged(_flip(40)) == "parent"
    assert _damaged(_flip(56)) == "namespace"  # layout fingerprint
    assert _damaged(_flip(rr._HEAD.size - 1)) == "checksum"  # the checksum itself
    assert _damaged(lambda r: r[:-1]) == "truncated"
    assert _damaged(lambda r: r + b"x") == "truncated"
    assert _damaged(lambda r: r[:10]) == "truncated"


def _with_page_checksum(rec: bytearray, algo: int, digest: tuple[int, int]) -> bytearray:
    """`rec` as a daemon using checksum `algo` would have written it (header crc redone)."""
    head = list(rr._HEAD.unpack_from(rec))
    head[2], head[10], head[11] = algo, *digest
    rr._HEAD.pack_into(rec, 0, *head)  # an unsigned record: its MAC field is not read
    tok_end = rr.HEADER_BYTES + 4 * head[8]
    rr._CRC.pack_into(rec, rr._HEAD.size, zlib.crc32(rec[rr.HEADER_BYTES:tok_end], zlib.crc32(rec[:rr._HEAD.size])), 0)
    return rec


def test_records_of_older_daemons_stay_readable():
    toks, keys = _chain()
    page = _page(8192 + 8)
    old = {fmt.CHECKSUM_CRC32: (zlib.crc32(page), 0), fmt.CHECKSUM_SUM64: fmt._sum64(page)}
    for algo, digest in old.items():
        rec = _with_page_checksum(bytearray(rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], page)), algo, digest)
        out = np.zeros(page.size, dtype=np.uint8)
        rr.decode_into(bytes(rec), salt=SALT, key=keys[1], parent=keys[0], fingerprint=FP, page_size=PAGE_SIZE,
                       out=out)
        assert np.array_equal(out, page)
        rec[-1] ^= 1  # and their checksums still guard them
        with pytest.raises(rr.RecordError, match="checksum"):
            rr.decode_into(bytes(rec), salt=SALT, key=keys[1], parent=keys[0], fingerprint=FP, page_size=PAGE_SIZE,
                           out=out)


def test_swapped_words_in_a_record_are_refused():
    toks, keys = _chain()
    rec = bytearray(rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], _page(4096)))
    at = rr.HEADER_BYTES + 4 * PAGE_SIZE + 64  # two neighbouring 8-byte words of the page
    rec[at:at + 8], rec[at + 8:at + 16] = rec[at + 8:at + 16], rec[at:at + 8]
    with pytest.raises(rr.RecordError, match="checksum"):
        rr.decode_into(bytes(rec), salt=SALT, key=keys[1], parent=keys[0], fingerprint=FP, page_size=PAGE_SIZE,
                       out=np.zeros(4096, dtype=np.uint8))


def test_a_record_is_only_served_as_the_page_its_tokens_hash_to():
    toks, keys = _chain()
    page = _page(4096)
    out = np.zeros(4096, dtype=np.uint8)
    # page 2's record asked for as page 1: its key, then its parent, disagree
    rec = rr.encode(SALT, keys[2], keys[1], FP, toks[8:12], page)
    with pytest.raises(rr.RecordError, match="key"):
        rr.decode_into(bytes(rec), salt=SALT, key=keys[1], parent=keys[0], fingerprint=FP, page_size=PAGE_SIZE, out=out)
    # a self-consistent header whose tokens do not hash to its key: forged or mixed up
    forged = rr.encode(SALT, keys[1], keys[0], FP, toks[8:12], page)
    with pytest.raises(rr.RecordError, match="key"):
        rr.decode_into(bytes(forged), salt=SALT, key=keys[1], parent=keys[0], fingerprint=FP, page_size=PAGE_SIZE,
                       out=out)
    # another layout's page size
    with pytest.raises(rr.RecordError, match="format"):
        rr.decode_into(bytes(rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], page)), salt=SALT, key=keys[1],
                       parent=keys[0], fingerprint=FP, page_size=PAGE_SIZE, out=np.zeros(2048, dtype=np.uint8))


def test_runs_share_a_hash_tag_and_consecutive_runs_do_not():
    keys = [bytes([i]) * 16 for i in range(40)]
    addrs = addresses(SALT, keys, 0, 40)
    assert address(SALT, keys, 17) == addrs[17]
    tags = [record_key(a).split(b"{")[1].split(b"}")[0] for a in addrs]
    assert len(set(tags[:RUN_PAGES])) == 1 and tags[RUN_PAGES] != tags[0] and tags[2 * RUN_PAGES] != tags[RUN_PAGES]
    assert record_key(addrs[0]).startswith(b"hc1:" + SALT.hex().encode() + b":")


def test_passwords_never_show():
    url = "redis://app:s3cr3t-pw@10.0.0.5:6379/0"
    assert "s3cr3t-pw" not in redact_url(url) and "10.0.0.5:6379" in redact_url(url)
    cfg = Config(remote_url=url, host_capacity=1 << 26, disk_capacity=1 << 28)
    assert "s3cr3t-pw" not in repr(cfg)
    with pytest.raises(ConfigError) as e:
        Config(remote_url="http://u:s3cr3t-pw@host:1", host_capacity=1 << 26, disk_capacity=1 << 28)
    assert "s3cr3t-pw" not in str(e.value) and "scheme" in str(e.value)
    with pytest.raises(ConfigError) as e:
        Config(remote_url="redis://u:s3cr3t-pw@host:99999", host_capacity=1 << 26, disk_capacity=1 << 28)
    assert "s3cr3t-pw" not in str(e.value)


def test_remote_settings_come_from_flags_variables_and_files(tmp_path):
    cfg = load_config(None, {"remote_url": "rediss://h:6380"},
                      environ={"HICACHE_REMOTE_TTL_S": "60", "HICACHE_REMOTE_TIMEOUT_S": "0.5"})
    assert (cfg.remote_url, cfg.remote_ttl_s, cfg.remote_timeout_s) == ("rediss://h:6380", 60.0, 0.5)
    toml = tmp_path / "c.toml"
    toml.write_text('[hicache]\nremote_url = "redis://10.0.0.5:6379"\nremote_queue_pages = 7\n')
    cfg = load_config(toml, environ={})
    assert cfg.remote_url == "redis://10.0.0.5:6379" and cfg.remote_queue_pages == 7
    with pytest.raises(ConfigError):
        load_config(None, environ={"HICACHE_REMOTE_TIMEOUT_S": "0"})


def test_the_removed_lookup_deadline_is_refused_naming_what_replaced_it(tmp_path):
    """remote_lookup_timeout_s bounded a match's wait for the store; a match no longer waits.
    Set anywhere (file, variable, flag), it is refused with the reason, not silently ignored."""
    toml = tmp_path / "c.toml"
    toml.write_text("[hicache]\nremote_lookup_timeout_s = 0.1\n")
    for source in ({"config_file": toml}, {"environ": {"HICACHE_REMOTE_LOOKUP_TIMEOUT_S": "0.1"}},
                   {"overrides": {"remote_lookup_timeout_s": 0.1}}):
        with pytest.raises(ConfigError, match="remote_lookup_timeout_s.*removed.*pending.*remote_timeout_s"):
            load_config(source.get("config_file"), source.get("overrides"), environ=source.get("environ", {}))


def test_a_missing_or_empty_password_file_is_a_clear_error(tmp_path):
    from hicache.tiers.remote.redis_store import RedisStore

    with pytest.raises(ConfigError, match="remote_password_file"):
        RedisStore("redis://h:1", password_file=str(tmp_path / "none"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        RedisStore("redis://h:1", password_file=str(tmp_path / "empty"))


# -- authenticated records ----------------------------------------------------------------
OLD_SECRET = b"old-secret-0123456789abcdef"
NEW_SECRET = b"new-secret-fedcba9876543210"


def _decode(rec, auth, nbytes: int = 4096) -> np.ndarray:
    toks, keys = _chain()
    out = np.zeros(nbytes, dtype=np.uint8)
    rr.decode_into(bytes(rec), salt=SALT, key=keys[1], parent=keys[0], fingerprint=FP, page_size=PAGE_SIZE,
                   out=out, auth=auth)
    return out


def _refused(rec, auth) -> str:
    with pytest.raises(rr.RecordError) as e:
        _decode(rec, auth)
    return e.value.reason


def _as_version_1(rec: memoryview) -> bytearray:
    """`rec` as a daemon before authentication wrote it: a 112-byte header, no MAC."""
    old = bytearray(rec[:rr._SIGNED]) + bytearray(rec[rr.HEADER_BYTES:])
    head = list(rr._HEAD.unpack_from(old))
    head[1], head[7] = 1, head[7] & ~rr._FLAG_MAC
    rr._HEAD.pack_into(old, 0, *head)
    tok_end = rr._SIGNED + 4 * PAGE_SIZE
    rr._CRC.pack_into(old, rr._HEAD.size, zlib.crc32(old[rr._SIGNED:tok_end], zlib.crc32(old[:rr._HEAD.size])), 0)
    return old


def test_a_signed_record_round_trips_and_a_forged_one_is_refused():
    from hicache.tiers.remote.auth import RecordAuth

    toks, keys = _chain()
    page = _page(4096)
    auth = RecordAuth([NEW_SECRET])
    signed = rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], page, auth=auth)
    assert np.array_equal(_decode(signed, auth), page)
    # valid checksums and key chain, arbitrary KV, no MAC: what anyone with write access can build
    forged = rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], _page(4096, seed=9))
    assert np.array_equal(_decode(forged, None), _page(4096, seed=9))  # unauthenticated: trusted...
    assert _refused(forged, auth) == "unsigned"  # ...with a secret: refused
    # signed, but under a secret this daemon does not hold
    assert _refused(rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], page, auth=RecordAuth([OLD_SECRET])),
                    auth) == "mac"
    # a record of a version-1 daemon (no MAC): readable without a secret, refused with one
    old = _as_version_1(rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], page))
    assert np.array_equal(_decode(old, None), page)
    assert _refused(old, auth) == "unsigned"


def test_a_signed_record_refuses_any_edit_its_checksums_would_miss():
    from hicache.tiers.remote.auth import RecordAuth

    toks, keys = _chain()
    auth = RecordAuth([NEW_SECRET])
    rec = bytearray(rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], _page(4096), auth=auth))
    # the page swapped and its checksums recomputed: every check but the MAC holds
    other = _page(4096, seed=5)
    rec[rr.HEADER_BYTES + 4 * PAGE_SIZE:] = other.tobytes()
    rec = _with_page_checksum(rec, fmt.CHECKSUM_XXH3, fmt.checksum(other))
    assert _refused(rec, auth) == "mac"
    assert _refused(_flip(rr._SIGNED + 3)(bytearray(rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], _page(4096),
                                                               auth=auth))), auth) == "mac"  # the MAC itself
    # the key id pointed at another secret the reader holds: still the wrong MAC
    both = RecordAuth([NEW_SECRET, OLD_SECRET])
    rec = bytearray(rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], _page(4096), auth=auth))
    rr._CRC.pack_into(rec, rr._HEAD.size, rr._CRC.unpack_from(rec, rr._HEAD.size)[0], RecordAuth([OLD_SECRET]).write_id)
    assert _refused(rec, both) == "mac"


def test_after_rotation_records_under_the_old_secret_still_read():
    from hicache.tiers.remote.auth import RecordAuth

    toks, keys = _chain()
    page = _page(4096)
    before = rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], page, auth=RecordAuth([OLD_SECRET]))
    rotated = RecordAuth([NEW_SECRET, OLD_SECRET])  # the new secret signs, both verify
    assert np.array_equal(_decode(before, rotated), page)
    after = rr.encode(SALT, keys[1], keys[0], FP, toks[4:8], page, auth=rotated)
    assert np.array_equal(_decode(after, RecordAuth([NEW_SECRET])), page)
    assert _refused(after, RecordAuth([OLD_SECRET])) == "mac"  # a node not yet rotated cannot read it


def test_secret_files_are_read_line_by_line_and_bad_ones_refused(tmp_path):
    from hicache.tiers.remote.auth import RecordAuth

    f = tmp_path / "secret"
    f.write_bytes(b"# rotated 2026-11\n" + NEW_SECRET + b"\n\n  " + OLD_SECRET + b"  \n")
    auth = RecordAuth.from_file(str(f))
    assert auth.write_secret == NEW_SECRET and NEW_SECRET.decode() not in repr(auth) + auth.describe()
    assert "2 secret(s)" in auth.describe()
    for body, why in ((b"", "no secret"), (b"# only a comment\n", "no secret"), (b"short\n", "shorter"),
                      (NEW_SECRET + b"\n" + NEW_SECRET + b"\n", "repeats")):
        f.write_bytes(body)
        with pytest.raises(ConfigError, match=why):
            RecordAuth.from_file(str(f))
    with pytest.raises(ConfigError, match="remote_secret_file"):
        RecordAuth.from_file(str(tmp_path / "missing"))
    cfg = load_config(None, {"remote_secret_file": str(f)}, environ={"HICACHE_REMOTE_WRITE_HOLD_S": "2"})
    assert cfg.remote_secret_file == str(f) and cfg.remote_write_hold_s == 2.0
    with pytest.raises(ConfigError, match="remote_write_hold_s"):
        load_config(None, environ={"HICACHE_REMOTE_WRITE_HOLD_S": "-1"})
