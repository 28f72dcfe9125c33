"""One SGLang instance in its own process: `python -m tests.integrations.sglang_worker SOCKET
store|load N SEED [KIND LAYOUT]`. Builds the backend through SGLang's dynamic factory over a
real host pool, stores N seeded pages (or finds and loads them and checks every byte), and
prints one JSON line."""

from __future__ import annotations

import json
import sys

from tests.integrations.sglang_util import PAGE_SIZE, backend, fill, host_pool, matches, page_keys


def main() -> None:
    socket, action, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    kind, layout = (sys.argv[5], sys.argv[6]) if len(sys.argv) > 6 else ("mha", "page_first")
    pool = host_pool(kind, layout, pages=n + 8)
    b = backend(socket, pool, mla=kind == "mla")
    keys = page_keys(n, seed)
    idx = pool.alloc(n * PAGE_SIZE)
    if action == "store":
        fill(pool, idx, seed)
        out = {"stored": b.batch_set_v1(keys, idx)}
    else:
        present = b.batch_exists(keys)
        got = b.batch_get_v1(keys, idx)
        out = {"exists": present, "got": got, "exact": matches(pool, idx, seed)}
    b.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
