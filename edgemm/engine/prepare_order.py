"""The order prepared requests go on to the encoder in: the order the prepare workers took
them from the inbox, except that one preparing for longer than PREPARE_OVERTAKE_S is
overtaken, so a slow image (a 40 MP PNG, a progressive JPEG at its scan limit) holds up
the requests behind it for at most that long.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PREPARE_OVERTAKE_S = 0.25  # a request prepared longer than this is overtaken (a photo takes ~10-100 ms)


class PrepareOrder:
    """Tickets in the order requests were taken; a ticket's turn comes once every earlier
    one has gone on, failed, or been preparing for more than PREPARE_OVERTAKE_S.
    Thread-safe: every prepare worker and the encoder (`coming`) use it."""

    def __init__(self, clock: Callable[[], float]):
        """`clock`: by which a slow preparation is overtaken (a test passes one it moves by hand)."""
        self._clock = clock
        self._next_ticket = 0
        # the tickets not handed on yet → when their preparation started (None: prepared,
        # waiting for its turn, never overtaken)
        self._open: dict[int, float | None] = {}
        self._order = threading.Condition()
        self._handing = threading.Lock()  # one request at a time goes from _open to the encoder

    def ticket(self) -> int:
        """The next ticket, its preparation starting now. The caller takes the request and
        its ticket as one step (under its own lock), so tickets follow the inbox's order."""
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        with self._order:
            self._open[ticket] = self._clock()
        return ticket

    def done(self, ticket: int) -> None:
        """The ticket's request failed or was cancelled (or went on): nobody waits for it."""
        with self._order:
            self._open.pop(ticket, None)
            self._order.notify_all()

    @contextmanager
    def turn(self, ticket: int) -> Iterator[None]:
        """Waits for the ticket's turn; the body then hands its request on, before the next
        in line may."""
        with self._order:
            self._open[ticket] = None  # prepared: from now on nobody overtakes it
            while True:
                now = self._clock()
                waits = [PREPARE_OVERTAKE_S - (now - started) if started is not None else None
                         for earlier, started in self._open.items()
                         if earlier < ticket and (started is None or now - started < PREPARE_OVERTAKE_S)]
                if not waits:
                    break
                timed = [w for w in waits if w is not None]
                self._order.wait(min(timed) if len(timed) == len(waits) else None)
        # Out of _open before it is in the encoder's queue, so that the encoder, already
        # holding it, never waits for it as one still coming. _handing keeps the order:
        # the next in line, free to go once this ticket is gone, queues behind it.
        with self._handing:
            with self._order:
                del self._open[ticket]
                self._order.notify_all()
            yield

    def coming(self) -> bool:
        """Is a request being prepared that will go on soon? One prepared and waiting for its
        turn is, and one preparing for less than PREPARE_OVERTAKE_S. A preparation past that
        is a slow image, already overtaken: it may take seconds more."""
        with self._order:
            now = self._clock()
            return any(started is None or now - started < PREPARE_OVERTAKE_S for started in self._open.values())
