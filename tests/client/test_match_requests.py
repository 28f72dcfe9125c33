"""`HiCacheClient.match` sends its request spliced from a template holding the engine id
(framing.BlobRequest): each engine's match must be its own, also when a daemon restart
hands the same clients their ids the other way round. Against a real daemon: a match made
as the wrong engine would answer the other engine's device pages."""

from __future__ import annotations

import numpy as np

from hicache.client.client import HiCacheClient
from tests.daemon.test_robustness import LAYOUT

TOKENS = np.arange(32, dtype=np.int32)  # 8 pages of LAYOUT


def own_device_pages(client: HiCacheClient) -> list[int]:
    m = client.match(TOKENS)
    assert m.pin is not None, "the daemon did not answer"
    client.release(m)
    return m.device_pages.tolist()


def test_each_engines_match_is_its_own_across_a_restart(daemon):
    a = HiCacheClient(LAYOUT, 64, model="m", socket_path=daemon.socket)
    b = HiCacheClient(LAYOUT, 64, model="m", socket_path=daemon.socket)
    try:
        ids = []
        for order in ([a, b], [b, a]):  # after the restart the ids go the other way round
            for c in order:
                assert c.connect()
            ids.append((a.engine_id, b.engine_id))
            assert own_device_pages(a) == [] and own_device_pages(b) == []
            assert a.insert(TOKENS, np.arange(1, 9)) is not None
            assert b.insert(TOKENS, np.arange(11, 19)) is not None
            for _ in range(3):  # the template is reused call after call
                assert own_device_pages(a) == list(range(1, 9))
                assert own_device_pages(b) == list(range(11, 19))
            a.close()  # the same clients connect again below, each keeping its template
            b.close()
            daemon.stop()
            daemon.start()
        assert ids[1] == ids[0][::-1] and ids[0][0] != ids[0][1]
    finally:
        a.close()
        b.close()
