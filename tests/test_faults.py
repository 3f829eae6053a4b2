"""Faults: one bad request never stops the daemon, and the watchdog tells the truth.

Failures are injected by wrapping the runtime's stage methods (prepare, encode, the
decoder batch) for one "poison" request, identified by its image. The wrapper first
signals that it was entered and waits for the test to release it, so "the poison is in
the stage while the other requests queue behind it" is a state, not a race. Each fault
runs against a real daemon on a temporary socket: the poison gets a 500 in OpenAI's
error shape, the requests around it get the answers they get alone, the admission slots
come back, and the daemon goes on answering.

The watchdog tests listen on a fake NOTIFY_SOCKET (an AF_UNIX datagram socket in a
temporary folder) with a small WATCHDOG_USEC, as systemd would set it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from tests.support.fake_systemd import FakeSystemd  # the benchmark uses it too
from test_server import assert_error, in_background, metric, raw_client, running, short_dir, sock_path, wait_until

import edgemm.streams.manager
from edgemm.engine.pipeline import Pipeline, Request
from edgemm.cli.status import render

WAIT_S = 30  # bound for anything that should happen "now"; never a timing assumption
MAX_TOKENS = 4
PROMPTS = ["how many shapes are there ?", "what color is the circle ?"]
NORMAL_IMAGES = ["scene_11.png", "scene_12.png"]
POISON_IMAGE = "scene_21.png"  # the request the injected fault hits
INJECTED = "injected failure\nwith a second line"  # backends raise multi-line messages: the client gets one line
ONE_LINE = "injected failure with a second line"
# no encoder timing at start (auto would time batches), and one image per encoder call: a
# poison never shares an encoder call with a good request (a shared call fails as a whole)
FAST = {"encoder_batching": "off", "continuous_batching": "off", "max_batch": 4}


class Injected(RuntimeError):
    """The fault the wrappers raise."""


@pytest.fixture(scope="module")
def samples(model_dir) -> dict[str, bytes]:
    return {name: (model_dir / "samples" / name).read_bytes() for name in NORMAL_IMAGES + [POISON_IMAGE]}


def infer(path: str, image: bytes, prompt: str = PROMPTS[0]) -> httpx.Response:
    with raw_client(path) as http:
        return http.post("/v1/infer", params={"prompt": prompt, "max_tokens": MAX_TOKENS}, content=image)


def normal_requests(samples) -> list[tuple[bytes, str]]:
    return [(samples[name], prompt) for name in NORMAL_IMAGES for prompt in PROMPTS]


def answer(response: httpx.Response) -> tuple[str, list[int]]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["answer"], body["tokens"]


class Hold:
    """Entered / released events around the poison's fault, set and awaited by the test."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def wait(self) -> None:
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never released the fault"


def poison_pixels(runtime, samples) -> np.ndarray:
    return runtime.prepare(samples[POISON_IMAGE], PROMPTS[0]).pixel_values[0]


def inject(site: str, runtime, samples, monkeypatch, hold: Hold) -> None:
    """Make `site` fail for the poison image (after holding it until released)."""
    poison = samples[POISON_IMAGE]
    if site in ("prepare", "prepare returns a broken request"):
        prepare = runtime.prepare

        def faulty_prepare(image, prompt, **options):
            if image == poison:
                hold.wait()
                if site == "prepare":
                    raise Injected(INJECTED)
                return None  # no PreparedRequest: the encode stage trips over it outside its own try
            return prepare(image, prompt, **options)
        monkeypatch.setattr(runtime, "prepare", faulty_prepare)
    elif site == "encode":
        encode, marker = runtime.encode, poison_pixels(runtime, samples)

        def faulty_encode(pixels, keys=None, route=None):
            if any(np.array_equal(row, marker) for row in pixels):
                hold.wait()
                raise Injected(INJECTED)
            return encode(pixels, keys, route)
        monkeypatch.setattr(runtime, "encode", faulty_encode)
    elif site == "decode":
        # the whole batched decode call blows up: the exception escapes Pipeline._decode_loop,
        # which before the crash barriers ended the decode thread
        open_batch, marker = runtime.open_batch, poison_pixels(runtime, samples)
        poisoned: set[int] = set()

        def faulty_open_batch(route, finished, steps_by_rows=None):
            batch = open_batch(route, finished, steps_by_rows)
            join, step = batch.join, batch.step

            def join_marking(requests):
                for key, prepared, *_ in requests:
                    if np.array_equal(prepared.pixel_values[0], marker):
                        poisoned.add(id(batch))
                return join(requests)

            def faulty_step():
                if id(batch) in poisoned:
                    hold.wait()
                    raise Injected(INJECTED)
                return step()
            batch.join, batch.step = join_marking, faulty_step
            return batch
        monkeypatch.setattr(runtime, "open_batch", faulty_open_batch)
    else:
        raise AssertionError(site)


def tracebacks(caplog, kind: type) -> int:
    return sum(1 for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], kind))


def assert_serving(path: str, d) -> None:
    with raw_client(path) as http:
        wait_until(lambda: metric(http.get("/metrics").text, "edgemm_requests_in_flight") == 0,
                   WAIT_S, "every admission slot back")
        assert http.get("/readyz").status_code == 200
        assert http.get("/healthz").json() == {"status": "ok"}
        assert metric(http.get("/metrics").text, "edgemm_ready") == 1
    assert d.service.pipeline.alive()


SITES = ["prepare", "prepare returns a broken request", "encode", "decode"]


@pytest.mark.parametrize("site", SITES)
def test_a_failing_request_gets_500_and_the_others_their_answers(runtime, samples, monkeypatch, caplog, site):
    caplog.set_level(logging.ERROR)
    requests = normal_requests(samples)
    with running(runtime, **FAST) as d:
        path = sock_path(d)
        alone = [answer(infer(path, image, prompt)) for image, prompt in requests]  # before any fault
        hold = Hold()
        inject(site, runtime, samples, monkeypatch, hold)
        admitted = d.service.admission.admitted
        poison_thread, poison_out = in_background(infer, path, samples[POISON_IMAGE])
        assert hold.entered.wait(WAIT_S), "the poison never reached its fault"
        others = [in_background(infer, path, image, prompt) for image, prompt in requests]
        # admitted, not in flight: on a loaded machine the first may be answered (overtaking the
        # held poison after PREPARE_OVERTAKE_S) before the last is in
        wait_until(lambda: d.service.admission.admitted == admitted + 1 + len(requests), WAIT_S,
                   "every request admitted")
        hold.release.set()
        poison_thread.join(WAIT_S)
        error = assert_error(poison_out[0], 500)
        assert error["type"] == "internal_error"
        if site == "prepare returns a broken request":
            assert error["message"].startswith("internal error: AttributeError: ")
        else:
            assert error["message"] == f"internal error: Injected: {ONE_LINE}"
        for (thread, out), want in zip(others, alone):
            thread.join(WAIT_S)
            assert answer(out[0]) == want  # the same answer as alone
        assert_serving(path, d)
        # it keeps happening, and keeps being survived
        assert_error(infer(path, samples[POISON_IMAGE]), 500)
        assert answer(infer(path, *requests[0])) == alone[0]
        assert_serving(path, d)
        assert d.service.pipeline.stats.failed >= 2
    kind = AttributeError if site == "prepare returns a broken request" else Injected
    assert tracebacks(caplog, kind) == 2  # once per poison request, never twice


def test_a_decode_batch_that_blows_up_fails_only_its_unanswered_rows(runtime, samples, monkeypatch):
    """Rows answered before the batch failed keep their answers; the rest get the error."""
    short = (samples[NORMAL_IMAGES[0]], PROMPTS[0], 1)  # done at the first step
    long = (samples[NORMAL_IMAGES[1]], "describe the image", 8)  # still decoding at the second
    alone = [runtime.infer(image, prompt, max_new_tokens=n) for image, prompt, n in (short, long)]
    assert len(alone[1].tokens) > 2
    open_batch = runtime.open_batch
    pipeline: Pipeline | None = None
    steps = []

    def failing_open_batch(route, finished, steps_by_rows=None):
        # both requests in one batch: wait (bounded) until the second is queued behind the first
        wait_until(lambda: pipeline.to_decode.qsize() == 1, WAIT_S, "the second request at the decoder")
        batch = open_batch(route, finished, steps_by_rows)
        step = batch.step

        def step_then_fail():
            steps.append(len(batch))
            if len(steps) == 2:
                raise Injected(INJECTED)
            return step()
        batch.step = step_then_fail
        return batch
    monkeypatch.setattr(runtime, "open_batch", failing_open_batch)
    with Pipeline(runtime, queue_size=4, max_batch=4, decoder_joins="off") as pipeline:
        futures = [pipeline.submit(Request(image, prompt, {"max_new_tokens": n})) for image, prompt, n in (short, long)]
        wait_until(lambda: all(f.done() for f in futures), WAIT_S, "both finished")
        assert steps == [2, 1]  # one batch of two; the short row left after the first step
        assert futures[0].result().tokens == alone[0].tokens
        with pytest.raises(Injected):
            futures[1].result()
        assert pipeline.health(120).ok and pipeline.stats.failed == 1
        monkeypatch.setattr(runtime, "open_batch", open_batch)
        again = pipeline.submit(Request(long[0], long[1], {"max_new_tokens": long[2]})).result(WAIT_S)
        assert again.tokens == alone[1].tokens


@pytest.mark.parametrize("stage", ["prepare", "encode", "decode"])
def test_every_stage_survives_an_unexpected_error(runtime, samples, monkeypatch, stage):
    """An error outside each stage's per-request handling (here: in the pipeline's own
    bookkeeping) fails the request the stage held, and the stage takes the next one."""
    pipeline = Pipeline(runtime, queue_size=4, max_batch=2)
    method = {"prepare": "_prepare", "encode": "_encode", "decode": "_decode"}[stage]
    original = getattr(pipeline, method)
    calls = []

    def once_broken(*args):
        calls.append(1)
        if len(calls) == 1:
            raise Injected(INJECTED)
        return original(*args)
    monkeypatch.setattr(pipeline, method, once_broken)
    try:
        first = pipeline.submit(Request(samples[POISON_IMAGE], PROMPTS[0], {"max_new_tokens": 2}))
        with pytest.raises(Injected):
            first.result(WAIT_S)
        later = pipeline.submit(Request(samples[NORMAL_IMAGES[0]], PROMPTS[0], {"max_new_tokens": 2}))
        assert later.result(WAIT_S).tokens == runtime.infer(samples[NORMAL_IMAGES[0]], PROMPTS[0],
                                                             max_new_tokens=2).tokens
        assert pipeline.alive() and pipeline.health(120).ok
    finally:
        pipeline.close(WAIT_S)


# ---- a daemon-run stream ---------------------------------------------------------------

class FailingSource:
    """A real source whose read() raises once: the first read after `armed` is set."""

    def __init__(self, source, armed: threading.Event | None):
        self.source, self.armed = source, armed

    def __getattr__(self, name):
        return getattr(self.source, name)

    def read(self):
        if self.armed is not None and self.armed.is_set():
            self.armed = None
            raise Injected(INJECTED)
        return self.source.read()


def test_a_stream_whose_source_fails_reports_it_and_the_daemon_goes_on(runtime, samples, monkeypatch):
    opened, armed = [], threading.Event()
    open_source = edgemm.streams.manager.open_source

    def failing_open_source(uri, **kwargs):
        source = FailingSource(open_source(uri, **kwargs), armed if not opened else None)
        opened.append(source)
        return source
    monkeypatch.setattr(edgemm.streams.manager, "open_source", failing_open_source)
    spec = {"id": "cam", "source": "synthetic://?fps=20&seed=1", "prompt": PROMPTS[0], "tier": "low",
            "max_new_tokens": 1}
    with running(runtime, {"streams": [spec]}, **FAST) as d, raw_client(sock_path(d)) as http:
        path = sock_path(d)
        events: list[dict] = []
        with http.stream("GET", "/v1/streams/cam/events", timeout=WAIT_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    armed.set()  # this listener is registered: the source fails at its next read
                    if len(opened) > 1 and "answer" in events[-1] and any("error" in e for e in events):
                        break  # answered again after the failure, by the reopened source
                    assert len(events) < 500, "no error event, or no answer after it"
        failure = next(e for e in events if "error" in e)
        assert "frame" not in failure and failure["error"] == INJECTED  # the source's own failure
        assert "answer" in events[events.index(failure) + 1]
        stream = http.get("/v1/streams/cam").json()
        assert stream["retries"] >= 1 and stream["last_error"] == INJECTED
        assert answer(infer(path, samples[NORMAL_IMAGES[0]]))
        assert_serving(path, d)


def test_a_stream_frame_that_fails_in_the_pipeline_is_an_error_event(runtime, samples, monkeypatch):
    """A frame that blows up a stage of the stream's own pipeline gets its error line; the frames
    after it are answered."""
    encode, calls = runtime.encode, []

    def third_frame_fails(pixels, keys=None, route=None):
        calls.append(1)
        if len(calls) == 3:
            raise Injected(INJECTED)
        return encode(pixels, keys, route)
    monkeypatch.setattr(runtime, "encode", third_frame_fails)
    spec = {"id": "cam", "source": "synthetic://?fps=20&seed=2", "prompt": PROMPTS[0], "tier": "low",
            "max_new_tokens": 1}
    with running(runtime, {"streams": [spec]}, **FAST) as d, raw_client(sock_path(d)) as http:
        events: list[dict] = []
        with http.stream("GET", "/v1/streams/cam/events", timeout=WAIT_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if any("error" in e for e in events) and "answer" in events[-1]:
                        break
        failure = next(e for e in events if "error" in e)
        assert "frame" in failure and "injected failure" in failure["error"]
        assert d.service.streams.get("cam").figures.state == "running"
        assert_serving(sock_path(d), d)


# ---- the watchdog ------------------------------------------------------------------------

def expect(notify: FakeSystemd, predicate, what: str) -> tuple[float, str]:
    """The first notification from now on for which `predicate` holds."""
    found = notify.wait_for(predicate, timeout=WAIT_S)
    assert found, f"no notification {what} within {WAIT_S} s"
    return found


WATCHDOG_USEC = 100_000  # pings every 0.05 s
INTERVAL_S = WATCHDOG_USEC / 2e6
STALL_S = 0.5


@pytest.fixture
def notify(monkeypatch) -> Iterator[FakeSystemd]:
    folder = short_dir()
    fake = FakeSystemd(folder)
    monkeypatch.setenv("NOTIFY_SOCKET", fake.path)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    yield fake
    fake.close()
    shutil.rmtree(folder, ignore_errors=True)


def test_a_stalled_stage_stops_the_watchdog_until_it_recovers(runtime, samples, monkeypatch, notify):
    hold = Hold()
    inject_block = runtime.encode
    blocked_at: list[float] = []

    def blocking_encode(pixels, keys=None, route=None):
        blocked_at.append(time.monotonic())
        hold.wait()
        return inject_block(pixels, keys, route)
    with running(runtime, stall_s=STALL_S, **FAST) as d, raw_client(sock_path(d)) as http:
        path = sock_path(d)
        expect(notify, lambda m: "WATCHDOG=1" in m, "WATCHDOG=1 while healthy")
        monkeypatch.setattr(runtime, "encode", blocking_encode)
        thread, out = in_background(infer, path, samples[NORMAL_IMAGES[0]])
        assert hold.entered.wait(WAIT_S)
        unhealthy_at, _ = expect(notify, lambda m: "WATCHDOG=1" not in m and "unhealthy" in m,
                                          "STATUS= saying unhealthy")
        last_ping = max(t for t in notify.pings() if t < unhealthy_at)
        assert last_ping - blocked_at[0] <= STALL_S + INTERVAL_S + 0.1  # 0.1 s: this thread's own scheduling
        for _ in range(3):  # three more beats: STATUS= only, never a ping
            expect(notify, lambda m: "unhealthy" in m, "another unhealthy beat")
        assert not [t for t in notify.pings() if t > unhealthy_at]
        ready = http.get("/readyz")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
        reason = ready.json()["reason"]
        assert ready.json()["status"] == "unhealthy"
        assert reason.startswith("encode stage has held one item for ") and reason.endswith(
            f"(server.stall_s {STALL_S:g})")
        assert http.get("/healthz").status_code == 503
        report = http.get("/v1/status").json()
        assert report["health"]["ok"] is False and report["health"]["reason"].startswith("encode stage has held")
        shown = dict(line.split(None, 1) for line in render({**report, "socket": path}) if line.startswith("health"))
        assert shown["health"].startswith("UNHEALTHY: encode stage has held one item for ")  # edgemm status
        assert metric(http.get("/metrics").text, "edgemm_ready") == 0
        hold.release.set()
        expect(notify, lambda m: "WATCHDOG=1" in m, "pings again after the stage recovered")
        thread.join(WAIT_S)
        assert out[0].status_code == 200
        assert http.get("/readyz").status_code == 200
        assert http.get("/v1/status").json()["health"]["ok"] is True


class StageKilled(BaseException):
    """Not an Exception: no barrier catches it, so it ends the stage's thread."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_stage_thread_stops_the_watchdog(runtime, samples, monkeypatch, notify):
    def kill(route, finished, steps_by_rows=None):
        raise StageKilled("the decode thread ends here")
    with running(runtime, stall_s=60, request_timeout_s=1.0, grace_period_s=1.0, **FAST) as d, \
            raw_client(sock_path(d)) as http:
        path = sock_path(d)
        expect(notify, lambda m: "WATCHDOG=1" in m, "WATCHDOG=1 while healthy")
        monkeypatch.setattr(runtime, "open_batch", kill)
        assert_error(infer(path, samples[NORMAL_IMAGES[0]]), 504)  # its thread died holding it
        unhealthy_at, message = expect(notify, lambda m: "decode stage thread died" in m, "the death reported")
        assert "WATCHDOG=1" not in message
        for _ in range(3):
            expect(notify, lambda m: "decode stage thread died" in m, "another unhealthy beat")
        assert not [t for t in notify.pings() if t > unhealthy_at]
        ready = http.get("/readyz")
        assert ready.status_code == 503 and ready.json() == {"status": "unhealthy",
                                                             "reason": "decode stage thread died"}
        assert "decode stage thread died" in d.service.status_line()


# ---- the command line ----------------------------------------------------------------------

def test_edgemm_infer_exits_1_with_one_line_on_an_internal_error(model_dir, monkeypatch):
    from click.testing import CliRunner

    import edgemm.engine.runtime
    from edgemm.cli.main import main

    def broken(self, *args, **kwargs):
        raise Injected(INJECTED)
    # prepare: the one-shot's first call into the Runtime (it has no warm-up that calls infer)
    monkeypatch.setattr(edgemm.engine.runtime.Runtime, "prepare", broken)
    result = CliRunner().invoke(main, ["infer", str(model_dir / "samples" / NORMAL_IMAGES[0])])
    assert result.exit_code == 1
    assert result.output == \
        f"edgemm: error: internal error: Injected: {ONE_LINE} (set EDGEMM_DEBUG=1 for a traceback)\n"


def test_a_failing_encoder_batch_is_retried_image_by_image(runtime, samples, monkeypatch):
    """A bad image that shares an encoder call with good ones fails alone: the call is
    repeated for each image by itself."""
    marker, encode = poison_pixels(runtime, samples), runtime.encode
    first_call, shapes = Hold(), []

    def encode_once_held(pixels, keys=None, route=None):
        shapes.append(len(pixels))
        if len(shapes) == 1:
            first_call.wait()  # the others queue up behind the first: the next call is their batch
        if any(np.array_equal(row, marker) for row in pixels):
            raise Injected(INJECTED)
        return encode(pixels, keys, route)
    good = [(samples[name], prompt) for name in NORMAL_IMAGES for prompt in PROMPTS[:1]]
    alone = [runtime.infer(image, prompt, max_new_tokens=MAX_TOKENS).tokens for image, prompt in good]
    monkeypatch.setattr(runtime, "encode", encode_once_held)
    with Pipeline(runtime, queue_size=8, max_batch=4, batch_timeout_ms=50, encoder_batch={"high": 4}) as pipeline:
        opener = pipeline.submit(Request(*good[0], {"max_new_tokens": MAX_TOKENS}))
        assert first_call.entered.wait(WAIT_S)
        rest = [pipeline.submit(Request(image, prompt, {"max_new_tokens": MAX_TOKENS}))
                for image, prompt in [(samples[POISON_IMAGE], PROMPTS[0])] + good]
        wait_until(lambda: pipeline.to_encode.qsize() == len(rest), WAIT_S, "the rest prepared")
        first_call.release.set()
        assert opener.result(WAIT_S).tokens == alone[0]
        with pytest.raises(Injected):
            rest[0].result(WAIT_S)
        assert [f.result(WAIT_S).tokens for f in rest[1:]] == alone
    assert shapes == [1, 3, 1, 1, 1]  # the batch of three failed, then each image alone
