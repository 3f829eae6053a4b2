"""The one exponential backoff that camera reconnects, stream restarts and offload retries share."""
from __future__ import annotations

import math

from edgemm.util.backoff import Backoff


def test_doubles_from_first_up_to_the_cap():
    backoff = Backoff(0.5, 4.0)
    assert [backoff.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.failures == 6


def test_delay_does_not_count_and_reset_starts_over():
    backoff = Backoff(0.5, 30.0)
    backoff.next(), backoff.next()
    assert backoff.delay() == backoff.delay() == 2.0
    backoff.reset()
    assert backoff.next() == 0.5


def test_uncapped_by_default_and_never_overflows():
    backoff = Backoff(0.5)
    assert [backoff.next() for _ in range(4)] == [0.5, 1.0, 2.0, 4.0]
    backoff.failures = 10**6  # days of retrying: still a finite wait, no OverflowError
    assert math.isfinite(backoff.delay())
    assert Backoff(0.5, 8.0, failures=10**6).delay() == 8.0
