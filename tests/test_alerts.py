"""Alerts (edgemm/streams/alerts/): rules read answers, debounce turns readings into states, the
state changes reach SSE listeners, GET /v1/alerts, /metrics and webhooks, and nothing a
slow or hanging webhook does slows the stream.

The rules and the debounce run on scripted answers (a pipeline whose futures the test
completes); the rest against a real daemon on a temporary socket (test_server's) with
`synthetic://` streams and the built-in model, and webhooks against real local HTTP
servers (http.server on a thread, and a socket that accepts and never answers).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest
from test_server import assert_error, metric, raw_client, running, sock_path, wait_until

import edgemm.net.outbound
import edgemm.streams.alerts.schedule
import edgemm.streams.alerts.webhook
from edgemm.streams.alerts.rules import Rule
from edgemm.streams.alerts.schedule import ALERT_SHARE, Debounce, StreamAlerts
from edgemm.streams.alerts.webhook import WebhookSender
from edgemm.config import AlertConfig, WebhookConfig, config_from_dict, load_config
from edgemm.server.daemon import Daemon
from edgemm.errors import ConfigError, InputError
from edgemm.util.errors import CredentialsError
from edgemm.streams.sources.base import Frame, Source
from edgemm.streams.run import StreamOptions, run_stream

WAIT_S = 30  # upper bound for anything that should happen "now"; never a timing assumption
COUNT = "how many shapes are there ?"
COLOUR = "what color is the circle ?"
TOKEN = "s3cret-hook-token"


# ---- rules -------------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, reading", [
    ("yes", "true"), ("Yes, there is a person.", "true"), ("YES", "true"), ("no", "false"), ("No.", "false"),
    ("nope", "unknown"), ("there is no person", "unknown"), ("", "unknown"), ("  ?! ", "unknown"),
])
def test_a_yes_no_alert_reads_the_first_word_case_insensitively(answer, reading):
    assert Rule.of(AlertConfig(prompt="is there a person ?")).read(answer) == reading


@pytest.mark.parametrize("match, answer, reading", [
    ("red", "red", "true"), ("red", "The circle is RED.", "true"), ("red", "blue", "false"),
    ("red", "reddish", "false"), ("red circle", "a red circle and a blue square", "true"),
    ("red circle", "a circle , red", "false"), ("red", "", "unknown"),
])
def test_a_match_alert_looks_for_its_words_in_order(match, answer, reading):
    assert Rule.of(AlertConfig(prompt=COLOUR, match=match)).read(answer) == reading


@pytest.mark.parametrize("bounds, answer, reading", [
    ({"above": 2}, "three", "true"), ({"above": 2}, "two", "false"), ({"above": 2}, "there are 5 shapes", "true"),
    ({"above": 2}, "no shapes", "false"), ({"above": 2}, "many", "unknown"), ({"below": 2}, "one", "true"),
    ({"above": 1, "below": 4}, "three", "true"), ({"above": 1, "below": 4}, "four", "false"),
    ({"above": 2.5}, "2.7 people", "true"),
])
def test_a_count_alert_compares_the_first_number(bounds, answer, reading):
    assert Rule.of(AlertConfig(prompt=COUNT, **bounds)).read(answer) == reading


def test_debounce_changes_state_only_after_a_run():
    debounce = Debounce(on_after=2, off_after=3)
    readings = ["true", "false", "true", "true", "true", "false", "false", "unknown", "false", "false", "false",
                "unknown", "unknown", "unknown", "true", "true"]
    changes = [(i, r) for i, r in enumerate(readings) if debounce.observe(r)]
    # true after 2 in a row (3), false after 3 (10), unknown after max(2, 3) = 3 unknowns (13), true (15)
    assert changes == [(3, "true"), (10, "false"), (13, "unknown"), (15, "true")]


# ---- a stream's alerts on scripted answers ---------------------------------------------------

class ScriptedPipeline:
    """Takes requests without answering them; the test answers (or fails) each one."""

    def __init__(self):
        self.requests: list = []

    def submit(self, request, block: bool = True, timeout: float | None = None) -> Future:
        self.requests.append(request)
        return request.future

    def answer(self, prompt: str, text: str) -> None:
        request = next(r for r in self.requests if r.prompt == prompt and not r.future.done())
        request.future.set_result(SimpleNamespace(text=text))


def frame(index: int) -> Frame:
    return Frame(index, np.zeros((8, 8, 3), np.uint8), 0.0, "synthetic://")


def scripted(alerts: dict, **kw) -> tuple[StreamAlerts, ScriptedPipeline, list[dict]]:
    pipeline, events = ScriptedPipeline(), []
    cfg = config_from_dict({"streams": [{"id": "cam", "source": "synthetic://", "alerts": alerts}]}).streams[0]
    return StreamAlerts("cam", cfg.alerts, None, pipeline, events.append, **kw), pipeline, events


def test_scripted_answers_make_debounced_events_with_frame_numbers():
    alerts, pipeline, events = scripted({"many": {"prompt": COUNT, "above": 2, "on_after": 2, "off_after": 2}})
    script = ["three", "four", "four", "one", "three", "one", "zero", "lots", "lots"]
    for i, text in enumerate(script):
        alerts.ask(frame(10 + i))
        pipeline.answer(COUNT, text)
    assert [(e["frame"], e["state"]) for e in events] == [(11, "true"), (16, "false"), (18, "unknown")]
    assert all(set(e) == {"stream", "alert", "state", "frame", "time"} and e["stream"] == "cam"
               and e["alert"] == "many" and isinstance(e["time"], float) for e in events)
    figures = alerts.alerts[0].figures
    assert figures.readings == {"true": 4, "false": 3, "unknown": 2}
    assert figures.transitions == {"true": 1, "false": 1, "unknown": 1}
    [row] = alerts.states()
    assert row == {"stream": "cam", "alert": "many", "state": "unknown", "since_frame": 18,
                   "since_time": events[-1]["time"], "prompt": COUNT,
                   "evaluations": 9, "deferred": 0, "skipped": 0, "evaluated_every": 1.0}


def test_settle_waits_for_the_last_answers_so_their_events_come_before_the_streams_end():
    alerts, pipeline, events = scripted({"p": {"prompt": "is there a person ?", "on_after": 1, "off_after": 1}})
    alerts.ask(frame(0))
    assert alerts.settle(0.01) is False  # its answer is still to come
    answering = threading.Timer(0.05, pipeline.answer, ("is there a person ?", "yes"))
    answering.start()
    assert alerts.settle(30) is True
    assert [e["state"] for e in events] == ["true"]  # published before settle returned
    assert alerts.settle(0) is True  # nothing left
    alerts.ask(frame(1))
    pipeline.requests[-1].future.set_exception(RuntimeError("the decoder failed"))
    assert alerts.settle(0) is True  # a failed question is answered too


def test_a_failed_question_reads_unknown_and_is_counted():
    alerts, pipeline, events = scripted({"p": {"prompt": "is there a person ?", "on_after": 1, "off_after": 1}})
    alerts.ask(frame(0))
    pipeline.answer("is there a person ?", "yes")
    alerts.ask(frame(1))
    pipeline.requests[-1].future.set_exception(RuntimeError("the decoder failed"))
    alerts.ask(frame(2))
    pipeline.requests[-1].future.set_exception(RuntimeError("the decoder failed"))
    assert [e["state"] for e in events] == ["true", "unknown"]
    assert alerts.alerts[0].figures.errors == 2 and alerts.alerts[0].figures.readings["unknown"] == 2


def test_every_asks_on_every_nth_frame_and_questions_ask_the_frames_own_image():
    alerts, pipeline, _ = scripted({"p": {"prompt": "is there a person ?", "every": 3}}, tier="low")
    for i in range(7):
        alerts.ask(frame(i))
        if pipeline.requests and not pipeline.requests[-1].future.done():
            pipeline.answer("is there a person ?", "no")
    assert [r.tag.index for r in pipeline.requests] == [0, 3, 6]
    assert all(r.options == {"max_new_tokens": 8, "tier": "low"} for r in pipeline.requests)


def test_alert_questions_are_bounded_and_the_longest_waiting_goes_first():
    names = [f"a{i}" for i in range(ALERT_SHARE + 2)]
    alerts, pipeline, _ = scripted({n: f"is there a {n} ?" for n in names})
    alerts.ask(frame(0))  # nothing is answered: only ALERT_SHARE questions go in
    assert len(pipeline.requests) == ALERT_SHARE
    alerts.ask(frame(1))  # every place is taken: all wait
    assert len(pipeline.requests) == ALERT_SHARE
    assert sum(a.figures.skipped for a in alerts.alerts) == 2 + len(names)
    for request in list(pipeline.requests):
        request.future.set_result(SimpleNamespace(text="no"))
    alerts.ask(frame(2))  # the two never asked go first
    asked = [r.prompt for r in pipeline.requests[ALERT_SHARE:]]
    assert asked[:2] == [f"is there a {n} ?" for n in names[-2:]] and len(asked) == ALERT_SHARE


def test_one_alert_has_at_most_two_questions_in_flight_and_a_stale_answer_is_left_out():
    alerts, pipeline, events = scripted({"p": {"prompt": "is there a person ?", "on_after": 1, "off_after": 1}})
    for i in range(3):
        alerts.ask(frame(i))
    assert [r.tag.index for r in pipeline.requests] == [0, 1]  # frame 2: skipped
    assert alerts.alerts[0].figures.skipped == 1
    pipeline.requests[1].future.set_result(SimpleNamespace(text="yes"))  # frame 1 answered first
    pipeline.requests[0].future.set_result(SimpleNamespace(text="no"))  # older news: left out
    assert [(e["frame"], e["state"]) for e in events] == [(1, "true")]
    assert alerts.alerts[0].figures.skipped == 2 and alerts.alerts[0].figures.readings == {"true": 1}


def test_the_managers_pool_bounds_every_streams_questions_together():
    pool = threading.BoundedSemaphore(1)
    alerts, pipeline, _ = scripted({"a": "is there a cat ?", "b": "is there a dog ?"}, pool=pool)
    alerts.ask(frame(0))
    assert len(pipeline.requests) == 1
    pipeline.requests[0].future.set_result(SimpleNamespace(text="no"))
    assert pool.acquire(blocking=False)  # given back once answered


def test_questions_ride_with_the_frames_own_request_and_a_refused_frame_gives_their_places_back():
    from edgemm.engine.pipeline import Request
    alerts, pipeline, _ = scripted({"a": "is there a cat ?", "b": "is there a dog ?"})
    first = frame(0)
    leader = Request(first.image, "describe", {}, tag=first)
    alerts.ask(first, leader=leader)
    assert not pipeline.requests  # nothing submitted on its own
    assert [q.prompt for q in leader.followers] == ["is there a cat ?", "is there a dog ?"]
    assert all(q.tag.index == 0 and q.image is leader.image for q in leader.followers)
    for question in leader.followers:  # the pipeline refused the frame (Pipeline.submit cancels them)
        question.future.cancel()
    assert alerts.places.acquire(blocking=False) and alerts.settle(0)  # every place given back
    assert [(a.figures.asked, a.figures.skipped, a.in_flight) for a in alerts.alerts] == [(0, 1, 0), (0, 1, 0)]
    assert all(a.figures.readings == {} for a in alerts.alerts)  # never read as unknown


def test_an_alert_whose_frame_was_refused_is_asked_on_the_next_frame_not_every_frames_later():
    from edgemm.engine.pipeline import Request
    alerts, _, _ = scripted({"a": {"prompt": "is there a cat ?", "every": 3}})
    frames = [frame(i) for i in range(3)]
    leaders = [Request(f.image, "describe", {}, tag=f) for f in frames]
    alerts.ask(frames[0], leader=leaders[0])
    leaders[0].followers[0].future.set_result(SimpleNamespace(text="no"))
    alerts.ask(frames[1], leader=leaders[1])  # not due (every 3)
    alerts.ask(frames[2], leader=leaders[2])  # not due
    next_frame = frame(3)
    refused = Request(next_frame.image, "describe", {}, tag=next_frame)
    alerts.ask(next_frame, leader=refused)  # due: asked, then its frame is refused
    refused.followers[0].future.cancel()
    again = frame(4)
    leader = Request(again.image, "describe", {}, tag=again)
    alerts.ask(again, leader=leader)
    assert [q.prompt for q in leader.followers] == ["is there a cat ?"]  # due still, not 3 frames on


# ---- spare capacity: the stream's own answers first ---------------------------------------------

def test_an_alert_is_deferred_while_the_stream_is_behind_but_asked_at_least_every_max_every_frames():
    alerts, pipeline, _ = scripted({"a": {"prompt": "is there a cat ?", "max_every": 4},
                                    "b": {"prompt": "is there a dog ?", "every": 3, "max_every": 4},
                                    "c": {"prompt": "is there a cow ?", "every": 6, "max_every": 4},
                                    "d": {"prompt": "is there a pig ?", "max_every": 1}})
    # frames 10-13 found a place free: the stream keeps up again from the third of them (SPARE_AFTER)
    behind = [False] + [True] * 9 + [False] * 4 + [True] * 2
    for i, late in enumerate(behind):
        alerts.ask(frame(i), behind=late)
        for request in pipeline.requests:
            if not request.future.done():
                request.future.set_result(SimpleNamespace(text="no"))
    asked = {p: [r.tag.index for r in pipeline.requests if r.prompt == p] for p in {r.prompt for r in pipeline.requests}}
    assert edgemm.streams.alerts.schedule.SPARE_AFTER == 3
    assert asked["is there a cat ?"] == [0, 4, 8, 12, 13]  # the floor while behind, every frame once keeping up
    assert asked["is there a dog ?"] == [0, 4, 8, 12]  # due every 3rd frame: deferred to the floor, 4
    assert asked["is there a cow ?"] == [0, 6, 12]  # `every` above max_every: `every` is its floor
    assert asked["is there a pig ?"] == list(range(len(behind)))  # max_every 1: never deferred
    by_name = {a.name: a.figures for a in alerts.alerts}
    assert [by_name[n].deferred for n in "abcd"] == [11, 4, 0, 0]
    assert [by_name[n].asked for n in "abcd"] == [5, 4, 3, 16]
    rows = {r["alert"]: r for r in alerts.states()}
    assert (rows["a"]["evaluations"], rows["a"]["deferred"], rows["a"]["evaluated_every"]) == (5, 11, 3.2)
    assert alerts.deferred() == 15


class AnsweringPipeline:
    """Takes requests and answers them: the alerts' questions (which ride with the stream's
    frames, Request.followers) at once, the stream's own when the test says (`answer_oldest`),
    or all at once from a thread when `answer_all`."""

    def __init__(self, answer_all: bool = False):
        self.requests: list = []
        self.answer_all = answer_all
        self.lock = threading.Lock()

    def submit(self, request, block: bool = True, timeout: float | None = None) -> Future:
        with self.lock:
            self.requests += [request, *request.followers]
        for asked in (request, *request.followers):
            if self.answer_all or asked.prompt != "describe":
                threading.Thread(target=asked.future.set_result, args=(SimpleNamespace(
                    text="no", tier="low", timings_ms={"total": 1.0}),), daemon=True).start()
        return request.future

    def own(self) -> list:
        with self.lock:
            return [r for r in self.requests if r.prompt == "describe"]

    def answer_oldest(self) -> None:
        next(r for r in self.own() if not r.future.done()).future.set_result(
            SimpleNamespace(text="a scene", tier="low", timings_ms={"total": 1.0}))

    @property
    def stats(self):  # what run_stream reads at its end
        return SimpleNamespace(busy_s={}, items={})


class WatchedPool:
    """The daemon's pool of stream places, telling the test each time a stream waits for one."""

    def __init__(self, size: int):
        self.places = threading.Semaphore(size)
        self.waiting = threading.Semaphore(0)

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        if self.places.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self.waiting.release()
        return self.places.acquire(timeout=timeout)

    def release(self) -> None:
        self.places.release()


class CountedFrames(Source):
    """`count` frames, each read at once (a file, or an unpaced synthetic source)."""

    def __init__(self, count: int):
        super().__init__("fake://frames", live=False)
        self.count = count

    def _next_frame(self):
        return None if self._next_index >= self.count else self._frame(np.zeros((8, 8, 3), np.uint8))


def run(source, options, pipeline) -> tuple[list[dict], threading.Thread]:
    records: list[dict] = []
    thread = threading.Thread(target=run_stream, args=(pipeline, source, options, records.append), daemon=True)
    thread.start()
    return records, thread


def test_a_saturated_stream_answers_every_frame_and_asks_its_alerts_only_at_the_floor():
    """By counts, not timings: a stream whose source is always ahead (every frame waits for the
    pipeline to answer the one before) submits each of its frames once, and its 3 alerts add one
    question each per max_every frames, not 3 per frame."""
    frames, max_every = 60, 10
    pipeline, pool = AnsweringPipeline(), WatchedPool(1)
    alerts = StreamAlerts("cam", config_from_dict({"streams": [{"id": "cam", "source": "synthetic://", "alerts": {
        n: {"prompt": f"is there a {n} ?", "max_every": max_every} for n in ("cat", "dog", "cow")}}]}).streams[0].alerts,
        None, pipeline, lambda event: None)
    options = StreamOptions("describe", pool=pool, also_ask=alerts.ask)
    records, thread = run(CountedFrames(frames), options, pipeline)
    for _ in range(frames - 1):  # frame n+1 waits for a place until frame n is answered: always behind
        assert pool.waiting.acquire(timeout=WAIT_S), "the stream did not wait for a place"
        pipeline.answer_oldest()
    wait_until(lambda: len(pipeline.own()) == frames, what="the last frame submitted")
    pipeline.answer_oldest()
    thread.join(WAIT_S)
    assert [r["frame"] for r in records] == list(range(frames))  # every frame answered, in order
    assert len(pipeline.own()) == frames
    for alert in alerts.alerts:  # asked on its first frame (not behind yet), then on the floor only
        assert [r.tag.index for r in pipeline.requests if r.prompt == alert.cfg.prompt] == \
            list(range(0, frames, max_every))
        assert alert.figures.deferred == frames - frames // max_every
    assert len(pipeline.requests) - frames == 3 * frames // max_every  # 0.3 questions per frame, not 3


class CameraOnCue(Source):
    """A camera whose next frame comes when the test releases `cue`."""

    def __init__(self, count: int):
        super().__init__("fake://camera", live=True)
        self.count = count
        self.cue = threading.Semaphore(0)

    def _next_frame(self):
        assert self.cue.acquire(timeout=WAIT_S), "the test gave no cue"
        return None if self._next_index >= self.count else self._frame(np.zeros((8, 8, 3), np.uint8))


def test_a_live_stream_whose_frames_wait_for_a_place_is_behind_and_defers_its_alerts():
    """A camera frame captured while the stream waits for a place (the pipeline has not
    answered the frame before) is one the stream is behind on: its alerts wait for the floor."""
    frames, max_every = 25, 5
    pipeline, pool, source = AnsweringPipeline(), WatchedPool(1), CameraOnCue(frames)
    alerts = StreamAlerts("cam", config_from_dict({"streams": [{"id": "cam", "source": "synthetic://", "alerts": {
        "cat": {"prompt": "is there a cat ?", "max_every": max_every}}}]}).streams[0].alerts,
        None, pipeline, lambda event: None)
    records, thread = run(source, StreamOptions("describe", pool=pool, also_ask=alerts.ask), pipeline)
    source.cue.release()  # frame 0: the stream has a place waiting for it
    for n in range(1, frames + 1):
        assert pool.waiting.acquire(timeout=WAIT_S), "the stream did not wait for a place"
        source.cue.release()  # frame n (or the end) comes while the stream waits
        wait_until(lambda: source.stats.frames == min(n + 1, frames),
                   what="the camera's frame")
        pipeline.answer_oldest()
    thread.join(WAIT_S)
    assert not thread.is_alive() and [r["frame"] for r in records] == list(range(frames))
    assert [r.tag.index for r in pipeline.requests if r.prompt == "is there a cat ?"] == list(range(0, frames, max_every))
    assert alerts.alerts[0].figures.deferred == frames - frames // max_every


class CameraPacedByAnswers(Source):
    """A camera slower than the stream: each frame comes only once the one before was answered."""

    def __init__(self, count: int):
        super().__init__("fake://camera", live=True)
        self.count = count
        self.answered = threading.Semaphore(0)  # released by the test's emit

    def _next_frame(self):
        if self._next_index > 0:
            assert self.answered.acquire(timeout=WAIT_S), "the stream stopped answering"
        return None if self._next_index >= self.count else self._frame(np.zeros((8, 8, 3), np.uint8))


def test_a_stream_with_spare_capacity_asks_every_alert_on_every_frame_it_is_due():
    frames = 30
    pipeline, source = AnsweringPipeline(answer_all=True), CameraPacedByAnswers(frames)
    alerts = StreamAlerts("cam", config_from_dict({"streams": [{"id": "cam", "source": "synthetic://", "alerts": {
        "cat": "is there a cat ?", "dog": {"prompt": "is there a dog ?", "every": 3}}}]}).streams[0].alerts,
        None, pipeline, lambda event: None)
    records: list[dict] = []

    def emit(record: dict) -> None:
        records.append(record)
        source.answered.release()
    options = StreamOptions("describe", pool=WatchedPool(2), also_ask=alerts.ask)
    thread = threading.Thread(target=run_stream, args=(pipeline, source, options, emit), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert [r["frame"] for r in records] == list(range(frames)) and records[0]["dropped"] == 0
    asked = lambda prompt: [r.tag.index for r in pipeline.requests if r.prompt == prompt]  # noqa: E731
    assert asked("is there a cat ?") == list(range(frames))
    assert asked("is there a dog ?") == list(range(0, frames, 3))
    assert [a.figures.deferred for a in alerts.alerts] == [0, 0]


def test_synthetic_hold_keeps_each_scene_for_n_frames_with_fresh_noise():
    from edgemm.streams.sources import open_source
    with open_source("synthetic://?hold=3&seed=5&count=7") as source:
        frames = list(source)
    truths = [f.truth for f in frames]
    assert len(frames) == 7
    assert truths[0] is truths[1] is truths[2] and truths[3] is truths[5] and truths[6] is not truths[5]
    assert truths[0].describe() != truths[3].describe()
    assert not np.array_equal(frames[0].image, frames[1].image)  # the same scene, not the same pixels
    assert np.abs(frames[0].image.astype(int) - frames[1].image).max() <= 2 * 3


# ---- the config's rules --------------------------------------------------------------------------

@pytest.mark.parametrize("alerts, message", [
    ({"p": 3}, "'streams[0].alerts.p' must be a string (its prompt) or a mapping, got 3 (int)"),
    ({"p": {"prompt": "x", "match": "red", "above": 1}},
     "'streams[0].alerts.p.match' must not be given with above/below (one rule per alert), got 'red'"),
    ({"p": {"prompt": "x", "above": 3, "below": 1}}, "'streams[0].alerts.p.below' must be above 'above' (3), got 1.0"),
    ({"p": {"prompt": "x", "on_after": 0}}, "'streams[0].alerts.p.on_after' must be in 1..1000, got 0"),
    ({"p": {"prompt": ""}}, "'streams[0].alerts.p.prompt' must be a question, got ''"),
    ({"p": {"prompt": "x", "mach": "red"}}, "unknown key 'streams[0].alerts.p.mach' (known: above, below, every, "
                                            "match, max_every, max_new_tokens, off_after, on_after, prompt, webhook)"),
    ({"a b": "x"}, "'streams[0].alerts' must have names of letters, digits, '_', '.', '-' (at most 64), got 'a b'"),
    ({f"a{i}": "x" for i in range(9)}, "'streams[0].alerts' must have at most 8 alerts, got 9"),
    ({"p": {"prompt": "x", "webhook": {"url": 'ftp://x'}}},
     "'streams[0].alerts.p.webhook.url' must be an http:// or https:// URL with a host name and no spaces, "
     "got 'ftp://x'"),
    ({"p": {"prompt": "x", "webhook": {"url": 'http://'}}},
     "'streams[0].alerts.p.webhook.url' must be an http:// or https:// URL with a host name and no spaces, "
     "got 'http://'"),
    ({"p": {"prompt": "x", "webhook": {"url": 'http:///x'}}},
     "'streams[0].alerts.p.webhook.url' must be an http:// or https:// URL with a host name and no spaces, "
     "got 'http:///x'"),
    ({"p": {"prompt": "x", "webhook": {"url": 'https://a b/'}}},
     "'streams[0].alerts.p.webhook.url' must be an http:// or https:// URL with a host name and no spaces, "
     "got 'https://a b/'"),
    ({"p": {"prompt": "x", "webhook": {"url": 'http://h\tx/'}}},
     "'streams[0].alerts.p.webhook.url' must be an http:// or https:// URL with a host name and no spaces, "
     "got 'http://h\\tx/'"),
    ({"p": {"prompt": "x", "webhook": {"url": 'http://h:99999/'}}},
     "'streams[0].alerts.p.webhook.url' must be an http:// or https:// URL with a host name and no spaces, "
     "got 'http://h:99999/'"),
    ({"p": {"prompt": "x", "max_every": 0}}, "'streams[0].alerts.p.max_every' must be in 1..1000, got 0"),
    ({"p": {"prompt": "x", "webhook": {"url": "http://x", "token_env": "A", "token_file": "f"}}},
     "'streams[0].alerts.p.webhook.token_file' must not be given with token_env (one token), got 'f'"),
    ({"p": {"prompt": "x", "webhook": {"url": "http://x", "timeout_s": 61}}},
     "'streams[0].alerts.p.webhook.timeout_s' must be in (0, 60], got 61.0"),
])
def test_bad_alerts_are_one_line_config_errors(alerts, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"streams": [{"id": "cam", "source": "synthetic://", "alerts": alerts}]})
    assert str(info.value) == f"config: {message}"


def test_a_webhook_token_variable_that_is_not_set_fails_the_start(runtime, tmp_path):
    cfg = load_config({"server": {"socket": str(tmp_path / "edgemm.sock")},
                       "streams": [{"id": "door", "source": "synthetic://", "alerts": {"p": "is there a person ?"},
                                    "webhook": {"url": "http://127.0.0.1:1/", "token_env": "EDGEMM_NO_SUCH_TOKEN"}}]})
    with pytest.raises(InputError) as info:
        Daemon(cfg, runtime=runtime).run()
    assert str(info.value) == ("config: streams[0] (door): webhook.token_env: the environment variable "
                               "EDGEMM_NO_SUCH_TOKEN is not set")
    assert not (tmp_path / "edgemm.sock").exists()


def test_the_api_checks_alerts_and_never_lets_a_client_name_a_token(runtime):
    body = {"id": "cam", "source": "synthetic://?fps=5", "prompt": COUNT, "alerts": {"p": {"prompt": "x", "every": 0}}}
    with running(runtime) as d, raw_client(sock_path(d)) as http:
        error = assert_error(http.post("/v1/streams", json=body), 400, param="alerts.p.every")
        assert error["message"] == "'alerts.p.every' must be in 1..1000, got 0"
        body["alerts"] = {"p": "is there a person ?"}
        body["webhook"] = {"url": "http://127.0.0.1:1/", "timeout_s": 300}  # an ended stream's drain is bounded by it
        error = assert_error(http.post("/v1/streams", json=body), 400, param="webhook.timeout_s")
        assert error["message"] == "'webhook.timeout_s' must be in (0, 60], got 300.0"
        body["webhook"] = {"url": "http://127.0.0.1:1/", "token_env": "HOME"}
        error = assert_error(http.post("/v1/streams", json=body), 403)
        assert "token_env or token_file can only be configured in the config file" in error["message"]
        body["alerts"] = {"p": "x" * 4001}
        del body["webhook"]
        error = assert_error(http.post("/v1/streams", json=body), 400, param="alerts.p.prompt")
        assert "above the 4000 limit" in error["message"]
        assert http.get("/v1/streams").json()["data"] == []


def test_a_prompt_the_model_refuses_is_a_400_naming_its_field_before_the_stream_starts(runtime):
    """The image token in a stream's, an alert's or a PATCHed prompt would fail every frame (the
    family refuses to build such a prompt): refused once, with the field, and nothing starts."""
    token = runtime.manifest.image_token
    refused = f"the prompt must not contain the image token {token}"
    body = {"id": "cam", "source": "synthetic://?fps=5", "prompt": f"what color is the {token} ?"}
    with running(runtime) as d, raw_client(sock_path(d)) as http:
        error = assert_error(http.post("/v1/streams", json=body), 400, param="prompt")
        assert error["message"] == f"'prompt': {refused}"
        body = {**body, "prompt": COUNT, "alerts": {"a": f"is there a {token} ?"}}
        error = assert_error(http.post("/v1/streams", json=body), 400, param="alerts.a.prompt")
        assert error["message"] == f"'alerts.a.prompt': {refused}"
        assert http.get("/v1/streams").json()["data"] == []
        del body["alerts"]
        assert http.post("/v1/streams", json=body).status_code == 201
        error = assert_error(http.patch("/v1/streams/cam", json={"prompt": f"how many {token} ?"}), 400, param="prompt")
        assert error["message"] == f"'prompt': {refused}"
        assert http.get("/v1/streams/cam").json()["prompt"] == COUNT


def test_a_configured_prompt_the_model_refuses_fails_the_start_in_one_line(runtime, tmp_path):
    token = runtime.manifest.image_token
    cfg = load_config({"server": {"socket": str(tmp_path / "edgemm.sock")},
                       "streams": [{"id": "door", "source": "synthetic://", "alerts": {"p": f"a {token} ?"}}]})
    daemon = Daemon(cfg, runtime=runtime)
    started = threading.Timer(30, daemon.stop)  # without the check the daemon runs: stopped, the test fails
    started.start()
    try:
        with pytest.raises(InputError) as info:
            daemon.run()
    finally:
        started.cancel()
    assert str(info.value) == (f"config: streams[0] (door): 'alerts.p.prompt': the prompt must not contain "
                               f"the image token {token}")
    assert not (tmp_path / "edgemm.sock").exists()


# ---- a real daemon ---------------------------------------------------------------------------------

def sse(path: str, stream_id: str) -> list[tuple[str | None, dict]]:
    """Every event of /v1/streams/{id}/events until the stream ends: (its SSE event name, data)."""
    events, name = [], None
    with raw_client(path, timeout=60) as http, http.stream("GET", f"/v1/streams/{stream_id}/events") as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                name = None
    return events


def counting_stream(stream_id: str, frames: int, max_every: int = 1, **extra) -> dict:
    """A finite synthetic stream (read losslessly, so always behind its source) that asks the
    count and, as alerts, the count above 2 and the circle's colour, each changing state on
    every new reading; with max_every 1 the alerts are asked on every frame all the same."""
    return {"id": stream_id, "source": f"synthetic://?count={frames}&seed=3", "prompt": COUNT,
            "tier": "low",
            "max_new_tokens": 2,
            "alerts": {"many": {"prompt": COUNT, "above": 2, "on_after": 1, "off_after": 1, "max_every": max_every},
                       "red": {"prompt": COLOUR, "match": "red", "on_after": 1, "off_after": 1,
                               "max_every": max_every}}, **extra}


def settled(http, stream_id: str, alerts=("many", "red")) -> bool:
    """The stream ended and each of its frames' questions was answered (or its skip or
    deferral counted)."""
    figures = http.get(f"/v1/streams/{stream_id}").json()
    text = http.get("/metrics").text
    return figures["state"] == "ended" and all(
        figures["frames"] == metric(text, f'edgemm_alert_skipped_total{{stream="{stream_id}",alert="{a}"}}')
        + metric(text, f'edgemm_alert_deferred_total{{stream="{stream_id}",alert="{a}"}}')
        + sum(metric(text, f'edgemm_alert_answers_total{{stream="{stream_id}",alert="{a}",reading="{r}"}}', 0)
              for r in ("true", "false", "unknown")) for a in alerts)


def test_a_daemon_stream_sends_alert_events_lists_states_and_counts_them(runtime):
    # 60 frames, each 3 answers: seconds, so the listener connects long before the stream ends
    with running(runtime, {"streams": [counting_stream("shapes", 60)]}) as d, \
            raw_client(sock_path(d)) as http:
        events = sse(sock_path(d), "shapes")  # the stream may have started first: listen, then compare
        wait_until(lambda: settled(http, "shapes"), what="every question answered")
        figures = http.get("/v1/streams/shapes").json()
        alerts = http.get("/v1/alerts").json()
        text = http.get("/metrics").text
        stats = d.service.pipeline.stats
    # the questions rode with their frames: each frame decoded, scheduled and encoded once for all
    assert stats.items["prepare"] == stats.items["encode"] == 60
    assert stats.completed == 60 + sum(row["evaluations"] for row in alerts["data"])
    results = {e["frame"]: e for name, e in events if name is None}
    alert_events = [e for name, e in events if name == "alert"]
    assert figures["state"] == "ended" and figures["frames"] == 60
    assert alert_events, "no alert changed state in 40 scenes"
    assert all(set(e) == {"stream", "alert", "state", "frame", "time"} and e["stream"] == "shapes"
               for e in alert_events)
    # the alert asks what the stream asks, about the same frame: its reading is the stream's answer read
    # by the rule (the stream's first events may be missed if it answered before we listened)
    many = Rule.of(AlertConfig(prompt=COUNT, above=2))
    checked = [e for e in alert_events if e["alert"] == "many" and e["frame"] in results]
    assert checked and all(many.read(results[e["frame"]]["answer"]) == e["state"] for e in checked)
    for name in ("many", "red"):
        mine = [e for e in alert_events if e["alert"] == name]
        assert [e["frame"] for e in mine] == sorted({e["frame"] for e in mine})  # in frame order, once each
        states = [e["state"] for e in mine]
        assert all(a != b for a, b in zip(states, states[1:]))  # each event is a change
        transitions = sum(metric(text, f'edgemm_alert_transitions_total{{stream="shapes",alert="{name}",state="{s}"}}',
                                 0) for s in ("true", "false", "unknown"))
        assert transitions >= len(mine)
    assert {r["alert"]: r for r in alerts["data"]}.keys() == {"many", "red"}
    assert alerts["object"] == "list"
    for row in alerts["data"]:
        assert set(row) == {"stream", "alert", "state", "since_frame", "since_time", "prompt",
                            "evaluations", "deferred", "skipped", "evaluated_every"}
        assert row["deferred"] == 0 and row["evaluations"] >= 1  # max_every 1: never deferred
        last = [e for e in alert_events if e["alert"] == row["alert"]][-1]
        assert (row["state"], row["since_frame"], row["since_time"]) == (last["state"], last["frame"], last["time"])
    assert metric(text, 'edgemm_alert_events_dropped_total{stream="shapes",sink="listener"}') == 0


def test_a_daemon_stream_behind_its_source_defers_its_alerts_and_says_how_often_they_were_asked(runtime):
    """An unpaced synthetic source is read as fast as the stream answers: the stream is behind,
    so its alerts are asked at the max_every floor, and the status, /v1/alerts and /metrics say
    how many were deferred."""
    frames, max_every = 40, 10
    with running(runtime, {"streams": [counting_stream("busy", frames, max_every=max_every)]}) as d, \
            raw_client(sock_path(d)) as http:
        wait_until(lambda: settled(http, "busy"), what="every frame answered, deferred or skipped")
        figures = http.get("/v1/streams/busy").json()
        rows = {r["alert"]: r for r in http.get("/v1/alerts").json()["data"]}
        text = http.get("/metrics").text
    assert figures["frames"] == frames
    assert figures["alerts_deferred"] == sum(r["deferred"] for r in rows.values()) > 0
    for name, row in rows.items():
        assert row["deferred"] == metric(text, f'edgemm_alert_deferred_total{{stream="busy",alert="{name}"}}')
        assert row["evaluations"] == metric(text, f'edgemm_alert_evaluations_total{{stream="busy",alert="{name}"}}')
        assert frames // max_every <= row["evaluations"] < frames  # the floor, at least; not every frame
        assert row["evaluations"] + row["deferred"] <= frames  # a frame's question is asked or deferred, once
        assert row["evaluated_every"] == round(frames / row["evaluations"], 2)


# ---- webhooks ------------------------------------------------------------------------------------

class Hook:
    """A real HTTP server taking POSTed events; answers each with the next status of `script`
    (the last one repeats)."""

    def __init__(self, script: list[int] | None = None, host: str = "127.0.0.1"):
        self.script, self.received = list(script or [200]), []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                hook.received.append((dict(self.headers), body))
                status = hook.script.pop(0) if len(hook.script) > 1 else hook.script[0]
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self.server = Server((host, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/edgemm"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook() -> Iterator[Hook]:
    server = Hook()
    yield server
    server.close()


@contextlib.contextmanager
def hanging() -> Iterator[str]:
    """A URL whose server takes the connection and the request and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)  # never accepted: the kernel completes the handshake, nobody replies
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/"
    finally:
        listener.close()


EVENT = {"stream": "cam", "alert": "p", "state": "true", "frame": 7, "time": 1.5}


def test_a_webhook_retries_5xx_and_429_with_backoff_then_delivers(hook, caplog):
    hook.script = [503, 429, 500, 200]
    cfg = WebhookConfig(url=hook.url, token_env="EDGEMM_HOOK_TOKEN", timeout_s=5, retries=3, backoff_s=0.01)
    with caplog.at_level(logging.INFO, "edgemm"):
        sender = WebhookSender(cfg, "streams (cam).webhook", environ={"EDGEMM_HOOK_TOKEN": TOKEN})
        sender.send(EVENT)
        wait_until(lambda: sender.figures.delivered == 1, what="the event to be delivered")
        sender.close()
    assert [body for _, body in hook.received] == [EVENT] * 4
    assert all(headers["Authorization"] == f"Bearer {TOKEN}" for headers, _ in hook.received)
    assert (sender.figures.retries, sender.figures.failed, sender.figures.dropped) == (3, 0, 0)
    assert TOKEN not in caplog.text and TOKEN not in repr(sender)


def test_a_webhook_gives_up_after_its_retries_and_does_not_retry_a_4xx(hook, caplog):
    hook.script = [500]
    sender = WebhookSender(WebhookConfig(url=hook.url, retries=2, backoff_s=0.01), "w")
    with caplog.at_level(logging.WARNING, "edgemm"):
        sender.send(EVENT)
        sender.send(EVENT)
        wait_until(lambda: sender.figures.failed == 2, what="both events to fail")
    assert len(hook.received) == 6 and sender.figures.retries == 4
    assert sender.figures.last_error == "127.0.0.1 answered HTTP 500"
    assert caplog.text.count("was not delivered") == 1  # once while it keeps failing, not per event
    hook.script = [404]
    sender.send(EVENT)
    wait_until(lambda: sender.figures.failed == 3, what="the refused event")
    sender.close()
    assert len(hook.received) == 7  # a 404 is final


def test_a_webhook_token_file_must_be_the_owners_only(tmp_path, hook):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o644)
    with pytest.raises(CredentialsError) as info:
        WebhookSender(WebhookConfig(url=hook.url, token_file=str(token)), "streams (cam).webhook")
    assert str(info.value) == (f"streams (cam).webhook.token_file: refusing {token}: mode 0644 lets group or "
                               f"others access it (chmod 600 {token})")
    token.chmod(0o600)
    sender = WebhookSender(WebhookConfig(url=hook.url, token_file=str(token)), "w")
    sender.send(EVENT)
    wait_until(lambda: sender.figures.delivered == 1, what="delivery")
    sender.close()
    assert hook.received[0][0]["Authorization"] == f"Bearer {TOKEN}"


def test_a_hanging_webhook_drops_its_oldest_events_and_never_waits():
    with hanging() as url:
        sender = WebhookSender(WebhookConfig(url=url, timeout_s=30, retries=0), "w", queue_size=3)
        sender.send({**EVENT, "frame": 0})
        wait_until(lambda: sender.queued() == 0, what="the first event to be sent (it hangs)")
        for i in range(1, 10):  # the queue keeps the newest 3
            sender.send({**EVENT, "frame": i})
        wait_until(lambda: sender.queued() == 3 and sender.figures.dropped == 6, what="the queue to drop")
        assert [e["frame"] for e in sender._queue] == [7, 8, 9]
        assert sender.figures.delivered == 0
        sender.close()
        sender.send(EVENT)  # after close: dropped, counted
        assert sender.figures.dropped == 7


class Replying:
    """A real socket server that reads each request and answers with `reply(conn)` (bytes it
    writes itself); `sent` counts what it wrote, `cut` is set when the client hung up first."""

    def __init__(self, reply):
        self.sent, self.cut, self.requests = 0, threading.Event(), 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/"
        self.reply = reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            head, body = request.split(b"\r\n\r\n", 1)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += conn.recv(65536)
            self.requests += 1
            try:
                for piece in self.reply():
                    conn.sendall(piece)
                    self.sent += len(piece)
            except OSError:  # reset or broken pipe: the client closed the connection
                self.cut.set()

    def close(self) -> None:
        self.listener.close()


def test_a_webhook_reads_a_few_kb_of_a_huge_reply_then_closes_the_connection():
    """The reply's status is what counts: of an endless body, the sender reads REPLY_BYTES at
    most and hangs up, so the server's writes fail (its kernel buffers aside, nothing more is read)."""
    def endless():
        yield b"HTTP/1.1 200 OK\r\nContent-Length: 400000000000\r\n\r\n"
        while True:
            yield b"x" * 65536
    server = Replying(endless)
    try:
        sender = WebhookSender(WebhookConfig(url=server.url, timeout_s=30, retries=0), "w")
        sender.send(EVENT)
        wait_until(lambda: sender.figures.delivered == 1, what="the event to be delivered")
        assert server.cut.wait(30), "the sender kept reading the reply"
        sender.close()
        sender.thread.join(30)
        assert not sender.thread.is_alive()
        assert (sender.figures.delivered, sender.figures.failed, server.requests) == (1, 0, 1)
        assert server.sent < 400_000_000_000
    finally:
        server.close()


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * 200_000 + b"\r\nContent-Length: 0\r\n\r\n",  # over h11's header bound
    b"SMTP ready\r\n\r\n",  # not HTTP at all
])
def test_a_bad_reply_after_connecting_is_a_failed_delivery_said_as_such_and_not_retried(reply, caplog):
    """The host was reached and answered, wrongly: not "cannot reach", and, like a 4xx, not
    retried (it would answer the same again), so a stream of events does not hammer it."""
    server = Replying(lambda: iter([reply]))
    try:
        sender = WebhookSender(WebhookConfig(url=server.url, timeout_s=5, retries=3, backoff_s=0.01), "w")
        with caplog.at_level(logging.WARNING, "edgemm"):
            for _ in range(3):
                sender.send(EVENT)
            wait_until(lambda: sender.figures.failed == 3, what="the events to fail")
        sender.close()
        assert (sender.figures.delivered, sender.figures.retries, server.requests) == (0, 0, 3)
        assert sender.figures.last_error.startswith("bad reply from 127.0.0.1: RemoteProtocolError")
        assert "\n" not in sender.figures.last_error and len(sender.figures.last_error) < 200
        assert caplog.text.count("bad reply from 127.0.0.1") == 1  # once while it keeps failing
    finally:
        server.close()


def test_a_server_that_hangs_up_without_a_reply_is_retried_as_a_connection_error():
    server = Replying(lambda: iter([]))
    try:
        sender = WebhookSender(WebhookConfig(url=server.url, timeout_s=5, retries=2, backoff_s=0.01), "w")
        sender.send(EVENT)
        wait_until(lambda: sender.figures.failed == 1, what="the event to fail")
        sender.close()
        assert (sender.figures.retries, server.requests) == (2, 3)
        assert sender.figures.last_error == "127.0.0.1 closed the connection without a reply"
    finally:
        server.close()


@contextlib.contextmanager
def self_signed_https(folder) -> Iterator[str]:
    """An HTTPS server on 127.0.0.1 answering 200 to every POST, with a self-signed certificate
    made now (openssl); yields its URL."""
    import ssl
    import subprocess
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-days", "1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)

    class Ok(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()


def test_a_webhook_whose_certificate_is_not_trusted_says_so_and_is_not_retried(tmp_path, caplog):
    """The certificate would be the same on a retry: final, as a 4xx is, and the message says
    why (not "cannot reach")."""
    with self_signed_https(tmp_path) as url, caplog.at_level(logging.WARNING, "edgemm"):
        sender = WebhookSender(WebhookConfig(url=url, timeout_s=5, retries=3, backoff_s=0.01), "w")
        sender.send(EVENT)
        wait_until(lambda: sender.figures.failed == 1, what="the event to fail")
        sender.close()
    assert (sender.figures.delivered, sender.figures.retries) == (0, 0)
    assert sender.figures.last_error == "TLS certificate of 127.0.0.1 not trusted: self-signed certificate"
    assert "w: an alert event was not delivered: TLS certificate of 127.0.0.1 not trusted" in caplog.text


def dripping(total: int, pause_s: float):
    """A reply that is `total` bytes of status line and headers, one byte every pause_s."""
    def reply():
        time.sleep(pause_s)
        for _ in range(total):
            yield b"X"
            time.sleep(pause_s)
    return reply


def test_timeout_s_caps_a_whole_attempt_even_against_a_server_that_drips_its_reply():
    """A byte every 0.1 s never trips a 0.5 s read timeout; the attempt's deadline does: it fails
    as a timeout, and the sender hangs up long before the 1000 bytes (100 s) are dripped."""
    server = Replying(dripping(1000, 0.1))
    try:
        sender = WebhookSender(WebhookConfig(url=server.url, timeout_s=0.5, retries=1, backoff_s=0.01), "w")
        sender.send(EVENT)
        wait_until(lambda: sender.figures.failed == 1, timeout=30, what="the attempts to time out")
        assert sender.figures.last_error == "no reply from 127.0.0.1 within 0.5 s (timeout_s)"
        assert (sender.figures.delivered, sender.figures.retries, server.requests) == (0, 1, 2)
        assert server.cut.wait(30) and server.sent < 1000
        sender.close()
    finally:
        server.close()


PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "REQUEST_METHOD")


class ForwardProxy:
    """An HTTP proxy written with the standard library, recording what it is asked: an
    absolute-URI POST it answers 204 itself (the target's name is never resolved); a CONNECT
    it accepts and then closes, so TLS through it cannot start."""

    def __init__(self):
        self.seen: list[tuple[str, str, dict, bytes]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                proxy.seen.append(("POST", self.path, dict(self.headers), body))
                self.send_response(204)
                self.end_headers()

            def do_CONNECT(self):
                proxy.seen.append(("CONNECT", self.path, dict(self.headers), b""))
                self.send_response(200)
                self.end_headers()
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(monkeypatch) -> Iterator[ForwardProxy]:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    server = ForwardProxy()
    yield server
    server.close()


def test_a_webhook_goes_through_http_proxy_and_no_proxy_bypasses_it(proxy, monkeypatch):
    """README "Alerts": HTTP_PROXY as httpx reads it for the offload client: the POST goes to
    the proxy as an absolute URI (with the token; the host, .invalid, is never resolved here);
    a host in NO_PROXY is reached directly."""
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    sender = WebhookSender(WebhookConfig(url="http://hook.invalid/alerts", timeout_s=30, retries=0,
                                         token_env="EDGEMM_HOOK_TOKEN"), "w",
                           environ={"EDGEMM_HOOK_TOKEN": TOKEN})
    sender.send(EVENT)
    wait_until(lambda: sender.figures.delivered == 1, what="the event to be delivered through the proxy")
    sender.close()
    ((method, target, headers, body),) = proxy.seen
    assert (method, target, json.loads(body)) == ("POST", "http://hook.invalid/alerts", EVENT)
    assert headers["Authorization"] == f"Bearer {TOKEN}"

    server = Replying(lambda: [b"HTTP/1.1 204 No Content\r\n\r\n"])
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    try:
        sender = WebhookSender(WebhookConfig(url=server.url, timeout_s=30, retries=0), "w")
        sender.send(EVENT)
        wait_until(lambda: sender.figures.delivered == 1, what="the event to be delivered directly")
        sender.close()
        assert server.requests == 1 and len(proxy.seen) == 1
    finally:
        server.close()


def test_a_webhook_to_https_opens_a_connect_tunnel_through_https_proxy(proxy, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    sender = WebhookSender(WebhookConfig(url="https://hook.invalid/alerts", timeout_s=30, retries=0), "w")
    sender.send(EVENT)
    wait_until(lambda: sender.figures.failed == 1, what="TLS through the closed tunnel to fail")
    sender.close()
    assert [(method, target) for method, target, *_ in proxy.seen] == [("CONNECT", "hook.invalid:443")]
    assert sender.figures.last_error.startswith("cannot reach hook.invalid: ")


@pytest.mark.parametrize("named, reason", [
    ("socks5://127.0.0.1:1080", "http:// and https:// proxies only, not socks5://"),
    ("socks4://127.0.0.1:1080", "http:// and https:// proxies only, not socks4://"),
    ("ftp://x:1", "http:// and https:// proxies only, not ftp://"),
])
def test_a_proxy_webhooks_cannot_use_fails_each_event_saying_why_and_starts_nothing_else(proxy, monkeypatch,
                                                                                        named, reason):
    """README "Alerts": a proxy scheme httpcore cannot speak is not a crash of the stream
    that carries the webhook: each event fails once (not retried), with the reason."""
    monkeypatch.setenv("ALL_PROXY", named)
    sender = WebhookSender(WebhookConfig(url="http://hook.invalid/alerts", timeout_s=30, retries=3), "w")
    sender.send(EVENT)
    wait_until(lambda: sender.figures.failed == 1, what="the event to fail")
    sender.close()
    assert sender.figures.last_error == f"cannot reach hook.invalid: webhooks go through {reason}"
    assert sender.figures.retries == 0 and proxy.seen == []


def test_no_proxy_is_read_by_host_name_ipv6_included(monkeypatch):
    from edgemm.net.outbound import environment_proxy
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "proxy.example:3128")
    monkeypatch.setenv("NO_PROXY", ".internal.example,::1")
    assert environment_proxy("http://hook.example/x") == "http://proxy.example:3128"
    assert environment_proxy("http://a.internal.example:8080/x") is None
    assert environment_proxy("http://[::1]:8080/x") is None
    assert environment_proxy("https://hook.example/x") is None  # no HTTPS_PROXY, no ALL_PROXY


def test_a_webhook_with_no_proxy_set_connects_directly(proxy):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    sender = WebhookSender(WebhookConfig(url=f"http://127.0.0.1:{port}/", timeout_s=30, retries=0), "w")
    sender.send(EVENT)
    wait_until(lambda: sender.figures.failed == 1, what="the event to fail")
    assert sender.figures.last_error == "cannot reach 127.0.0.1: ConnectError" and proxy.seen == []
    sender.close()


def test_timeout_s_covers_a_name_lookup_that_hangs_and_hung_lookups_are_bounded(proxy, monkeypatch):
    """httpcore's connect timeout leaves the name to getaddrinfo, which can wait far longer:
    the attempt fails as a timeout at its deadline while the lookup still hangs, and with
    the lookup slots all held by hung lookups the next attempt fails at once."""
    release, resolve = threading.Event(), socket.getaddrinfo
    hung: list[str] = []

    def getaddrinfo(host, *args, **kwargs):
        if host == "hangs.invalid" and not kwargs.get("flags"):
            hung.append(host)
            release.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "released")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(edgemm.net.outbound, "NAME_LOOKUPS", edgemm.net.outbound.NameLookups(limit=1))
    try:
        sender = WebhookSender(WebhookConfig(url="http://hangs.invalid:8080/", timeout_s=0.5, retries=0), "w")
        sender.send(EVENT)
        wait_until(lambda: sender.figures.failed == 1, what="the attempt to time out")
        assert sender.figures.last_error == "no reply from hangs.invalid within 0.5 s (timeout_s)"
        assert not release.is_set() and hung == ["hangs.invalid"]  # failed while the lookup still hangs
        sender.send(EVENT)
        wait_until(lambda: sender.figures.failed == 2, what="the second attempt to fail")
        assert sender.figures.last_error == "cannot reach hangs.invalid: ConnectError"
        assert hung == ["hangs.invalid"]  # no second thread started for it
        sender.close()
    finally:
        release.set()


def test_a_closed_webhook_gives_up_what_it_holds_after_one_timeout_s():
    """Closing behind a hanging endpoint: what is in flight fails within one timeout_s of the
    close and what is queued is dropped (counted), instead of one timeout_s per event."""
    with hanging() as url:
        sender = WebhookSender(WebhookConfig(url=url, timeout_s=1, retries=0), "w")
        sender.send({**EVENT, "frame": 0})
        wait_until(lambda: sender.queued() == 0, what="the first event to be sent (it hangs)")
        for i in range(1, 6):
            sender.send({**EVENT, "frame": i})
        sender.close()
        sender.thread.join(30)
        assert not sender.thread.is_alive()
        figures = sender.figures
        assert figures.failed + figures.dropped == 6 and figures.failed <= 2 and figures.delivered == 0


def test_a_webhooks_tls_context_is_made_on_its_own_thread_not_the_callers(monkeypatch):
    """Making a TLS context loads the CA bundle (tens of ms): a stream created on the event loop
    must not hold every other client up for it."""
    makers: list[str] = []
    real = edgemm.net.outbound.httpx.create_ssl_context
    monkeypatch.setattr(edgemm.net.outbound.httpx, "create_ssl_context",
                        lambda *a, **k: makers.append(threading.current_thread().name) or real(*a, **k))
    sender = WebhookSender(WebhookConfig(url="https://127.0.0.1:9/hook", timeout_s=1, retries=0), "w")
    assert threading.current_thread().name not in makers
    wait_until(lambda: makers, what="the sender's thread to make its client")
    sender.close()
    sender.thread.join(30)
    assert makers == [sender.thread.name]


def test_a_webhook_that_cannot_make_its_client_drops_its_events_counted(monkeypatch, caplog):
    def no_bundle(*a, **k):
        raise OSError("no CA bundle at /etc/ssl/certs")
    monkeypatch.setattr(edgemm.net.outbound.httpx, "create_ssl_context", no_bundle)
    sender = WebhookSender(WebhookConfig(url="https://127.0.0.1:9/hook", timeout_s=1, retries=0), "w")
    sender.thread.join(30)
    assert not sender.thread.is_alive()
    sender.send(EVENT)
    assert sender.figures.dropped == 1 and sender.figures.delivered == 0
    assert "cannot send anything: OSError: no CA bundle" in caplog.text


def test_beyond_max_draining_a_closed_webhook_is_abandoned_at_once(monkeypatch):
    """With MAX_DRAINING closed webhooks draining already, close() shuts the connection in
    flight and drops the queue: the thread ends now, not after its 60 s timeout."""
    monkeypatch.setattr(edgemm.streams.alerts.webhook, "MAX_DRAINING", 0)
    with hanging() as url:
        sender = WebhookSender(WebhookConfig(url=url, timeout_s=60, retries=3), "w")
        sender.send({**EVENT, "frame": 0})
        wait_until(lambda: sender.queued() == 0, what="the first event to be sent (it hangs)")
        sender.send({**EVENT, "frame": 1})
        sender.close()
        sender.thread.join(30)  # 30 of its 60 s: it is not waiting for the endpoint
        assert not sender.thread.is_alive()
        assert (sender.figures.failed, sender.figures.dropped, sender.figures.retries) == (1, 1, 0)


@contextlib.contextmanager
def blackhole() -> Iterator[tuple[str, int]]:
    """A URL whose host drops the connection attempts (as a firewalled one does): a listener
    with listen(0) whose accept queue is filled and never accepted, so the kernel drops
    every further SYN and a connect() to it waits until its own timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        probe = socket.socket()
        probe.settimeout(0.3)
        with pytest.raises(TimeoutError):  # the queue is full: a connect hangs
            probe.connect(("127.0.0.1", port))
        probe.close()
        yield f"http://127.0.0.1:{port}/hook", port
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


def sockets_to(port: int) -> int:
    """This process's sockets (its fds) to or connecting to 127.0.0.1:`port`, by the kernel's
    table: the ones a webhook leaves open, whatever Python still refers to."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            ours.add(target[len("socket:["):-1])
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if row[2] == f"0100007F:{port:04X}" and row[9] in ours)


def webhook_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "edgemm-webhook" and t.is_alive())


def test_an_abandoned_webhook_connecting_to_a_host_that_drops_syns_ends_within_1_s(monkeypatch):
    """A connect in progress is shut by abandon(), as a connection is: the thread ends within
    1 s, not after its 60 s timeout, and its socket is closed."""
    monkeypatch.setattr(edgemm.streams.alerts.webhook, "MAX_DRAINING", 0)
    with blackhole() as (url, port):
        baseline = sockets_to(port)  # the fillers'
        sender = WebhookSender(WebhookConfig(url=url, timeout_s=60, retries=3), "w")
        sender.send({**EVENT, "frame": 0})
        sender.send({**EVENT, "frame": 1})
        wait_until(lambda: sockets_to(port) == baseline + 1, what="the webhook's connect to be in progress")
        time.sleep(0.2)  # well inside connect(), not before it
        assert sender.thread.is_alive() and sender.figures.failed == 0
        closed = time.monotonic()
        sender.close()
        sender.thread.join(1)
        assert not sender.thread.is_alive() and time.monotonic() - closed < 1
        assert sockets_to(port) == baseline
        assert (sender.figures.failed, sender.figures.dropped, sender.figures.retries) == (1, 1, 0)
        assert sender.figures.last_error == "cannot reach 127.0.0.1: ConnectError"


def test_a_connect_to_a_host_that_drops_syns_fails_at_the_deadline_and_frees_its_socket():
    """Not abandoned: the connect waits for what is left of timeout_s, then fails as a timeout."""
    with blackhole() as (url, port):
        baseline = sockets_to(port)
        sender = WebhookSender(WebhookConfig(url=url, timeout_s=0.5, retries=0), "w")
        sender.send(EVENT)
        wait_until(lambda: sender.figures.failed == 1, what="the attempt to time out")
        assert sender.figures.last_error == "no reply from 127.0.0.1 within 0.5 s (timeout_s)"
        assert sockets_to(port) == baseline
        sender.close()
        sender.thread.join(5)
        assert not sender.thread.is_alive()


def test_ended_streams_webhooks_to_a_host_that_drops_syns_leave_only_max_draining_behind():
    """The hostile scenario, smaller: 12 streams of 4 alerts, each with its own webhook to a
    host that drops SYNs, each stream closed with its webhooks mid-connect. At most
    MAX_DRAINING keep draining (each for at most its timeout_s); the others end within
    about a second, their sockets closed; after timeout_s every one is gone."""
    draining = edgemm.streams.alerts.webhook.MAX_DRAINING
    with blackhole() as (url, port):
        baseline_sockets, baseline_threads = sockets_to(port), webhook_threads()
        hook = {"url": url, "timeout_s": 5, "retries": 0}
        alerts = {f"a{k}": {"prompt": "what color is the circle ?", "match": "red", "webhook": hook}
                  for k in range(4)}
        for i in range(12):
            cfg = config_from_dict({"streams": [{"id": f"w{i}", "source": "synthetic://",
                                                 "alerts": alerts}]}).streams[0]
            stream = StreamAlerts(f"w{i}", cfg.alerts, None, ScriptedPipeline(), lambda event: None)
            for sender in stream.senders.values():
                sender.send(EVENT)
            # this stream's 4 connecting, besides the draining ones before it
            wait_until(lambda: sockets_to(port) >= baseline_sockets + min(4 * (i + 1), draining + 4),
                       what="this stream's webhooks to be connecting")
            stream.close()
        closed = time.monotonic()
        wait_until(lambda: webhook_threads() <= baseline_threads + draining
                   and sockets_to(port) <= baseline_sockets + draining, timeout=2,
                   what="the abandoned webhooks to end")
        assert time.monotonic() - closed < 2
        wait_until(lambda: webhook_threads() == baseline_threads and sockets_to(port) == baseline_sockets,
                   timeout=8, what="the draining ones to end at their timeout_s")


def test_a_webhook_tries_its_hosts_addresses_in_turn_ipv6_included_with_tcp_nodelay(monkeypatch):
    """The backend makes its sockets itself: each address the resolver gives, in its order and
    family (the first refused, the second IPv6), with httpcore's TCP_NODELAY on the one used."""
    server = Hook(host="::1")
    used: list[tuple[int, int]] = []  # (family, TCP_NODELAY) of each socket handed to httpcore

    class Recorded(edgemm.net.outbound.SyncStream):
        def __init__(self, sock: socket.socket) -> None:
            used.append((sock.family, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
            super().__init__(sock)

    def resolve(host: str, port: int, wait: float) -> list[tuple]:
        assert (host, port) == ("hook.test", server.port)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", server.port)),  # nobody there
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", server.port, 0, 0))]

    monkeypatch.setattr(edgemm.net.outbound, "SyncStream", Recorded)
    monkeypatch.setattr(edgemm.net.outbound.NAME_LOOKUPS, "resolve", resolve)
    try:
        sender = WebhookSender(WebhookConfig(url=f"http://hook.test:{server.port}/edgemm", retries=0), "w")
        sender.send(EVENT)
        wait_until(lambda: sender.figures.delivered == 1, what="the event to be delivered over IPv6")
        assert [body for _, body in server.received] == [EVENT]
        assert used == [(socket.AF_INET6, 1)]
        sender.close()
    finally:
        server.close()


def test_daemon_alerts_post_their_changes_to_the_webhook(runtime, hook, monkeypatch):
    monkeypatch.setenv("EDGEMM_HOOK_TOKEN", TOKEN)
    spec = counting_stream("shapes", 30, webhook={"url": hook.url, "token_env": "EDGEMM_HOOK_TOKEN"})
    with running(runtime, {"streams": [spec]}) as d, raw_client(sock_path(d)) as http:
        wait_until(lambda: settled(http, "shapes"), timeout=60, what="the end")
        described = http.get("/v1/streams/shapes").json()  # the URL's path may be its secret: not shown
        sender = d.service.streams.get("shapes").alerts.senders["stream"]
        sender.thread.join(10)  # the stream ended: its webhook delivered what it held and stopped
        assert not sender.thread.is_alive() and sender.queued() == 0
        sent = lambda: metric(http.get("/metrics").text,  # noqa: E731
                              'edgemm_alert_transitions_total{stream="shapes",alert="many",state="true"}', 0)
        wait_until(lambda: len([b for _, b in hook.received if b["alert"] == "many" and b["state"] == "true"])
                   == sent(), what="the webhook to receive every change")
        text = http.get("/metrics").text
    assert hook.received and all(h["Authorization"] == f"Bearer {TOKEN}" for h, _ in hook.received)
    assert all(set(b) == {"stream", "alert", "state", "frame", "time"} for _, b in hook.received)
    assert described["webhook"]["url"] == "http://127.0.0.1/…" and "edgemm" not in json.dumps(described["webhook"])
    delivered = metric(text, 'edgemm_alert_webhook_events_total{stream="shapes",webhook="stream",outcome="delivered"}')
    assert delivered >= 1 and metric(text, 'edgemm_alert_webhook_events_total{stream="shapes",webhook="stream",'
                                           'outcome="failed"}') == 0


def test_every_frame_is_answered_and_every_change_counted_while_the_webhook_hangs(runtime, monkeypatch):
    """By counts: the stream answers every one of its frames while its webhook's one attempt
    hangs, delivers nothing, and every change is held by it, queued (at most 2) or dropped."""
    monkeypatch.setattr(edgemm.streams.alerts.webhook, "WEBHOOK_QUEUE", 2)
    frames = 40
    with hanging() as url:
        spec = counting_stream("shapes", frames, webhook={"url": url, "timeout_s": 60, "retries": 0})
        with running(runtime, {"streams": [spec]}) as d, raw_client(sock_path(d)) as http:
            wait_until(lambda: settled(http, "shapes"), timeout=60, what="the stream to answer every frame")
            sender = d.service.streams.get("shapes").alerts.senders["stream"]
            changes = lambda: sum(metric(http.get("/metrics").text,  # noqa: E731
                                         f'edgemm_alert_transitions_total{{stream="shapes",alert="{a}",state="{s}"}}', 0)
                                  for a in ("many", "red") for s in ("true", "false", "unknown"))
            # the sender took one event (whether before or after the queue overflowed) and hangs on it
            wait_until(lambda: sender.figures.dropped + sender.queued() + 1 == changes(),
                       what="the sender to hold one event, the rest queued or dropped")
            figures = http.get("/v1/streams/shapes").json()
            text = http.get("/metrics").text
            queued = sender.queued()
    assert figures["frames"] == frames and figures["errors"] == 0
    total = sum(metric(text, f'edgemm_alert_transitions_total{{stream="shapes",alert="{a}",state="{s}"}}', 0)
                for a in ("many", "red") for s in ("true", "false", "unknown"))
    hook = 'edgemm_alert_webhook_events_total{stream="shapes",webhook="stream",outcome='
    assert total > 3  # enough to overflow a queue of 2 behind the one hanging
    # 2 queued if the sender took the first event before the queue overflowed, else 1: it took the
    # oldest of the newest 2 after every change was made
    assert queued in (1, 2)
    assert metric(text, hook + '"delivered"}') == 0 and metric(text, hook + '"failed"}') == 0
    assert metric(text, hook + '"dropped"}') == total - 1 - queued >= total - 3
    assert metric(text, 'edgemm_alert_events_dropped_total{stream="shapes",sink="webhook"}') == total - 1 - queued


def test_the_api_may_give_webhook_urls_only_for_the_hosts_of_server_webhook_hosts(runtime, hook):
    """No blind requests for a client: with server.webhook_hosts empty, no webhook URL from the
    API (loopback, 169.254.169.254 or the LAN alike); with it set, only those hosts (and ports)."""
    body = {**counting_stream("api", 20), "webhook": {"url": "http://169.254.169.254/latest/meta-data/"}}
    with running(runtime) as d, raw_client(sock_path(d)) as http:
        error = assert_error(http.post("/v1/streams", json=body), 403)
        assert error["type"] == "permission_error"
        assert error["message"] == ("the API may not give webhook URLs: server.webhook_hosts is empty (list there "
                                    "the hosts POST /v1/streams may send alert events to)")
        body["webhook"] = {"url": hook.url}
        assert_error(http.post("/v1/streams", json=body), 403)  # loopback is no exception
        assert http.get("/v1/streams").json()["data"] == []
    allowed = hook.url.split("/")[2]  # 127.0.0.1:PORT
    with running(runtime, webhook_hosts=[allowed]) as d, raw_client(sock_path(d)) as http:
        body["alerts"]["red"] = {**body["alerts"]["red"], "webhook": {"url": "http://127.0.0.1:1/admin"}}
        error = assert_error(http.post("/v1/streams", json=body), 403)  # the host, not its other ports
        assert error["message"] == f"a webhook to 127.0.0.1 port 1 is not in server.webhook_hosts ({allowed})"
        del body["alerts"]["red"]["webhook"]
        created = http.post("/v1/streams", json=body)
        assert created.status_code == 201, created.text
        wait_until(lambda: settled(http, "api"), timeout=60, what="the stream to end")
        wait_until(lambda: d.service.streams.get("api").alerts.senders["stream"].figures.delivered
                   == len(hook.received) >= 1, what="the allowed webhook to receive the changes")


@pytest.mark.parametrize("entry", ["http://h", "h/x", "u@h:80", "h:", "h:99999", "::1", "", "a b"])
def test_bad_webhook_hosts_are_one_line_config_errors(entry):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"server": {"webhook_hosts": ["ok.example", entry]}})
    assert str(info.value) == ("config: 'server.webhook_hosts[1]' must be a host name or address, or host:port "
                               f"('[::1]:8080' for IPv6), got {entry!r}")


def test_webhook_urls_from_the_config_are_never_in_messages_with_credentials(hook):
    """user:password@ in a webhook URL stays out of error messages (they name the host only)."""
    url = hook.url.replace("http://", "http://user:pw@")
    hook.script = [500]
    sender = WebhookSender(WebhookConfig(url=url, retries=0), "w")
    sender.send(EVENT)
    wait_until(lambda: sender.figures.failed == 1, what="failure")
    sender.close()
    assert "pw" not in (sender.figures.last_error or "") and os.environ.get("EDGEMM_HOOK_TOKEN") is None


def test_a_slow_listener_loses_the_oldest_events_alert_events_counted_too():
    from edgemm.streams.manager import EVENTS_BUFFER, ManagedStream
    cfg = config_from_dict({"streams": [{"id": "cam", "source": "synthetic://", "alerts": {"p": "is it ?"}}]})
    stream = ManagedStream(cfg.streams[0], ScriptedPipeline(), loop=None)
    queue = stream.listen()
    stream._deliver(EVENT, "alert")
    for i in range(EVENTS_BUFFER):  # one more than it holds: the alert event, the oldest, goes
        stream._deliver({"stream": "cam", "frame": i})
    assert (stream.lagged, stream.alerts_lagged) == (1, 1)
    items = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [i[0] for i in items] == list(range(2, EVENTS_BUFFER + 2))  # SSE ids: the gap shows the loss
    assert all(event is None for _, _, event in items)
    stream._deliver(EVENT, "alert")
    assert queue.get_nowait() == (EVENTS_BUFFER + 2, EVENT, "alert")


def test_a_webhook_token_file_is_relative_to_the_config_file(tmp_path):
    config = tmp_path / "edgemm.yaml"
    config.write_text("streams:\n- id: door\n  source: synthetic://\n  alerts:\n    p:\n      prompt: is it ?\n"
                      "      webhook: {url: 'http://127.0.0.1:1/', token_file: hook-token}\n"
                      "  webhook: {url: 'http://127.0.0.1:1/', token_file: /etc/edgemm/token}\n")
    stream = load_config(config).streams[0]
    assert stream.alerts["p"].webhook.token_file == str(tmp_path / "hook-token")
    assert stream.webhook.token_file == "/etc/edgemm/token"


def test_an_abandoned_https_webhook_in_its_tls_handshake_ends_within_1_s(monkeypatch):
    """A host that accepts the connection and never answers the TLS hello: abandon() shuts the
    socket the handshake waits on (httpcore's own start_tls took its fd from the one registered)."""
    monkeypatch.setattr(edgemm.streams.alerts.webhook, "MAX_DRAINING", 0)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True)
    acceptor.start()
    try:
        sender = WebhookSender(WebhookConfig(url=f"https://127.0.0.1:{port}/h", timeout_s=60, retries=3), "w")
        sender.send({**EVENT, "frame": 0})
        acceptor.join(10)
        assert accepted, "the webhook did not connect"
        time.sleep(0.3)  # in the handshake: the hello sent, no answer
        assert sender.thread.is_alive() and sender.figures.failed == 0
        closed = time.monotonic()
        sender.close()
        sender.thread.join(1)
        assert not sender.thread.is_alive() and time.monotonic() - closed < 1
        assert sockets_to(port) == 0  # the webhook's socket to it is closed
        assert sender.figures.failed == 1
    finally:
        for s in accepted:
            s.close()
        server.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command to make a test certificate")
def test_an_https_webhook_delivers_over_its_own_handshake_and_checks_the_certificate(tmp_path, monkeypatch):
    """DeadlineStream.start_tls does the handshake itself: a trusted certificate for the host
    delivers, by address and by name; an untrusted one does not."""
    import http.server
    import ssl
    import subprocess
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Hook)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]

    def deliver(host: str) -> WebhookSender:
        sender = WebhookSender(WebhookConfig(url=f"https://{host}:{port}/h", timeout_s=5, retries=0), "w")
        sender.send(EVENT)
        wait_until(lambda: sender.figures.delivered + sender.figures.failed == 1, what="the attempt")
        sender.close()
        return sender
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # httpx's context trusts it
        assert deliver("127.0.0.1").figures.delivered == 1
        assert deliver("localhost").figures.delivered == 1
        monkeypatch.delenv("SSL_CERT_FILE")
        assert deliver("127.0.0.1").figures.failed == 1  # not trusted: refused in the handshake
    finally:
        server.shutdown()
        server.server_close()
