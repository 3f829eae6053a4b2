"""The source interface every kind of source implements, and the frames it yields."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgemm.streams.sources.uri import redact_uri


@dataclass
class Frame:
    index: int               # 0-based number of this frame from its source
    image: np.ndarray        # RGB uint8 (H, W, 3)
    capture_time: float      # time.time() when it was captured (wall clock)
    source: str              # the source URI (credentials masked)
    truth: object | None = None  # the edgemm.model.scenes.Scene for synthetic frames
    name: str | None = None      # file name, for image files, folders and globs
    media_time: float | None = None  # seconds into a video file (its timestamp); None when live


@dataclass
class SourceStats:
    frames: int = 0       # frames delivered
    reconnects: int = 0   # reopen attempts after a failure, over the source's life
    last_error: str | None = None  # why it last failed to open or deliver


class Source:
    """A stream of RGB frames. Subclasses implement `_open`, `_next_frame`, `_close`.

    `read()` may be called from one thread while another calls `close()`: close cuts
    a backoff wait short, never waits for a camera call under way (the reader releases the
    capture when that call returns), and later reads return None. A closed source stays closed.

    `on_health`, if set, is called from the reading thread with the reason each time
    the source fails to open or deliver (and retries), and with None when it delivers
    a frame after not delivering (its first frame, or the first after a failure).
    """

    def __init__(self, uri: str, *, live: bool, sleep: Callable[[float], Any] | None = None):
        self.uri = uri
        self.live = live
        self.stats = SourceStats()
        self._shown = redact_uri(uri)
        self._closed = threading.Event()
        # Default wait: an Event, so close() wakes a reader sleeping in a backoff.
        self._sleep = sleep if sleep is not None else self._closed.wait
        self._lock = threading.Lock()  # one cv2 call at a time: never release mid-read
        self._opened = False
        self._next_index = 0
        self.on_health: Callable[[str | None], Any] | None = None
        self._delivering = False

    def check(self) -> None:
        """The checks that open nothing (no device, no network, no file's content): raise
        SourceUnusable for what no retry fixes, SourceError for what is wrong now."""

    def open(self) -> None:
        try:
            with self._lock:
                self._ensure_open()
        finally:
            self._release_if_closed()

    def read(self) -> Frame | None:
        """The next frame; None at the end of a file (or once closed)."""
        if self._closed.is_set():
            return None  # without the lock: another reader may be stuck in a camera call
        try:
            with self._lock:
                if self._closed.is_set():
                    return None
                self._ensure_open()
                frame = self._next_frame()
                return None if self._closed.is_set() else frame  # closed meanwhile: nothing more
        finally:
            self._release_if_closed()

    def close(self) -> None:
        """Mark the source closed, and release what it holds unless a reader is in a call to
        it (an RTSP open or read can block for many seconds inside FFmpeg or GStreamer): that
        reader releases it as its call returns. Never waits, so the event loop may call it."""
        self._closed.set()
        self._release_if_closed()

    def _release_if_closed(self) -> None:
        # close() marks before trying the lock, a reader tries it after leaving it: whichever
        # comes second finds the lock free and the mark set, so the capture is always released
        if self._closed.is_set() and self._lock.acquire(blocking=False):
            try:
                self._close()
            finally:
                self._lock.release()

    def __enter__(self) -> Source:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Frame]:
        while (frame := self.read()) is not None:
            yield frame

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._shown!r}, live={self.live})"

    def _ensure_open(self) -> None:
        if not self._opened:
            self._open()
            self._opened = True

    def _frame(self, image: np.ndarray, truth: object | None = None,
               name: str | None = None, media_time: float | None = None) -> Frame:
        """Stamp a captured image with its number, time and source."""
        frame = Frame(self._next_index, image, time.time(), self._shown, truth, name, media_time)
        self._next_index += 1
        self.stats.frames += 1
        if not self._delivering:
            self._delivering = True
            self._report(None)
        return frame

    def _failing(self, reason: str) -> None:
        """The source could not open or deliver, and will try again."""
        self._delivering = False
        self.stats.last_error = reason
        self._report(reason)

    def _report(self, reason: str | None) -> None:
        if self.on_health is not None:
            self.on_health(reason)

    def _open(self) -> None:
        pass

    def _next_frame(self) -> Frame | None:
        raise NotImplementedError

    def _close(self) -> None:
        pass
