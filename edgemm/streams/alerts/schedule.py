"""Which frames an alert is asked about (every N, deferred while the stream is behind but
for a floor, in places of its own), and the debounced state its readings make. See
edgemm.streams.alerts."""
from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx

from edgemm.errors import Overloaded
from edgemm.config import AlertConfig, WebhookConfig
from edgemm.engine.pipeline import Pipeline, Request
from edgemm.streams.alerts.rules import Rule
from edgemm.streams.alerts.webhook import WebhookSender
from edgemm.streams.sources.base import Frame

ALERT_SHARE = 4  # alert questions of one stream in the pipeline at once
# questions of one alert in the pipeline at once: two, so that an alert still reads every
# frame when an answer takes longer than the time between frames (up to twice as long)
ALERT_INFLIGHT = 2
# a stream is behind from a frame that waited for its place until this many frames in a row
# have not: one frame that happened to find a place free (the source slow for a moment) is not
# capacity to spare
SPARE_AFTER = 3
SETTLE_S = 10.0  # how long a stream that ends waits for its alerts' last answers, so their events precede its end


class Debounce:
    """true / false / unknown, changed only by a run of readings: `on_after` true readings in a
    row make it true, `off_after` false ones false, and as many unknown ones as the larger of
    the two make it unknown. It starts unknown (nothing was read yet)."""

    def __init__(self, on_after: int, off_after: int):
        self.needed = {"true": on_after, "false": off_after, "unknown": max(on_after, off_after)}
        self.state = "unknown"
        self.reading: str | None = None  # the reading of the current run
        self.run = 0  # its length

    def observe(self, reading: str) -> bool:
        """Take one reading; True if the state changed to it."""
        self.run = self.run + 1 if reading == self.reading else 1
        self.reading = reading
        if reading != self.state and self.run >= self.needed[reading]:
            self.state = reading
            return True
        return False


@dataclass
class AlertFigures:
    readings: Counter = field(default_factory=Counter)  # true | false | unknown answers
    transitions: Counter = field(default_factory=Counter)  # state changes, by the state changed to
    errors: int = 0  # questions that failed in the pipeline (read as unknown)
    skipped: int = 0  # due, but asked on a later frame: the last question unanswered or no place free
    deferred: int = 0  # due, but the stream was behind: asked on a later frame (spare capacity, or the floor)
    asked: int = 0  # questions submitted (evaluations)


class Alert:
    def __init__(self, name: str, cfg: AlertConfig, webhook: "WebhookSender | None"):
        self.name, self.cfg, self.webhook = name, cfg, webhook
        self.rule = Rule.of(cfg)
        self.debounce = Debounce(cfg.on_after, cfg.off_after)
        self.figures = AlertFigures()
        self.since_frame: int | None = None  # the frame whose reading made the state what it is
        self.since_time: float | None = None
        self.asked: int | None = None  # the stream's processed-frame count when last asked
        self.floor = max(cfg.every, cfg.max_every)  # asked at least this often, however far behind the stream is
        self.in_flight = 0  # this alert's questions in the pipeline (at most ALERT_INFLIGHT)
        self.read_seq = -1  # the stream's processed-frame count of the latest reading taken (an older one is stale)


# ---- a stream's alerts -------------------------------------------------------------------------

class StreamAlerts:
    """One stream's alerts: asked from the stream's feeding thread, answered on the
    pipeline's decode thread, read from the event loop (states, metrics)."""

    def __init__(self, stream_id: str, alerts: Mapping[str, AlertConfig], webhook: WebhookConfig | None,
                 pipeline: Pipeline, publish: Callable[[dict], None], tier: str | None = None,
                 route: Callable[[], Any] | None = None, pool: threading.Semaphore | None = None,
                 environ: Mapping[str, str] = os.environ, transport: httpx.BaseTransport | None = None):
        self.stream_id, self.pipeline, self.publish = stream_id, pipeline, publish
        self.tier, self.route, self.pool = tier, route, pool  # pool: the manager's, every stream's alert places
        self.places = threading.BoundedSemaphore(ALERT_SHARE)
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._unanswered = 0  # questions submitted whose answer has not been read and published yet
        self.senders: dict[str, WebhookSender] = {}  # "stream" or the alert's name → its sender
        where = f"streams ({stream_id})"
        shared = None
        if webhook is not None and any(cfg.webhook is None for cfg in alerts.values()):
            shared = self.senders["stream"] = WebhookSender(webhook, f"{where}.webhook", environ, transport)
        self.alerts: list[Alert] = []
        for name, cfg in alerts.items():
            own = None
            if cfg.webhook is not None:
                own = self.senders[name] = WebhookSender(cfg.webhook, f"{where}.alerts.{name}.webhook",
                                                         environ, transport)
            self.alerts.append(Alert(name, cfg, own or shared))
        self.processed = 0  # frames this stream submitted (the clock of `every`)
        self.keeping_up = SPARE_AFTER  # frames in a row that found a place free (none has waited yet)

    # -- the stream's feeding thread --

    def ask(self, frame: Frame, behind: bool = False, leader: Request | None = None) -> None:
        """The alerts due on `frame` are asked, if they can be without waiting; the others
        are asked on a later frame. `leader`: the stream's own request about the frame, not
        submitted yet: the questions ride with it (Request.followers: one preparation and
        one encoding of the frame for all, decoded beside it); without one they are
        submitted into the pipeline on their own. `behind`: the stream is behind its
        source, so only alerts at their floor are asked (the others are deferred)."""
        count = self.processed
        self.processed += 1
        self.keeping_up = 0 if behind else self.keeping_up + 1
        deferring = self.keeping_up < SPARE_AFTER  # behind, or not caught up for long enough
        due = [a for a in self.alerts if a.asked is None or count - a.asked >= a.cfg.every]
        due.sort(key=lambda a: -1 if a.asked is None else a.asked)  # the longest waiting first
        for alert in due:
            # never asked counts from the stream's first frame: the floor holds from the start
            if deferring and count - (-1 if alert.asked is None else alert.asked) < alert.floor:
                with self._lock:
                    alert.figures.deferred += 1
                continue
            options: dict = {"max_new_tokens": alert.cfg.max_new_tokens}
            if self.tier is not None:
                options["tier"] = self.tier
            if self.route is not None:
                options["route"] = self.route()
            if alert.in_flight >= ALERT_INFLIGHT or not self._take_place():
                self._skipped(alert)
                continue
            question = Request(frame.image, alert.cfg.prompt, options, tag=frame)
            if leader is not None:
                leader.followers.append(question)  # refused with it, its future is cancelled
                future = question.future
            else:
                try:
                    future = self.pipeline.submit(question, block=False)
                except Overloaded:  # not expected (its places are reserved); closing: asked no more
                    self._give_place()
                    self._skipped(alert)
                    continue
            with self._lock:
                alert.in_flight += 1
                self._unanswered += 1
                alert.figures.asked += 1
            before, alert.asked = alert.asked, count
            future.add_done_callback(partial(self._answered, alert, frame.index, count, before))

    def _skipped(self, alert: Alert) -> None:
        with self._lock:  # the decode thread counts overtaken answers here too
            alert.figures.skipped += 1

    def _take_place(self) -> bool:
        if not self.places.acquire(blocking=False):
            return False
        if self.pool is not None and not self.pool.acquire(blocking=False):
            self.places.release()
            return False
        return True

    def _give_place(self) -> None:
        if self.pool is not None:
            self.pool.release()
        self.places.release()

    # -- the pipeline's decode thread --

    def _answered(self, alert: Alert, frame: int, seq: int, asked_before: int | None, future: Future) -> None:
        """`frame`: the source's frame number (restarts with the source); `seq`: the stream's count;
        `asked_before`: when the alert was asked before this question (restored if it never was)."""
        self._give_place()
        try:
            self._read(alert, frame, seq, asked_before, future)
        finally:
            with self._settled:
                self._unanswered -= 1
                self._settled.notify_all()

    def _read(self, alert: Alert, frame: int, seq: int, asked_before: int | None, future: Future) -> None:
        if future.cancelled():  # the frame it rode with was refused: never asked, so due on the next frame
            with self._lock:
                alert.in_flight -= 1
                alert.figures.asked -= 1
                alert.figures.skipped += 1
                if alert.asked == seq:
                    alert.asked = asked_before
            return
        try:
            reading = alert.rule.read(future.result().text)
            failed = False
        except Exception:  # the question failed (the error is the pipeline's to log): not readable
            reading, failed = "unknown", True
        with self._lock:
            alert.in_flight -= 1
            if seq <= alert.read_seq:  # overtaken by a later frame's answer: that one is newer news
                alert.figures.skipped += 1
                return
            alert.read_seq = seq
            alert.figures.errors += failed
            alert.figures.readings[reading] += 1
            if not alert.debounce.observe(reading):
                return
            now = time.time()
            alert.since_frame, alert.since_time = frame, now
            alert.figures.transitions[reading] += 1
        event = {"stream": self.stream_id, "alert": alert.name, "state": reading, "frame": frame,
                 "time": round(now, 3)}
        self.publish(event)
        if alert.webhook is not None:
            alert.webhook.send(event)

    # -- the event loop --

    def states(self) -> list[dict]:
        """GET /v1/alerts' rows for this stream."""
        with self._lock:
            return [{"stream": self.stream_id, "alert": a.name, "state": a.debounce.state,
                     "since_frame": a.since_frame, "since_time": None if a.since_time is None else round(a.since_time, 3),
                     "prompt": a.cfg.prompt, **self._rate(a)} for a in self.alerts]

    def _rate(self, alert: Alert) -> dict:
        """How often the alert was really asked: its questions, how many due ones were
        deferred (the stream behind) or skipped, and one question per how many of the
        stream's frames, on average (null before the first)."""
        figures = alert.figures
        return {"evaluations": figures.asked, "deferred": figures.deferred, "skipped": figures.skipped,
                "evaluated_every": round(self.processed / figures.asked, 2) if figures.asked else None}

    def deferred(self) -> int:
        """Due questions of all this stream's alerts deferred because the stream was behind."""
        with self._lock:
            return sum(a.figures.deferred for a in self.alerts)

    def settle(self, timeout_s: float = SETTLE_S) -> bool:
        """Wait (at most `timeout_s`) until every question asked has been answered and its
        event published: a stream that ends calls this before its end, so that listeners
        get its last alert events. False if some were still unanswered."""
        with self._settled:
            return self._settled.wait_for(lambda: self._unanswered == 0, timeout_s)

    def close(self) -> None:
        """The stream is gone: its webhooks deliver what they hold, then stop."""
        for sender in self.senders.values():
            sender.close()
