"""Stream mode: a source of frames through the pipeline to one JSON object per frame.

    source ─► reader thread ─► (live: LatestSlot, newest frame wins) ─► pipeline ─► sink
                               (files: straight in, waiting when full: lossless)

A live camera keeps producing frames whether or not the model keeps up; the slot
holds only the newest, so a stale frame is dropped (and counted) before it costs
any encoder time and every answer is about a recent frame. Files, folders and
unpaced synthetic sources are read only as fast as the pipeline takes them, so
nothing is dropped. Optional change gating reuses the last answer for a frame that
barely differs from the last one processed.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

import cv2
import numpy as np

from edgemm.errors import InputError
from edgemm.pipeline import Pipeline, Request
from edgemm.runtime import Runtime
from edgemm.sources import Frame, Source

_END = object()


@dataclass
class StreamOptions:
    prompt: str
    every: int = 1  # process every Nth frame of the source
    fps: float | None = None  # process at most this many frames per second
    max_frames: int | None = None  # stop after this many processed frames
    change_threshold: float | None = None  # mean abs pixel change (0-255) below which the last answer is reused
    queue_size: int = 2
    live_inflight: int = 2  # live sources: frames in the pipeline at once (one encoding, one decoding)
    generation: dict = field(default_factory=dict)  # tier, max_new_tokens, … for every frame
    route: Callable[[], Any] | None = None  # the daemon's power policy: where this frame's stages run


@dataclass
class StreamSummary:
    frames: int = 0  # answered
    errors: int = 0
    dropped: int = 0  # live frames replaced by a newer one before processing
    skipped: int = 0  # left out on purpose by --every / --fps
    reused: int = 0  # answered by change gating
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)  # capture → answer
    stage_ms: dict[str, float] = field(default_factory=dict)  # mean busy time per item, per stage

    def to_dict(self) -> dict:
        lat = np.asarray(self.latencies_ms) if self.latencies_ms else np.zeros(1)
        return {"frames": self.frames, "errors": self.errors, "dropped": self.dropped,
                "skipped": self.skipped, "reused": self.reused, "seconds": round(self.seconds, 3),
                "fps": round(self.frames / self.seconds, 3) if self.seconds else 0.0,
                "latency_ms_p50": round(float(np.percentile(lat, 50)), 2),
                "latency_ms_p99": round(float(np.percentile(lat, 99)), 2),
                "stage_ms": {k: round(v, 3) for k, v in self.stage_ms.items()}}


class LatestSlot:
    """A one-item mailbox: put() replaces what is there (a drop), get() waits."""

    def __init__(self):
        self._item = None
        self._cond = threading.Condition()
        self.dropped = 0

    def put(self, item) -> None:
        with self._cond:
            final = self._item is _END or isinstance(self._item, Exception)
            if not final:  # the end marker and a source's failure are never overwritten
                if self._item is not None:
                    self.dropped += 1  # a frame nobody took: newer one wins
                self._item = item
            self._cond.notify()

    def get(self):
        with self._cond:
            while self._item is None:
                self._cond.wait()
            item, self._item = self._item, None
            return item


class ChangeGate:
    """Reuse the last answer when a frame barely differs from the last one processed."""

    def __init__(self, threshold: float, thumb: int = 32):
        self.threshold, self.thumb = threshold, thumb
        self._last: np.ndarray | None = None

    def __call__(self, request: Request) -> bool:
        small = cv2.resize(request.image, (self.thumb, self.thumb), interpolation=cv2.INTER_AREA)
        small = cv2.cvtColor(small, cv2.COLOR_RGB2GRAY).astype(np.float32)
        if self._last is not None and float(np.mean(np.abs(small - self._last))) < self.threshold:
            return True
        self._last = small
        return False


class FrameFilter:
    """--every N and --fps F: which source frames to process at all."""

    def __init__(self, every: int, fps: float | None, clock: Callable[[], float] = time.monotonic):
        self.every, self.interval, self.clock = every, (1.0 / fps if fps else 0.0), clock
        self._next_due = 0.0

    def keep(self, frame: Frame) -> bool:
        if frame.index % self.every:
            return False
        if self.interval:
            now = self.clock()
            if now < self._next_due:
                return False
            self._next_due = max(self._next_due, now) + self.interval
        return True


def run_stream(runtime: Runtime, source: Source, options: StreamOptions,
               emit: Callable[[dict], None], stop: threading.Event | None = None) -> StreamSummary:
    """Process `source` until it ends, `max_frames` were taken, or `stop` is set.

    Every frame taken into the pipeline is answered and emitted, also after a stop.
    """
    stop = stop or threading.Event()
    summary = StreamSummary()
    gate = ChangeGate(options.change_threshold) if options.change_threshold is not None else None
    pipeline = Pipeline(runtime, queue_size=options.queue_size, gate=gate)
    pending: queue.Queue = queue.Queue(maxsize=3 * options.queue_size + 3)  # in submission order
    slot = LatestSlot() if source.live else None
    frame_filter = FrameFilter(options.every, options.fps)
    taken = 0
    started = time.perf_counter()
    # Live: a frame is taken from the slot only when the pipeline has room for it, so it
    # never waits in a queue going stale while a newer frame sits in the slot.
    inflight = threading.BoundedSemaphore(options.live_inflight)

    def submit(frame: Frame) -> bool:
        """Into the pipeline (waits while it is full); False once max_frames were taken."""
        nonlocal taken
        if options.max_frames is not None and taken >= options.max_frames:
            stop.set()
            return False
        request = Request(frame.image, options.prompt, dict(options.generation), tag=frame)
        if options.route is not None:
            request.options["route"] = options.route()
        future = pipeline.submit(request)
        if slot is not None:
            future.add_done_callback(lambda _: inflight.release())
        pending.put((frame, future))
        taken += 1
        return True

    def read_frames() -> None:
        try:
            while not stop.is_set():
                try:
                    frame = source.read()
                except InputError as e:
                    if source.live:
                        raise
                    pending.put(e)  # a bad file in a folder: reported in order, then go on
                    continue
                if frame is None:
                    break
                if not frame_filter.keep(frame):
                    summary.skipped += 1
                elif slot is not None:
                    slot.put(frame)
                elif not submit(frame):
                    break
        except Exception as e:  # the source failed for good: say so after what was read
            (slot.put(e) if slot is not None else pending.put(e))
        finally:
            slot.put(_END) if slot is not None else pending.put(_END)

    def feed_latest() -> None:  # live only: the newest frame from the slot into the pipeline
        while True:
            inflight.acquire()
            item = slot.get()
            if item is _END or isinstance(item, Exception):
                if item is not _END:
                    pending.put(item)
                break
            if not submit(item):
                break
        pending.put(_END)

    def close_on_stop() -> None:  # a reader stuck on a camera (or reconnecting) wakes up
        stop.wait()
        source.close()

    threads = [threading.Thread(target=read_frames, name="edgemm-reader", daemon=True),
               threading.Thread(target=close_on_stop, name="edgemm-stopper", daemon=True)]
    if slot is not None:
        threads.append(threading.Thread(target=feed_latest, name="edgemm-feeder", daemon=True))
    for t in threads:
        t.start()
    try:
        while (item := pending.get()) is not _END:
            if isinstance(item, Exception):
                summary.errors += 1
                emit({"error": str(item)})
                continue
            summary.dropped = slot.dropped if slot is not None else 0
            emit(_answer(*item, summary))
    finally:
        stop.set()
        source.close()  # wakes a reader waiting on a camera or a paced source
        pipeline.close()
        summary.dropped = slot.dropped if slot is not None else 0
        summary.seconds = time.perf_counter() - started
        stats = pipeline.stats
        summary.stage_ms = {k: 1e3 * stats.busy_s[k] / max(1, stats.items[k]) for k in stats.busy_s}
    return summary


def _answer(frame: Frame, future, summary: StreamSummary) -> dict:
    try:
        result = future.result()
    except Exception as e:
        summary.errors += 1
        return {"frame": frame.index, "name": frame.name, "error": str(e)}
    age_ms = (time.time() - frame.capture_time) * 1e3
    summary.frames += 1
    summary.latencies_ms.append(age_ms)
    reused = result.finish_reason == "reused"
    summary.reused += reused
    stage = {k: round(v, 2) for k, v in result.timings_ms.items() if k != "total"}
    return {"frame": frame.index, "name": frame.name, "capture_time": round(frame.capture_time, 6),
            "tier": result.tier, "answer": result.text, "reused": reused, "stage_ms": stage,
            "e2e_ms": round(age_ms, 2), "latency_ms": round(result.timings_ms.get("total", 0.0), 2),
            "dropped": summary.dropped}
