"""A fake systemd: the NOTIFY_SOCKET a daemon under Type=notify reports READY=1, WATCHDOG=1 … to.

Used by tests/test_faults.py and bench/bench_faults.py (the watchdog under a stalled stage).
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

WAIT_S = 60.0  # bound on a notification that should come soon


class FakeSystemd:
    """A NOTIFY_SOCKET that records (monotonic time, datagram)."""

    def __init__(self, folder: Path):
        self.path = str(folder / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while not self.stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except socket.timeout:
                continue
            with self.cond:
                self.messages.append((time.monotonic(), data))
                self.cond.notify_all()

    def wait_for(self, predicate, after: float | None = None,
                 timeout: float = WAIT_S) -> tuple[float, str] | None:
        """(time, message) of the first message received after `after` (default: now) for
        which `predicate` holds, or None if none came within `timeout`."""
        after = time.monotonic() if after is None else after
        with self.cond:
            return self.cond.wait_for(lambda: next(((t, m) for t, m in self.messages if t > after and predicate(m)),
                                                   None), timeout)

    def expect(self, predicate, after: float | None = None, timeout: float = WAIT_S) -> tuple[float, str]:
        found = self.wait_for(predicate, after, timeout)
        if not found:
            raise SystemExit("the expected notification never came")
        return found

    def pings(self) -> list[float]:
        with self.cond:
            return [t for t, m in self.messages if "WATCHDOG=1" in m]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
