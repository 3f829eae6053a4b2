"""Exponential backoff with a cap: the wait before each retry of something that failed.

    first_s, 2 x first_s, 4 x first_s, ... never more than max_s

Used by camera reconnects (edgemm.streams.sources), daemon streams that restart
(edgemm.streams.manager) and offload retries (edgemm.power.offload). Each keeps its own
Backoff and calls reset() once the thing works again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Doublings stop counting here: after days of retrying the wait is still a finite float
# (2.0 ** 1024 overflows), and any real cap is reached long before.
MAX_DOUBLINGS = 60


@dataclass
class Backoff:
    first_s: float  # the wait before the first retry
    max_s: float = math.inf  # no wait is longer than this
    failures: int = 0  # retries counted since the last reset()

    def delay(self) -> float:
        """The wait before the next retry, without counting it."""
        return min(self.first_s * 2.0 ** min(self.failures, MAX_DOUBLINGS), self.max_s)

    def next(self) -> float:
        """The wait before the next retry; counts the retry, so the one after waits twice as long."""
        wait = self.delay()
        self.failures += 1
        return wait

    def reset(self) -> None:
        """It worked: the next failure waits first_s again."""
        self.failures = 0
