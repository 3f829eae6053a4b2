"""Stream mode: a source of frames through a pipeline to one JSON object per frame.

    source ─► reader ─► (live: LatestSlot, newest frame wins) ─► a share ─► change gate ─► pipeline ─► sink
                        (files: straight on, waiting: lossless)                    └─ barely changed: ─┘
                                                                                      the last answer

The pipeline is the caller's: `edgemm stream` makes one for itself, the daemon passes
its one pipeline, shared by the API and every stream (edgemm.streams.manager), and a stream
that ends never closes it. Each stream keeps to its own share of that pipeline: at
most `share` frames in flight (a semaphore taken before a frame goes in, given back
when it is answered), so a fast camera cannot crowd out the API or another stream,
and the pipeline's inbox is sized for all the shares (Pipeline `reserved`).

A live camera keeps producing frames whether or not the model keeps up; the slot
holds only the newest, and a frame is taken from it only when the stream has a free
share, so a stale frame is dropped (and counted) before it costs any encoder time and
every answer is about a recent frame. Files, folders and unpaced synthetic sources are
read only as fast as the stream's share frees up, so nothing is dropped. Optional
change gating (in the stream, before the pipeline) answers a frame that barely differs
from the last one processed with that frame's answer: it never reaches the models.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgemm.errors import InputError
from edgemm.util.opencv import cv2
from edgemm.engine.pipeline import Pipeline, Request
from edgemm.streams.sources.base import Frame, Source

_END = object()
PENDING_EXTRA = 8  # reused frames and errors queued for emitting beyond the frames in flight
SUBMIT_WAIT_S = 60.0  # bound on a submit that should never wait (the pipeline is sized for the shares)
# bound on the wait for the stream's threads at its end: a reader in a native call (OpenCV
# rendering or decoding a frame) returns within it once the source is closed
THREADS_END_WAIT_S = 30.0


@dataclass
class StreamOptions:
    prompt: str
    every: int = 1  # process every Nth frame of the source
    fps: float | None = None  # process at most this many frames per second
    max_frames: int | None = None  # stop after this many processed frames
    change_threshold: float | None = None  # mean abs pixel change (0-255) below which the last answer is reused
    lossless_inflight: int = 4  # files: frames in the pipeline at once (one per stage and one waiting)
    live_inflight: int = 2  # live sources: frames in the pipeline at once (one encoding, one decoding)
    generation: dict = field(default_factory=dict)  # tier, max_new_tokens, … for every frame
    route: Callable[[], Any] | None = None  # the daemon's power policy: where this frame's stages run
    # the daemon's: one slot per frame in flight of all its streams together (max_streams × share),
    # so a removed stream whose last frames are still in flight can't push the total past what
    # the pipeline's inbox keeps for streams
    pool: threading.Semaphore | None = None
    # edgemm.streams.view's AnnotatedView (--view) or LatestFrame (the daemon's frame.jpg): given every
    # answer, and (when its every_frame says so) every source frame, once, in source order
    view: Any = None
    # called with each frame that goes into the pipeline (not a reused one), whether the stream
    # is behind (the frame waited for a place of the stream's: the source delivers faster than
    # the stream answers), and the frame's request, right before it is submitted: the daemon's
    # alerts attach their questions about it to that request (Request.followers), only when
    # the stream is not behind, but for a floor (edgemm.streams.alerts); must not wait
    also_ask: Callable[[Frame, bool, Request], None] | None = None

    def share(self, live: bool) -> int:
        """Most frames of this stream in the pipeline at once."""
        return self.live_inflight if live else self.lossless_inflight


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
    """A one-frame mailbox: put() replaces the frame there (a drop), get() waits.

    The end marker and a source's failure are final: they never replace the frame
    waiting (that frame is still given out, first), are never overwritten, and frames
    put after them are ignored.
    """

    def __init__(self):
        self._item = None
        self._final = None  # _END or the source's exception, given out after the frame
        self._cond = threading.Condition()
        self.dropped = 0

    def put(self, item) -> None:
        with self._cond:
            if self._final is None:
                if item is _END or isinstance(item, Exception):
                    self._final = item
                else:
                    if self._item is not None:
                        self.dropped += 1  # a frame nobody took: newer one wins
                    self._item = item
            self._cond.notify()

    def get(self):
        with self._cond:
            while self._item is None and self._final is None:
                self._cond.wait()
            if self._item is not None:
                item, self._item = self._item, None
                return item
            return self._final  # stays: a get after the end gets the end again


class ChangeGate:
    """Reuse the last answer when a frame barely differs from the last one processed.
    Called by the stream's feeding thread only; forget() may come from any thread."""

    def __init__(self, threshold: float, thumb: int = 32):
        self.threshold, self.thumb = threshold, thumb
        self._last: np.ndarray | None = None

    def __call__(self, image: np.ndarray) -> bool:
        """True: answer `image` with the last processed frame's answer. False: process it
        (it becomes the frame the next ones are compared with)."""
        small = cv2.resize(image, (self.thumb, self.thumb), interpolation=cv2.INTER_AREA)
        small = cv2.cvtColor(small, cv2.COLOR_RGB2GRAY).astype(np.float32)
        last = self._last
        if last is not None and float(np.mean(np.abs(small - last))) < self.threshold:
            return True
        self._last = small
        return False

    def forget(self) -> None:
        """The frame compared with failed: process the next one rather than repeat the error."""
        self._last = None


@dataclass
class _Taken:
    """A frame in the emit queue: `future` is its own answer, or, when `reused`, the answer
    of the processed frame it resembles (queued before it, so already awaited in order)."""
    frame: Frame
    future: Future
    reused: bool = False


@dataclass
class _Passed:
    """A frame the view is shown but the model is not (skipped by --every / --fps), in frame order."""
    frame: Frame


class FrameFilter:
    """--every N and --fps F: which source frames to process at all.

    --fps goes by the frame's own timestamp when it has one (a video file's: the file
    is read as fast as the model allows, so the clock says nothing about its time),
    else by the clock (cameras, paced sources).
    """
    SLACK_S = 1e-3  # timestamps in ms are not exact (0.30000000000000004 s): a frame this early is due

    def __init__(self, every: int, fps: float | None, clock: Callable[[], float] = time.monotonic):
        self.every, self.interval, self.clock = every, (1.0 / fps if fps else 0.0), clock
        self._next_due: float | None = None

    def keep(self, frame: Frame) -> bool:
        if frame.index % self.every:
            return False
        if self.interval:
            now = frame.media_time if frame.media_time is not None else self.clock()
            if self._next_due is not None and now + self.SLACK_S < self._next_due:
                return False
            self._next_due = (now if self._next_due is None else max(self._next_due, now)) + self.interval
        return True


def run_stream(pipeline: Pipeline, source: Source, options: StreamOptions,
               emit: Callable[[dict], None], stop: threading.Event | None = None) -> StreamSummary:
    """Process `source` through `pipeline` until it ends, `max_frames` were taken, or `stop` is set.

    Every frame taken is answered and emitted, in frame order, also after a stop. The
    pipeline is the caller's and stays open: in the daemon the API and the other streams
    go on using it, and this stream's frames in flight are answered whatever happens here.
    It returns, or raises what emit or the view raised, only once its own threads have ended.
    """
    return StreamRun(pipeline, source, options, emit, stop).run()


class StreamRun:
    """One run of a source through the pipeline: run_stream's threads and what they share.

    Which thread runs which method:
        the caller's    run(): starts the others, emits every item of `pending` in order
                        (the answers, errors, passed frames), then ends the others
        edgemm-reader   _read_frames(): reads the source; a file's frame takes a place and is
                        submitted here, a live one goes to `slot`
        edgemm-feeder   _feed_latest() (live sources only): a place, then the newest frame in
                        `slot`, submitted
        edgemm-stopper  _close_on_stop(): closes the source once `stop` is set
        the pipeline's  _give_back(), _forget_if_failed(): callbacks of a submitted frame's future

    What each shared field is guarded by:
        taken, last, last_prompt   one thread only: the one that submits (_submit: the reader
                                   for files, the feeder for live sources)
        share, pool                semaphores: taken by the submitting thread, given back from
                                   the pipeline's callbacks
        pending                    queue.Queue (its own lock), bounded: the reader or feeder
                                   waits when the emitting thread is behind
        slot                       LatestSlot (its own condition)
        gate                       the submitting thread; forget() from a callback is one assignment
        view_failed                appended by the reader before it puts its end marker, read by
                                   run() after taking that marker
        summary                    skipped: the reader; dropped, the answered figures: run() only
        stop                       threading.Event
    """

    def __init__(self, pipeline: Pipeline, source: Source, options: StreamOptions,
                 emit: Callable[[dict], None], stop: threading.Event | None = None):
        self.pipeline, self.source, self.options, self.emit = pipeline, source, options, emit
        self.stop = stop or threading.Event()
        self.summary = StreamSummary()
        self.gate = ChangeGate(options.change_threshold) if options.change_threshold is not None else None
        share_size = options.share(source.live)
        self.share = threading.BoundedSemaphore(share_size)
        self.pool = options.pool
        self.view = options.view
        self.every_frame = self.view is not None and self.view.every_frame
        # in frame order: the frames in flight (at most the share) and the reused or failed ones
        # between them; when it is full the reader waits (files) or the slot drops (live). A view
        # of a file is shown the skipped frames in order too: room for those between answers
        self.pending: queue.Queue = queue.Queue(
            maxsize=share_size * (options.every if self.every_frame else 1) + PENDING_EXTRA)
        self.slot = LatestSlot() if source.live else None
        self.frame_filter = FrameFilter(options.every, options.fps)
        self.taken = 0
        self.last: Future | None = None  # the last processed frame's answer: what a reused frame is given
        self.last_prompt = options.prompt  # what `last` answered: a new prompt (PATCH) is never answered with it
        self.view_failed: list[Exception] = []  # the view's error in the reader (live): it ends the stream

    # -- the caller's thread --

    def run(self) -> StreamSummary:
        started = time.perf_counter()
        summary, slot, view = self.summary, self.slot, self.view
        threads = [threading.Thread(target=self._read_frames, name="edgemm-reader", daemon=True),
                   threading.Thread(target=self._close_on_stop, name="edgemm-stopper", daemon=True)]
        if slot is not None:
            threads.append(threading.Thread(target=self._feed_latest, name="edgemm-feeder", daemon=True))
        for t in threads:
            t.start()
        try:
            while (item := self.pending.get()) is not _END:
                if isinstance(item, Exception):
                    summary.errors += 1
                    self.emit({"error": str(item)})
                    continue
                if isinstance(item, _Passed):
                    view.frame(item.frame)
                    continue
                summary.dropped = slot.dropped if slot is not None else 0
                record = _answer(item, summary)
                if view is not None:
                    view.answer(item.frame, record)
                    if self.every_frame and slot is None:
                        view.frame(item.frame)
                self.emit(record)
            if self.view_failed:
                raise self.view_failed[0]
        finally:
            self.stop.set()
            self.source.close()  # wakes a reader waiting on a camera or a paced source
            _wait_for_threads(threads, self.pending)
            summary.dropped = slot.dropped if slot is not None else 0
            summary.seconds = time.perf_counter() - started
            stats = self.pipeline.stats  # the whole pipeline's (in the daemon: shared with the API and other streams)
            summary.stage_ms = {k: 1e3 * stats.busy_s[k] / max(1, stats.items[k]) for k in stats.busy_s}
        return summary

    # -- the submitting thread (the reader for files, the feeder for live sources) --

    def _take_share(self) -> float | None:
        """One of this stream's places in the pipeline (and one of the daemon's pool): the
        wait ends when a frame of ours (or, for the pool, of a stream just removed) is answered.
        Returns when (time.time()) the place came if it had to wait for it, else None."""
        waited = not self.share.acquire(blocking=False)
        if waited:
            self.share.acquire()
        if self.pool is not None and not self.pool.acquire(blocking=False):
            waited = True
            self.pool.acquire()
        return time.time() if waited else None

    def _submit(self, frame: Frame, behind: bool = False) -> bool:
        """A frame holding a share: into the pipeline, or answered with the last processed
        frame's answer when the gate says it barely changed. False once max_frames were taken.
        `behind`: the frame had to wait for its place (said to also_ask)."""
        options, gate = self.options, self.gate
        if options.max_frames is not None and self.taken >= options.max_frames:
            self._give_back()
            self.stop.set()
            return False
        self.taken += 1
        request = None
        try:
            prompt = options.prompt  # read once: the daemon may change it meanwhile
            if gate is not None and gate(frame.image) and self.last is not None and self.last_prompt == prompt:
                future, reused = self.last, True
            else:
                request = Request(frame.image, prompt, dict(options.generation), tag=frame)
                if options.route is not None:
                    request.options["route"] = options.route()
                if options.also_ask is not None:
                    options.also_ask(frame, behind, request)
                # The shares keep the pipeline's inbox from filling, so this does not wait in
                # practice; it must not (a waiting submit holds the pipeline's admission lock).
                future, reused = self.pipeline.submit(request, timeout=SUBMIT_WAIT_S), False
        except BaseException:
            self._give_back()
            for question in request.followers if request is not None else ():
                question.future.cancel()  # never submitted (a refusal cancelled them already): their places back
            raise
        if reused:
            self._give_back()  # it never entered the pipeline
        else:
            future.add_done_callback(self._give_back)
            future.add_done_callback(self._forget_if_failed)
            self.last, self.last_prompt = future, prompt
        self.pending.put(_Taken(frame, future, reused))
        return True

    # -- edgemm-reader --

    def _read_frames(self) -> None:
        source, slot, view, pending = self.source, self.slot, self.view, self.pending
        try:
            while not self.stop.is_set():
                try:
                    frame = source.read()
                except InputError as e:
                    if source.live:
                        raise
                    pending.put(e)  # a bad file in a folder: reported in order, then go on
                    continue
                if frame is None:
                    break
                if self.every_frame and slot is not None:
                    try:
                        view.frame(frame)  # live: shown as it comes, with the latest answer there is
                    except Exception as e:  # the view's failure (a full disk), not the source's:
                        self.view_failed.append(e)  # raised by run(), as one in the emit loop is
                        break
                if not self.frame_filter.keep(frame):
                    self.summary.skipped += 1
                    if self.every_frame and slot is None:
                        pending.put(_Passed(frame))
                elif slot is not None:
                    slot.put(frame)
                else:
                    # lossless: the reader waits here until the stream has room; a frame that
                    # waited for it is one the stream is behind on
                    waited = self._take_share() is not None
                    if self.stop.is_set():
                        self._give_back()
                        break
                    if not self._submit(frame, behind=waited):
                        break
        except Exception as e:  # the source failed for good: say so after what was read
            (slot.put(e) if slot is not None else pending.put(e))
        finally:
            slot.put(_END) if slot is not None else pending.put(_END)

    # -- edgemm-feeder (live sources only) --

    def _feed_latest(self) -> None:
        """The newest frame from the slot into the pipeline."""
        slot = self.slot
        assert slot is not None
        try:
            while True:
                # a share first, the frame second: the frame taken is the newest when there is room
                place_at = self._take_share()
                item = slot.get()
                if item is _END or isinstance(item, Exception):
                    self._give_back()
                    if item is not _END:
                        self.pending.put(item)
                    break
                # behind: the frame was captured while the stream waited for a place (it, or
                # the frames it replaced, waited for the stream, not the stream for it)
                if not self._submit(item, behind=place_at is not None and item.capture_time <= place_at):
                    break
        except Exception as e:  # e.g. the pipeline is closing: this stream ends, with the reason
            self.pending.put(e)
        finally:
            self.pending.put(_END)

    # -- edgemm-stopper --

    def _close_on_stop(self) -> None:
        """A reader stuck on a camera (or reconnecting) wakes up."""
        self.stop.wait()
        self.source.close()

    # -- the pipeline's threads (a submitted frame's future is done) --

    def _give_back(self, _: Future | None = None) -> None:
        if self.pool is not None:
            self.pool.release()
        self.share.release()

    def _forget_if_failed(self, future: Future) -> None:
        if self.gate is not None and not future.cancelled() and future.exception() is not None:
            self.gate.forget()


def _wait_for_threads(threads: list[threading.Thread], pending: queue.Queue) -> None:
    """The stream's own threads ended before run_stream returns, also when it ends by an error
    (an emit that cannot write): a reader left inside OpenCV's native code at interpreter exit
    can abort the process ("terminate called without an active exception"). What is still
    pending is dropped, so that a reader or feeder waiting for room in it can reach its end;
    the frames in flight are still answered by the pipeline, which gives their shares back."""
    deadline = time.monotonic() + THREADS_END_WAIT_S
    for t in threads:
        while t.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                while True:
                    pending.get_nowait()
            t.join(0.05)


def _answer(taken: _Taken, summary: StreamSummary) -> dict:
    frame = taken.frame
    try:
        result = taken.future.result()
    except Exception as e:
        summary.errors += 1
        return {"frame": frame.index, "name": frame.name, "error": str(e)}
    age_ms = (time.time() - frame.capture_time) * 1e3
    summary.frames += 1
    summary.latencies_ms.append(age_ms)
    summary.reused += taken.reused
    # a reused frame spent no time in any stage, nor in the pipeline
    stage = {} if taken.reused else {k: round(v, 2) for k, v in result.timings_ms.items() if k != "total"}
    latency = 0.0 if taken.reused else result.timings_ms.get("total", 0.0)
    return {"frame": frame.index, "name": frame.name, "capture_time": round(frame.capture_time, 6),
            "tier": result.tier, "answer": result.text, "reused": taken.reused, "stage_ms": stage,
            "e2e_ms": round(age_ms, 2), "latency_ms": round(latency, 2), "dropped": summary.dropped}
