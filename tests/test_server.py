"""`edgemm serve`: a real daemon on a temporary UNIX socket, and real clients.

Most tests talk to daemons running in a thread of this process (sharing the session's
runtime, so the model loads once): the official `openai` client through a UNIX-socket
transport, and raw httpx. Overload, timeout and disconnect use a daemon whose encoder
waits on a gate, so "the pipeline is busy" is a state, not a race. Lifecycle tests
(SIGTERM, socket activation, sd_notify, a model that fails to load) run `edgemm serve`
as a subprocess. No test depends on what the (placeholder) model answers.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import grp
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from edgemm.config import Config, ServerConfig, StreamConfig, load_config
from edgemm.server.daemon import Daemon, bind_unix
from edgemm.server.errors import ApiError, ListenError
from edgemm.util.prometheus import Counter, Gauge, Histogram, Registry
from edgemm.server.protocol import parse_chat_request
from edgemm.errors import Overloaded
from edgemm.server.inference_routes import infer_query
from edgemm.server.service import Admission, TokenFeed

REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny-vlm"
PROMPT = "how many shapes are there ?"


# ---- helpers -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sample(model_dir) -> Path:
    return model_dir / "samples" / "scene_11.png"


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def user_message(url: str, text: str = PROMPT) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def short_dir() -> Path:
    """A fresh folder with a short path: AF_UNIX socket paths must fit in 107 bytes."""
    return Path(tempfile.mkdtemp(prefix="edgemm-", dir="/tmp"))


@contextlib.contextmanager
def running(runtime, sections: dict | None = None, **server) -> Iterator[Daemon]:
    """A daemon in a thread, serving `runtime` on a fresh socket; drained and stopped at the end."""
    folder = short_dir()
    cfg = load_config({"backend": {"intra_op_threads": 1}, **(sections or {}),
                       "server": {"socket": str(folder / "edgemm.sock"), **server}})
    daemon = Daemon(cfg, runtime=runtime)
    thread = threading.Thread(target=daemon.run, name="test-daemon", daemon=True)
    thread.start()
    try:
        assert daemon.ready.wait(30), "the daemon did not become ready"
        yield daemon
    finally:
        daemon.stop()
        thread.join(30)
        shutil.rmtree(folder, ignore_errors=True)
    assert not thread.is_alive(), "the daemon did not stop"


def sock_path(daemon: Daemon) -> str:
    return daemon.config.server.socket


def raw_client(path: str, timeout: float = 30.0) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://edgemm", timeout=timeout)


def openai_client(path: str) -> openai.OpenAI:
    """The official client over the UNIX socket, as the README shows it."""
    http_client = httpx.Client(transport=httpx.HTTPTransport(uds=path))
    return openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=http_client, max_retries=0)


def metric(text: str, line_start: str, default: float | None = None) -> float:
    """The value of the first sample line starting with `line_start` in Prometheus text
    (`default` if there is none and a default is given)."""
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"no sample {line_start!r} in /metrics")


def wait_until(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def assert_error(response: httpx.Response, status: int, code: str | None = None,
                 param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"]
    assert isinstance(error["type"], str)
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- the main daemon: the session runtime, file:// from the samples folder, TCP on -------

@pytest.fixture(scope="module")
def daemon(runtime, model_dir) -> Iterator[Daemon]:
    group = grp.getgrgid(os.getgid()).gr_name
    with running(runtime, image_dirs=[str(model_dir / "samples")], max_body_bytes=1024 * 1024,
                 tcp_port=0, socket_group=group) as d:
        yield d


@pytest.fixture
def http(daemon) -> Iterator[httpx.Client]:
    with raw_client(sock_path(daemon)) as client:
        yield client


@pytest.fixture
def client(daemon) -> openai.OpenAI:
    return openai_client(sock_path(daemon))


def test_openai_client_plain_completion(client, sample):
    answer = client.chat.completions.create(model=MODEL, messages=user_message(data_url(sample)),
                                            max_tokens=4, temperature=0)
    assert answer.object == "chat.completion" and answer.model == MODEL
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    extras = answer.model_dump()["edgemm"]
    # the built-in model ships its calibration, so the scheduler's default policy is calibrated
    assert extras["tier"] == extras["schedule"]["tier"] and extras["schedule"]["policy"] == "calibrated"
    assert extras["precision"] == "q4"  # auto: the built-in model's q4 on a CPU
    assert {"preprocess", "encode", "prefill", "decode", "total"} <= set(extras["timings_ms"])


def test_openai_client_streaming(client, sample):
    request = dict(model=MODEL, messages=user_message(data_url(sample)), max_tokens=6,
                   temperature=0.9, seed=3)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert "timings_ms" in with_choices[-1].model_dump()["edgemm"]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in with_choices)
    plain = client.chat.completions.create(**request)  # same seed: the same answer, however long
    assert streamed == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_stream_is_server_sent_events_ending_with_done(http, sample):
    body = {"model": MODEL, "messages": user_message(data_url(sample)), "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["object"] == "chat.completion.chunk" for line in events[:-1])


def test_a_streamed_answer_waiting_between_its_tokens_sends_keepalives(http, sample, monkeypatch):
    """No token for sse.KEEPALIVE_S after the first: a keepalive comment, which
    clients skip, and the answer whole after it. The decoder is held after its first token
    until the comment has come, so no timing decides the test."""
    monkeypatch.setattr("edgemm.server.sse.KEEPALIVE_S", 0.02)
    kept_alive, real_push, pushes = threading.Event(), TokenFeed.push, []

    def held_push(feed: TokenFeed, text: str | None, finished: bool = False) -> None:
        pushes.append(text)
        if len(pushes) == 2:
            kept_alive.wait(10)
        real_push(feed, text, finished)

    monkeypatch.setattr(TokenFeed, "push", held_push)
    body = {"model": MODEL, "messages": user_message(data_url(sample)), "max_tokens": 4, "temperature": 0}
    lines = []
    try:
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                lines.append(line)
                if line == ": keepalive":
                    kept_alive.set()
    finally:
        kept_alive.set()
    assert ": keepalive" in lines
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == len([line for line in lines if line and line[0] != ":"])
    chunks = [json.loads(event[6:]) for event in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    monkeypatch.setattr(TokenFeed, "push", real_push)
    assert streamed == http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "edgemm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_openai_client_sees_errors_as_its_exceptions(client, sample):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "no image"}])
    assert info.value.code == "missing_image"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=user_message(data_url(sample)))


def test_infer_raw_image_body(http, sample):
    response = http.post("/v1/infer", params={"prompt": PROMPT, "max_tokens": 3, "tier": "low"},
                         content=sample.read_bytes())
    assert response.status_code == 200, response.text
    out = response.json()
    assert isinstance(out["answer"], str) and out["prompt"] == PROMPT
    assert out["tier"] == "low" and len(out["tokens"]) <= 3
    assert {"encode", "decode", "total"} <= set(out["timings_ms"])


def test_file_url_under_an_allowed_folder(http, sample):
    body = {"messages": user_message(sample.as_uri()), "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_health_and_readiness(http):
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready" and ready.json()["model"] == MODEL


def test_metrics(http, sample):
    assert http.post("/v1/infer", params={"max_tokens": 1}, content=sample.read_bytes()).status_code == 200
    steps_before = metric(http.get("/metrics").text, 'edgemm_decoder_steps_total{rows="1"}', default=0)
    answer = http.post("/v1/infer", params={"max_tokens": 3, "prompt": "describe the image"},
                       content=sample.read_bytes()).json()
    answered_tier = answer["tier"]
    http.post("/v1/infer", content=b"")  # a 400
    response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    assert metric(text, 'edgemm_http_requests_total{endpoint="/v1/infer",status="200"}') >= 1
    assert metric(text, 'edgemm_http_requests_total{endpoint="/v1/infer",status="400"}') >= 1
    assert metric(text, 'edgemm_stage_duration_seconds_count{stage="encode"}') >= 1
    assert metric(text, 'edgemm_stage_duration_seconds_bucket{stage="total",le="+Inf"}') >= 1
    assert metric(text, f'edgemm_answers_total{{tier="{answered_tier}"}}') >= 1
    assert metric(text, 'edgemm_queue_depth{stage="encode"}') == 0
    assert metric(text, "edgemm_requests_in_flight") == 0
    assert metric(text, 'edgemm_encoder_recent_batches{size="1"}') >= 1
    assert metric(text, "edgemm_ready") == 1
    # a lone request steps alone: one decoder call per token after the first (3 tokens, or fewer and a stop)
    steps = len(answer["tokens"]) - (answer["finish_reason"] == "length")
    assert metric(text, 'edgemm_decoder_steps_total{rows="1"}', default=0) - steps_before == steps
    assert "# TYPE edgemm_http_request_duration_seconds histogram" in text


def test_socket_file_is_0660_and_owned_by_the_group(daemon):
    info = os.stat(sock_path(daemon))
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o660
    assert info.st_gid == os.getgid()


def test_tcp_listens_on_loopback_only_when_configured(daemon):
    tcp = [listener for listener in daemon.listeners if listener.sock.family == socket.AF_INET]
    assert len(tcp) == 1
    host, port = tcp[0].sock.getsockname()
    assert host == "127.0.0.1"
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json() == {"status": "ok"}


# ---- bad input: the right status, OpenAI's error shape, and the daemon keeps serving ------

def chat(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 2, **fields}


def good_image(sample: Path) -> list[dict]:
    return user_message(data_url(sample))


def with_image(url: str, text: str = PROMPT, **fields) -> dict:
    return {"json": chat(messages=user_message(url, text), **fields)}


def encoded(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


CHAT, INFER = "/v1/chat/completions", "/v1/infer"
BAD_REQUESTS = {
    # name: (method, path, request kwargs from the sample image's path, status, code, param)
    "malformed JSON": ("POST", CHAT, lambda s: {"content": b'{"messages": ['}, 400, None, None),
    "not UTF-8": ("POST", CHAT, lambda s: {"content": b"\xff\xfe"}, 400, None, None),
    "body not an object": ("POST", CHAT, lambda s: {"json": [1, 2]}, 400, None, None),
    "no messages": ("POST", CHAT, lambda s: {"json": chat()}, 400, None, "messages"),
    "max_tokens not a number": ("POST", CHAT, lambda s: with_image(data_url(s), max_tokens="ten"),
                                400, None, "max_tokens"),
    "max_tokens out of range": ("POST", CHAT, lambda s: with_image(data_url(s), max_tokens=0), 400, None, "max_tokens"),
    "top_p out of range": ("POST", CHAT, lambda s: with_image(data_url(s), top_p=1.5), 400, None, "top_p"),
    "max_completion_tokens out of range": ("POST", CHAT, lambda s: with_image(data_url(s), max_completion_tokens=5000),
                                           400, None, "max_completion_tokens"),
    "temperature too small to sample": ("POST", CHAT, lambda s: with_image(data_url(s), temperature=1e-300),
                                        400, None, "temperature"),
    "seed beyond 64 bits": ("POST", CHAT, lambda s: with_image(data_url(s), seed=2**64), 400, None, "seed"),
    "temperature NaN": ("POST", CHAT, lambda s: {"content": json.dumps(with_image(data_url(s), temperature=math.nan)[
        "json"]).encode(), "headers": {"content-type": "application/json"}}, 400, None, "temperature"),
    "infer with temperature inf": ("POST", INFER, lambda s: {"content": s.read_bytes(),
                                                             "params": {"temperature": "inf"}}, 400, None, "temperature"),
    "bad role": ("POST", CHAT, lambda s: {"json": chat(messages=[{"role": "robot", "content": "hi"}])},
                 400, None, "messages[0].role"),
    "unsupported part": ("POST", CHAT, lambda s: {"json": chat(messages=[
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])},
        400, None, "messages[0].content[0].type"),
    "body over the limit": ("POST", CHAT, lambda s: {"content": b"x" * (3 * 1024 * 1024)},
                            413, "request_too_large", None),
    "missing image": ("POST", CHAT, lambda s: {"json": chat(messages=[{"role": "user", "content": PROMPT}])},
                      400, "missing_image", None),
    "two images in one message": ("POST", CHAT, lambda s: {"json": chat(messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(s)}}] * 2}])},
        400, None, None),
    "data URL not base64": ("POST", CHAT, lambda s: with_image("data:image/png;base64,@@@"),
                            400, "invalid_image_url", "messages[0].content[1].image_url.url"),
    "data URL without base64": ("POST", CHAT, lambda s: with_image("data:image/png,abc"),
                                400, "invalid_image_url", None),
    "data URL not an image": ("POST", CHAT, lambda s: with_image(encoded(b"not an image")), 400, None, None),
    "file outside the allowed folders": ("POST", CHAT, lambda s: with_image("file:///etc/passwd"),
                                         403, "path_not_allowed", None),
    "file escaping with ..": ("POST", CHAT, lambda s: with_image(s.parent.as_uri() + "/../model.yaml"),
                              403, "path_not_allowed", None),
    "http URL while remote images are off": ("POST", CHAT, lambda s: with_image("http://127.0.0.1:9/a.png"),
                                             400, "url_scheme_not_allowed", None),
    "ftp URL": ("POST", CHAT, lambda s: with_image("ftp://example.invalid/a.png"),
                400, "url_scheme_not_allowed", None),
    "unknown model": ("POST", CHAT, lambda s: with_image(data_url(s), model="gpt-4o"),
                      404, "model_not_found", "model"),
    "unknown tier": ("POST", CHAT, lambda s: with_image(data_url(s), edgemm={"tier": "ultra"}), 400, None, None),
    "prompt too long": ("POST", CHAT, lambda s: with_image(data_url(s), "x " * 3000), 400, None, None),
    "streamed request with an image that does not decode": (
        "POST", CHAT, lambda s: with_image(encoded(b"GIF89a"), stream=True), 400, None, None),
    "infer without an image": ("POST", INFER, lambda s: {"content": b""}, 400, "missing_image", None),
    "infer with a bad number": ("POST", INFER, lambda s: {"content": s.read_bytes(), "params": {"max_tokens": "x"}},
                                400, None, "max_tokens"),
    "infer with an unknown parameter": ("POST", INFER, lambda s: {"content": s.read_bytes(), "params": {"promt": "x"}},
                                        400, None, "promt"),
    "wrong method": ("GET", CHAT, lambda s: {}, 405, None, None),
    "unknown path": ("GET", "/v2/nothing", lambda s: {}, 404, None, None),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_gets_its_status_and_the_daemon_keeps_serving(daemon, sample, name):
    method, path, kwargs, status, code, param = BAD_REQUESTS[name]
    with raw_client(sock_path(daemon)) as http:  # a fresh connection: a 413 closes its own
        assert_error(http.request(method, path, **kwargs(sample)), status, code, param)
    with raw_client(sock_path(daemon)) as http:
        ok = http.post("/v1/infer", params={"max_tokens": 1}, content=sample.read_bytes())
        assert ok.status_code == 200, ok.text
        assert metric(http.get("/metrics").text, "edgemm_requests_in_flight") == 0


# ---- remote images, when enabled -------------------------------------------------------------

@pytest.fixture(scope="module")
def image_server(model_dir) -> Iterator[str]:
    """A local HTTP server (127.0.0.1) serving the samples folder."""
    handler = type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                             lambda *a: handler(*a, directory=str(model_dir / "samples")))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_image_urls_when_enabled(runtime, image_server, sample):
    with running(runtime, remote_images=True) as d, raw_client(sock_path(d)) as http:
        ok = http.post("/v1/chat/completions", json=chat(messages=user_message(f"{image_server}/{sample.name}")))
        assert ok.status_code == 200, ok.text
        missing = http.post("/v1/chat/completions", json=chat(messages=user_message(f"{image_server}/nope.png")))
        assert "HTTP 404" in assert_error(missing, 400, "image_fetch_failed")["message"]


# ---- a busy pipeline: overload, timeout, a client that leaves ----------------------------

class Gate:
    """Holds every encoder call until opened, so a busy pipeline is a state, not a race."""

    def __init__(self, runtime):
        self.opened = threading.Event()
        self._encode = runtime.encode
        runtime.encode = self.encode

    def encode(self, pixels, keys=None, route=None):
        self.opened.wait(30)
        return self._encode(pixels, keys, route)


@pytest.fixture(scope="module")
def gated(make_runtime):
    runtime = make_runtime()
    return runtime, Gate(runtime)


@pytest.fixture
def gate(gated) -> Iterator[Gate]:
    runtime, gate = gated
    gate.opened.clear()
    yield gate
    gate.opened.set()  # never leave a daemon waiting on it


def in_background(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    return thread, out


def get_metrics(path: str) -> str:
    with raw_client(path) as http:
        return http.get("/metrics").text


def post_infer(path: str, image: bytes) -> httpx.Response:
    with raw_client(path) as http:
        return http.post("/v1/infer", params={"max_tokens": 1}, content=image)


def test_overload_gets_503_with_retry_after_quickly(gated, gate, sample):
    runtime, _ = gated
    image = sample.read_bytes()
    with running(runtime, queue_size=2, max_batch=1, retry_after_s=2) as d:
        path = sock_path(d)
        waiting = [in_background(post_infer, path, image) for _ in range(2)]
        wait_until(lambda: d.service.admission.count == 2, what="two requests in flight")
        started = time.perf_counter()
        refused = post_infer(path, image)
        assert time.perf_counter() - started < 1.0
        assert assert_error(refused, 503)["type"] == "overloaded"
        assert refused.headers["retry-after"] == "2"
        with raw_client(path) as http:  # health answers while the pipeline is full
            assert http.get("/healthz").status_code == 200
            assert metric(http.get("/metrics").text, "edgemm_requests_in_flight") == 2
        gate.opened.set()
        for thread, out in waiting:
            thread.join(30)
            assert out[0].status_code == 200, out[0].text
        assert post_infer(path, image).status_code == 200


def test_timeout_gets_504_and_frees_its_slot_when_the_work_ends(gated, gate, sample):
    runtime, _ = gated
    with running(runtime, request_timeout_s=0.3) as d:
        path = sock_path(d)
        assert assert_error(post_infer(path, sample.read_bytes()), 504, "timeout")["type"] == "timeout"
        assert d.service.admission.count == 1  # the pipeline still holds it
        gate.opened.set()
        wait_until(lambda: d.service.admission.count == 0, what="the slot back")
        assert post_infer(path, sample.read_bytes()).status_code == 200


def test_client_that_disconnects_does_not_hurt_the_daemon(gated, gate, sample):
    runtime, _ = gated
    with running(runtime) as d:
        path = sock_path(d)
        with raw_client(path, timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=chat(messages=good_image(sample), stream=True))
        wait_until(lambda: 'status="499"' in get_metrics(path), what="a 499 in /metrics")
        gate.opened.set()
        wait_until(lambda: d.service.admission.count == 0, what="the slot back")
        assert post_infer(path, sample.read_bytes()).status_code == 200


def test_an_internal_error_is_a_500_and_the_daemon_goes_on(gated, sample):
    runtime, gate = gated
    gate.opened.set()
    decoder = runtime.generator.decoder

    def broken(*args, **kwargs):
        del decoder.run  # once: the class's run again
        raise RuntimeError("the decoder broke")

    decoder.run = broken
    try:
        with running(runtime) as d:
            error = assert_error(post_infer(sock_path(d), sample.read_bytes()), 500)
            assert error["message"] == "internal error: RuntimeError: the decoder broke"
            assert post_infer(sock_path(d), sample.read_bytes()).status_code == 200
    finally:
        decoder.__dict__.pop("run", None)


# ---- camera streams run by the daemon -----------------------------------------------------

def synthetic(stream_id: str, fps: int = 10) -> dict:
    return {"id": stream_id, "source": f"synthetic://?fps={fps}", "prompt": PROMPT, "tier": "low",
            "max_new_tokens": 1}


def read_events(path: str, stream_id: str, count: int | None = None, timeout: float = 30) -> list[dict]:
    """`count` results of /v1/streams/{id}/events (or all, until the stream ends)."""
    events = []
    with raw_client(path, timeout=timeout) as http, http.stream("GET", f"/v1/streams/{stream_id}/events") as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if count is not None and len(events) >= count:
                    break
    return events


def test_configured_streams_run_and_a_failing_camera_only_retries(runtime):
    streams = [synthetic("synth"), {"id": "cam", "source": "v4l2:///dev/video99"}]
    with running(runtime, {"streams": streams}) as d, raw_client(sock_path(d)) as http:
        events = read_events(sock_path(d), "synth", count=2)
        assert [e["stream"] for e in events] == ["synth", "synth"]
        assert events[1]["frame"] > events[0]["frame"] and events[0]["tier"] == "low"
        assert isinstance(events[0]["answer"], str) and "latency_ms" in events[0]
        listed = {s["id"]: s for s in http.get("/v1/streams").json()["data"]}
        assert listed["synth"]["state"] == "running" and listed["synth"]["frames"] >= 2
        wait_until(lambda: http.get("/v1/streams/cam").json()["retries"] >= 2, what="the camera to be retried")
        cam = http.get("/v1/streams/cam").json()
        assert cam["state"] == "retrying" and "/dev/video99" in cam["last_error"]
        assert http.get("/healthz").status_code == 200
        assert post_infer(sock_path(d), (REPO / "models/tiny-vlm/samples/scene_11.png").read_bytes()).status_code == 200
        text = http.get("/metrics").text
        assert metric(text, 'edgemm_stream_frames_total{stream="synth"}') >= 2
        assert metric(text, 'edgemm_stream_running{stream="cam"}') == 0


def test_streams_added_and_removed_at_run_time(runtime):
    with running(runtime, max_streams=2) as d, raw_client(sock_path(d)) as http:
        path = sock_path(d)
        assert http.get("/v1/streams").json()["data"] == []
        created = http.post("/v1/streams", json=synthetic("door"))
        assert created.status_code == 201 and created.json()["id"] == "door"
        assert http.get("/v1/streams/door").json()["source"] == "synthetic://?fps=10"
        assert_error(http.post("/v1/streams", json=synthetic("door")), 409)
        assert_error(http.post("/v1/streams", json={"id": "files", "source": "/etc"}), 403)
        assert "unknown key 'sorce'" in assert_error(
            http.post("/v1/streams", json={"id": "x", "sorce": "csi://0"}), 400)["message"]
        assert_error(http.post("/v1/streams", json={"id": "x", "source": "gopher://x"}), 400)
        assert http.post("/v1/streams", json=synthetic("yard")).status_code == 201
        assert "max_streams" in assert_error(http.post("/v1/streams", json=synthetic("third")), 409)["message"]
        thread, out = in_background(read_events, path, "door")  # reads until the stream ends
        wait_until(lambda: http.get("/v1/streams/door").json()["listeners"] == 1, what="a listener")
        assert http.delete("/v1/streams/door").json() == {"id": "door", "object": "stream.deleted", "deleted": True}
        thread.join(30)
        assert not thread.is_alive() and all(e["stream"] == "door" for e in out[0])
        assert_error(http.get("/v1/streams/door"), 404)
        assert [s["id"] for s in http.get("/v1/streams").json()["data"]] == ["yard"]
        # the stream is gone, the pipeline it shared is not: the API and the other stream go on
        assert d.service.pipeline.alive() and not d.service.pipeline._closed
        assert post_infer(path, (REPO / "models/tiny-vlm/samples/scene_11.png").read_bytes()).status_code == 200
        done = d.service.streams.get("yard").figures.frames
        wait_until(lambda: d.service.streams.get("yard").figures.frames > done, what="the other stream to go on")


def test_a_folder_stream_from_the_config_ends_after_its_last_image(runtime, model_dir):
    folder = {"id": "samples", "source": str(model_dir / "samples"), "max_new_tokens": 1}
    with running(runtime, {"streams": [folder]}) as d, raw_client(sock_path(d)) as http:
        wait_until(lambda: http.get("/v1/streams/samples").json()["state"] == "ended", what="the folder's end")
        figures = http.get("/v1/streams/samples").json()
        assert figures["frames"] == len(list((model_dir / "samples").glob("*.png"))) and figures["retries"] == 0
        assert read_events(sock_path(d), "samples") == []  # a listener that comes after the end is told at once


class ThreadsPerComponent:
    """Wraps each of a runtime's components to record the threads that call it."""

    def __init__(self, runtime):
        self.threads: dict[str, set[tuple[int, str]]] = {}
        self._lock = threading.Lock()
        for component in runtime.components.all():
            component.run = self._recording(component.name, component.run)

    def _recording(self, name: str, run):
        def recording(feeds):
            with self._lock:
                self.threads.setdefault(name, set()).add((threading.get_ident(), threading.current_thread().name))
            return run(feeds)
        return recording


def test_streams_and_the_api_share_one_pipeline_without_starving_each_other(make_runtime, sample):
    """Two streams (one lossless and unpaced: it always has its share in flight; one live)
    and API clients hammering at the same time, on one daemon: every API request is
    answered (none refused: the streams keep to their shares), both streams go on
    delivering frames, and every component is only ever called from one thread."""
    runtime = make_runtime()  # no warm-up: every component call below is the daemon's
    recorded = ThreadsPerComponent(runtime)
    streams = [synthetic("flood", fps=0), synthetic("camera", fps=20)]
    image = sample.read_bytes()
    # encoder_batching off: no timing calls at start-up, so the only callers are the pipeline's
    with running(runtime, {"streams": streams}, queue_size=2, max_streams=2, encoder_batching="off") as d:
        manager = d.service.streams
        assert manager.pipeline is d.service.pipeline
        frames = {name: lambda name=name: manager.get(name).figures.frames for name in ("flood", "camera")}
        wait_until(lambda: all(f() >= 2 for f in frames.values()), what="both streams to deliver")
        hammering = threading.Event()
        statuses: list[int] = []

        def hammer() -> None:  # one request after another, as fast as answers come
            with raw_client(sock_path(d)) as http:
                while not hammering.is_set():
                    statuses.append(http.post("/v1/infer", params={"max_tokens": 1}, content=image).status_code)

        clients = [threading.Thread(target=hammer, daemon=True) for _ in range(2)]  # = queue_size
        before = {name: f() for name, f in frames.items()}
        for client in clients:
            client.start()
        try:
            wait_until(lambda: len(statuses) >= 10 and all(f() >= before[n] + 3 for n, f in frames.items()),
                       timeout=60, what="API answers and stream frames, at the same time")
        finally:
            hammering.set()
            for client in clients:
                client.join(30)
        assert not any(client.is_alive() for client in clients)
        assert statuses and set(statuses) == {200}, statuses  # no 503: the streams stayed within their shares
        figures = {name: manager.get(name).figures for name in frames}
        assert all(f.errors == 0 and f.state == "running" for f in figures.values()), figures
    threads = recorded.threads
    assert set(threads) == {"vision_encoder", "embed_tokens", "decoder"}
    assert all(len(callers) == 1 for callers in threads.values()), threads
    assert {name for _, name in threads["vision_encoder"]} == {"edgemm-encode"}
    assert threads["embed_tokens"] == threads["decoder"] and {n for _, n in threads["decoder"]} == {"edgemm-decode"}


def test_stopping_the_daemon_ends_stream_listeners(runtime):
    with running(runtime, {"streams": [synthetic("synth")]}) as d:
        thread, out = in_background(read_events, sock_path(d), "synth")
        wait_until(lambda: d.service.streams.get("synth").listeners, what="a listener")
        d.stop()
        thread.join(30)
        assert not thread.is_alive()


# ---- units: schema parsing, admission, metrics text, the socket file ----------------------

def test_relative_image_dirs_are_next_to_the_config_file(tmp_path):
    (tmp_path / "edgemm.yaml").write_text("server:\n  image_dirs: [images, /srv/photos]\n")
    cfg = load_config(tmp_path / "edgemm.yaml")
    assert cfg.server.image_dirs == [str(tmp_path.resolve() / "images"), "/srv/photos"]
    assert cfg.server.mode == 0o660


def test_conversation_maps_to_the_last_user_question_and_image():
    chat_request = parse_chat_request({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                     {"type": "text", "text": "first question"}]},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "  what color is the circle ? "}],
        "max_completion_tokens": 5, "temperature": 0, "seed": 1, "edgemm": {"tier": "low"}})
    assert chat_request.prompt == "what color is the circle ?"
    assert chat_request.image_url == "data:image/png;base64,AAAA"
    assert chat_request.image_param == "messages[1].content[0].image_url.url"
    assert chat_request.options == {"max_new_tokens": 5, "temperature": 0.0, "seed": 1, "tier": "low"}


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages[0].content[0].image_url"),
    ({"messages": [{"role": "user", "content": "q"}], "temperature": True}, "temperature"),
    ({"messages": [{"role": "user", "content": "q"}], "seed": -1}, "seed"),
    ({"messages": [{"role": "user", "content": "q"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "q"}], "stream": "yes"}, "stream"),
])
def test_schema_errors_name_the_field(body, param):
    with pytest.raises(ApiError) as info:
        parse_chat_request(body)
    assert info.value.http_status == 400 and info.value.param == param


def test_infer_query_parameters():
    assert infer_query({"prompt": "hi", "max_tokens": "3", "top_p": "0.5", "tier": "mid"}) == \
        ("hi", {"max_new_tokens": 3, "top_p": 0.5, "tier": "mid"})
    with pytest.raises(ApiError, match="'temperature' must be a number"):
        infer_query({"temperature": "warm"})


def test_admission_is_bounded_and_tickets_release_once():
    admission = Admission(2)
    first = admission.enter(1)
    admission.enter(1)  # the second place, held to the end
    with pytest.raises(Overloaded):
        admission.enter(1)
    first.release()
    first.release()
    assert admission.count == 1
    admission.enter(1)
    assert admission.count == 2


def test_prometheus_text():
    registry = Registry()
    requests = registry.add(Counter("t_requests_total", "Requests.", ("path",)))
    latency = registry.add(Histogram("t_seconds", "Latency.", ("stage",), (0.1, 1)))
    registry.add(Gauge("t_depth", "Depth.", (), lambda: {(): 3}))
    requests.inc('a"b')
    for value in (0.05, 0.1, 0.5, 7):
        latency.observe(value, "x")
    lines = registry.render().splitlines()
    assert 't_requests_total{path="a\\"b"} 1' in lines
    assert lines.count("# TYPE t_seconds histogram") == 1
    assert 't_seconds_bucket{stage="x",le="0.1"} 2' in lines  # le is inclusive
    assert 't_seconds_bucket{stage="x",le="1"} 3' in lines
    assert 't_seconds_bucket{stage="x",le="+Inf"} 4' in lines
    assert 't_seconds_count{stage="x"} 4' in lines and 't_seconds_sum{stage="x"} 7.65' in lines
    assert "t_depth 3" in lines


def test_socket_file_rules():
    folder = short_dir()
    try:
        path = str(folder / "s.sock")
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(path)
        stale.close()  # the file stays, nobody listens: what a crash leaves
        live = bind_unix(path, 0o660, None)  # replaces the stale one
        with pytest.raises(ListenError, match="in use"):
            bind_unix(path, 0o660, None)
        live.close()
        assert not os.path.exists(path)
        (folder / "file").write_text("x")
        with pytest.raises(ListenError, match="not a socket"):
            bind_unix(str(folder / "file"), 0o660, None)
        with pytest.raises(ListenError, match="unknown group"):
            bind_unix(path, 0o660, "no-such-group-edgemm")
        assert not os.path.exists(path)
        with pytest.raises(ListenError, match="cannot create socket"):
            bind_unix(str(folder / "missing" / "s.sock"), 0o660, None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---- the daemon as a process: SIGTERM, socket activation, sd_notify, load failure -----------

SLOW_ENCODER = """
import os, sys, time
from edgemm.engine.runtime import Runtime
encode = Runtime.encode
def slow(self, pixels, keys=None, route=None):
    time.sleep(float(os.environ["SLOW_ENCODE_S"]))
    return encode(self, pixels, keys, route)
Runtime.encode = slow
from edgemm.cli.main import main
main(sys.argv[1:], prog_name="edgemm")
"""

# What systemd does for a socket unit: the listening socket as fd 3, LISTEN_FDS=1 and
# LISTEN_PID = the pid of the process that is to take it (known only after exec).
SOCKET_ACTIVATE = """
import os, sys
os.dup2(int(sys.argv[1]), 3)
os.environ.update(LISTEN_FDS="1", LISTEN_PID=str(os.getpid()))
os.execv(sys.executable, [sys.executable, "-m", "edgemm.cli.main", *sys.argv[2:]])
"""


def child_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EDGEMM_", "LISTEN_", "NOTIFY_", "WATCHDOG_"))}
    return {**env, **extra}


def write_config(folder: Path, **server) -> Path:
    path = folder / "edgemm.yaml"
    path.write_text(yaml.safe_dump({"backend": {"intra_op_threads": 1, "warmup": False}, "server": server}))
    return path


def wait_ready(path: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    def ready() -> bool:
        assert proc.poll() is None, f"the daemon exited: {proc.communicate()[1]}"
        with contextlib.suppress(httpx.TransportError), raw_client(path, timeout=2) as http:
            return http.get("/readyz").status_code == 200
        return False
    wait_until(ready, timeout, "the daemon to be ready")


@pytest.fixture
def folder() -> Iterator[Path]:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_sigterm_drains_requests_in_flight_and_exits_0(folder, sample):
    path = str(folder / "edgemm.sock")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_ENCODER, "serve", "--config",
                             str(write_config(folder)), "--socket", path],
                            env=child_env(SLOW_ENCODE_S="2.0"), stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(path, proc)
        thread, out = in_background(post_infer, path, sample.read_bytes())
        with raw_client(path) as http:
            wait_until(lambda: metric(http.get("/metrics").text, "edgemm_requests_in_flight") == 1,
                       what="a request in flight")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.4)
        with pytest.raises(httpx.TransportError), raw_client(path, timeout=2) as http:
            http.get("/healthz")  # no longer accepting
        thread.join(30)
        assert out[0].status_code == 200, out[0].text  # ... but the request in flight was answered
        assert proc.wait(30) == 0
        assert "SIGTERM: finishing 1 requests in flight" in proc.stderr.read()
        assert not os.path.exists(path)
    finally:
        proc.kill()
        proc.wait()


def test_socket_activation_and_sd_notify(folder, sample):
    path, notify_path = str(folder / "activated.sock"), str(folder / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(60)
    config = write_config(folder, socket=str(folder / "unused.sock"))
    proc = subprocess.Popen([sys.executable, "-c", SOCKET_ACTIVATE, str(listener.fileno()), "serve",
                             "--config", str(config)], pass_fds=[listener.fileno()],
                            env=child_env(NOTIFY_SOCKET=notify_path, WATCHDOG_USEC="200000"),
                            stderr=subprocess.PIPE, text=True)
    listener.close()  # the daemon holds it now, as it would hold systemd's
    try:
        messages = [notify.recv(4096).decode()]
        while not any("READY=1" in m for m in messages):
            messages.append(notify.recv(4096).decode())
        ready = next(m for m in messages if "READY=1" in m)
        assert "STATUS=ready: tiny-vlm" in ready and "systemd socket" in ready
        with raw_client(path) as http:
            assert http.get("/readyz").status_code == 200
            assert http.post("/v1/infer", params={"max_tokens": 1}, content=sample.read_bytes()).status_code == 200
        pings = 0
        while pings < 2:  # WATCHDOG_USEC=0.2 s: a ping every 0.1 s
            pings += "WATCHDOG=1" in notify.recv(4096).decode()
        proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in notify.recv(4096).decode():
            pass
        assert proc.wait(30) == 0
        assert os.path.exists(path)  # the socket is systemd's: the daemon leaves it in place
        assert not os.path.exists(folder / "unused.sock")  # and binds nothing of its own
    finally:
        proc.kill()
        proc.wait()
        notify.close()


def test_a_model_that_fails_to_load_fails_the_start(folder):
    path = str(folder / "edgemm.sock")
    result = subprocess.run([sys.executable, "-m", "edgemm.cli.main", "serve", "--config", str(write_config(folder)),
                             "--socket", path, "--model", str(folder / "no-model")],
                            env=child_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    last = result.stderr.splitlines()[-1]  # after serve's progress lines (listening on …)
    assert last.startswith("edgemm: error: ") and "no-model" in last
    assert "Traceback" not in result.stderr
    assert not os.path.exists(path)


# ---- edgemm serve outside systemd: a socket it can create, or TCP ---------------------------

def serve_process(args: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgemm.cli.main", "serve", *args], env=child_env(**env),
                            stderr=subprocess.PIPE, text=True)


def read_until(proc: subprocess.Popen, pattern: str, timeout: float = 60) -> tuple[re.Match, str]:
    """Read the daemon's stderr line by line until `pattern` matches; (the match, all read)."""
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"the daemon ended before {pattern!r}: {seen}")
        seen += line
        found = re.search(pattern, line)
        if found:
            return found, seen
    raise AssertionError(f"no {pattern!r} in time: {seen}")


def stop_process(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.path.isdir("/run/edgemm"), reason="/run/edgemm exists here: it is the first choice")
def test_serve_without_a_socket_configured_uses_xdg_runtime_dir(folder, sample):
    proc = serve_process(["--config", str(write_config(folder))], XDG_RUNTIME_DIR=str(folder))
    try:
        path = str(folder / "edgemm.sock")
        read_until(proc, rf"edgemm: info: listening on {re.escape(path)}$")
        read_until(proc, r"edgemm: info: ready in \d+\.\d s: tiny-vlm \(q4\) on ")
        with raw_client(path) as http:
            assert http.get("/readyz").status_code == 200
            assert http.post("/v1/infer", params={"max_tokens": 1}, content=sample.read_bytes()).status_code == 200
        status = subprocess.run([sys.executable, "-m", "edgemm.cli.main", "status", "--json"], capture_output=True,
                                text=True, env=child_env(XDG_RUNTIME_DIR=str(folder)), timeout=60)
        assert json.loads(status.stdout)["daemon"] == "serving"  # the client finds the same socket
        assert stop_process(proc) == 0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.path.isdir("/run/edgemm"), reason="/run/edgemm exists here: it is the first choice")
def test_serve_with_no_socket_to_create_says_so_in_one_line(folder):
    env = child_env()
    env.pop("XDG_RUNTIME_DIR", None)
    result = subprocess.run([sys.executable, "-m", "edgemm.cli.main", "serve", "--config", str(write_config(folder))],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgemm: error: no socket to create: "), result.stderr
    assert "--socket PATH" in lines[0] and "$XDG_RUNTIME_DIR is not set" in lines[0]


def test_serve_on_a_tcp_port_answers_on_loopback_only(folder, sample):
    proc = serve_process(["--config", str(write_config(folder)), "--port", "0"], XDG_RUNTIME_DIR=str(folder))
    try:
        found, _ = read_until(proc, r"listening on http://([\d.]+):(\d+)$")
        host, port = found.group(1), int(found.group(2))
        assert host == "127.0.0.1"
        read_until(proc, r"ready in \d+\.\d s")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            assert http.get("/readyz").status_code == 200
            answer = http.post("/v1/infer", params={"max_tokens": 2}, content=sample.read_bytes())
            assert answer.status_code == 200 and answer.json()["tokens"]
        assert not (folder / "edgemm.sock").exists()  # --port alone: TCP only, no UNIX socket
        assert stop_process(proc) == 0
    finally:
        proc.kill()
        proc.wait()


def test_serve_host_without_port_is_a_usage_error(folder):
    result = subprocess.run([sys.executable, "-m", "edgemm.cli.main", "serve", "--host", "127.0.0.1"],
                            env=child_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--host needs --port" in result.stderr


# ---- prompts the model cannot read -----------------------------------------------------------

UNREADABLE = "What is in this picture?"


def test_unknown_words_warn_in_the_api_answers(http, client, sample):
    raw = http.post("/v1/infer", params={"prompt": UNREADABLE, "max_tokens": 2}, content=sample.read_bytes())
    assert raw.status_code == 200
    [warning] = raw.json()["warnings"]
    assert "'this', 'picture'" in warning and "how many shapes are there ?" in warning
    answer = client.chat.completions.create(model=MODEL, messages=user_message(data_url(sample), UNREADABLE),
                                            max_tokens=2)
    assert answer.model_dump()["edgemm"]["warnings"] == [warning]
    known = client.chat.completions.create(model=MODEL, messages=user_message(data_url(sample)), max_tokens=2)
    assert known.model_dump()["edgemm"]["warnings"] == []


def test_unknown_words_are_a_400_when_refused(make_runtime, sample):
    with running(make_runtime(limits={"unknown_words": "refuse"})) as daemon, raw_client(sock_path(daemon)) as http:
        refused = http.post("/v1/infer", params={"prompt": UNREADABLE}, content=sample.read_bytes())
        assert "limits.unknown_words: refuse" in assert_error(refused, 400)["message"]
        chatted = http.post("/v1/chat/completions", json=chat(messages=user_message(data_url(sample), UNREADABLE)))
        assert "'picture'" in assert_error(chatted, 400)["message"]
        assert http.post("/v1/infer", params={"prompt": PROMPT, "max_tokens": 1},
                         content=sample.read_bytes()).status_code == 200  # and it keeps serving


# ---- the systemd units and the documented config ------------------------------------------

def test_the_default_config_documents_every_server_and_stream_key():
    text = (REPO / "systemd" / "edgemm.yaml").read_text()
    assert load_config(REPO / "systemd" / "edgemm.yaml") == Config()
    for f in dataclasses.fields(ServerConfig):
        assert f"\n  {f.name}: " in text, f"server.{f.name} is not documented"
    for f in dataclasses.fields(StreamConfig):
        assert re.search(rf"\n#[ -]+{f.name}: ", text), f"streams[].{f.name} is not documented"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze not installed (Debian package 'systemd'; .ci/run installs it)")
def test_systemd_units_verify(tmp_path):
    for name in ("edgemm.service", "edgemm.socket"):
        shutil.copy(REPO / "systemd" / name, tmp_path / name)
    service = tmp_path / "edgemm.service"
    # verify checks that ExecStart's program exists: point it at this environment's edgemm,
    # since /usr/local/bin/edgemm exists only once installed. Everything else is verified as shipped.
    executable = Path(sys.executable).parent / "edgemm"
    executable = str(executable) if executable.exists() else shutil.which("edgemm")
    assert executable, "no edgemm executable in this environment"
    text = service.read_text()
    assert "ExecStart=/usr/local/bin/edgemm serve --config /etc/edgemm/edgemm.yaml" in text
    service.write_text(text.replace("/usr/local/bin/edgemm", executable))
    result = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "edgemm.socket"), str(service)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr  # unknown keys are only warnings: none allowed
    for key in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "User=edgemm", "NoNewPrivileges=yes",
                "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "RuntimeDirectory=edgemm",
                "SupplementaryGroups=video render"):
        assert key in text
    assert "ListenStream=/run/edgemm/edgemm.sock" in (tmp_path / "edgemm.socket").read_text()
