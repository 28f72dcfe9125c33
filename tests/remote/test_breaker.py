"""The breaker's rule, outcome by outcome: one slow or failed operation never opens it;
failures in a row do, and so does a store that fails half the time."""

from __future__ import annotations

from hicache.tiers.remote.breaker import CONSECUTIVE, RATE_MIN_FAILURES, WINDOW_S, Breaker


def test_failures_in_a_row_open_it_and_a_success_in_between_resets_them():
    b = Breaker()
    t = 0.0
    for _ in range(10):  # fail, fail, answer: never CONSECUTIVE in a row, and a third of the outcomes
        assert not b.failed(t)
        assert not b.failed(t + 0.1)
        b.succeeded(t + 0.2)
        t += 30.0  # the rate window forgets them
    assert [b.failed(t + i) for i in range(CONSECUTIVE)] == [False] * (CONSECUTIVE - 1) + [True]


def test_a_store_failing_half_the_time_opens_it():
    b = Breaker()
    opened = []
    for i in range(2 * RATE_MIN_FAILURES):
        b.succeeded(i * 0.1)
        opened.append(b.failed(i * 0.1 + 0.05))
    assert opened.index(True) == RATE_MIN_FAILURES - 1, opened  # the 5th failure, half the outcomes


def test_failures_spread_beyond_the_window_do_not_add_up():
    b = Breaker()
    for i in range(4 * RATE_MIN_FAILURES):
        assert not b.failed(i * WINDOW_S / 2)
        b.succeeded(i * WINDOW_S / 2 + 0.01)


def test_reset_forgets_everything():
    b = Breaker()
    for i in range(CONSECUTIVE - 1):
        b.failed(i)
    b.reset()
    assert b.consecutive == 0 and not b.failed(CONSECUTIVE)
