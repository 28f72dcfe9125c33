"""What a (dead) daemon left in its disk tier, read straight from the LMDB files."""

from __future__ import annotations

from pathlib import Path

import lmdb

from hicache.tiers.disk import format as fmt


def committed_pages(disk_dir: str | Path) -> dict[bytes, tuple[bytes | None, bytes]]:
    """key -> (parent key or None, namespace salt) of every page committed to the
    environment. Only for an environment no process has open (after kill -9)."""
    env = lmdb.open(str(disk_dir), readonly=True, lock=False, create=False, max_dbs=8)
    try:
        meta = env.open_db(fmt.DB_META, create=False)
        out: dict[bytes, tuple[bytes | None, bytes]] = {}
        with env.begin(db=meta) as txn:
            for key, value in txn.cursor():
                rec = fmt.unpack_record(bytes(key), bytes(value))
                assert rec is not None, f"malformed meta record for key {bytes(key).hex()}"
                out[rec.key] = (rec.parent_key, rec.salt)
        return out
    finally:
        env.close()


def orphans(pages: dict[bytes, tuple[bytes | None, bytes]]) -> set[bytes]:
    """Committed pages whose chain of parents does not reach their namespace's root
    through committed pages: a rebuild cannot place them."""
    reachable: dict[bytes, bool] = {}
    for start in pages:
        chain = []
        key: bytes | None = start
        ok = True
        while key is not None and key not in reachable:
            if key not in pages:
                ok = False
                break
            chain.append(key)
            key = pages[key][0]
        if key is not None and key in reachable:
            ok = reachable[key]
        for k in chain:
            reachable[k] = ok
    return {k for k, ok in reachable.items() if not ok and k in pages}
