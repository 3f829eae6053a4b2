"""Hostile clients and inputs against a real daemon on a temporary socket, and the CLI.

One test per kind (issue 17): connections that stall in their headers, sit idle, send a
header that never ends, trickle their body, outnumber server.max_connections, or hang up
mid-body; bodies nested deep, integers of thousands of digits, temperatures beyond a
float, lone surrogates and NUL bytes. Each must be refused with its documented status in
OpenAI's error shape (or closed), leave no traceback in the log, and leave the daemon
answering. Timeouts are made small through the config, so nothing waits long; no test
asserts a duration.
"""
from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from test_server import assert_error, in_background, metric, raw_client, running, sock_path, wait_until

from edgemm.cli.main import main
from edgemm.config import load_config
from edgemm.errors import ConfigError, Overloaded
from edgemm.server.connections import BODY_GRACE_S
from edgemm.server.errors import ApiError
from edgemm.server.protocol import json_depth_exceeds, json_values_exceed, parse_json_body

WAIT_S = 30  # bound for anything that should happen "now"; never a timing assumption
SHORT = {"header_timeout_s": 0.5, "idle_timeout_s": 0.5, "request_timeout_s": 2.0, "body_timeout_s": 1.0,
         "max_header_bytes": 4096, "encoder_batching": "off"}


# ---- helpers -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def png(model_dir) -> bytes:
    return (model_dir / "samples" / "scene_11.png").read_bytes()


@pytest.fixture(scope="module")
def images(tmp_path_factory, png) -> Path:
    folder = tmp_path_factory.mktemp("images")
    (folder / "a.png").write_bytes(png)
    return folder


@pytest.fixture(scope="module")
def daemon(runtime, images):
    with running(runtime, **SHORT, image_dirs=[str(images)]) as d:
        yield d


def chat(png: bytes, text: str = "how many shapes are there ?", url: str | None = None, **fields) -> dict:
    url = url or "data:image/png;base64," + base64.b64encode(png).decode()
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                      {"type": "image_url", "image_url": {"url": url}}]}],
            "max_tokens": 2, **fields}


def post_json(path: str, body: bytes, route: str = "/v1/chat/completions") -> httpx.Response:
    with raw_client(path) as http:
        return http.post(route, content=body, headers={"Content-Type": "application/json"})


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(WAIT_S)
    s.connect(path)
    return s


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Everything the daemon sends until it closes: (status, headers, body); (0, {}, b"") if
    it closed without a word."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    if not data:
        return 0, {}, b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def phases(d) -> list[str]:
    """The phase of each connection the daemon has open (edgemm.server.connections)."""
    return [c.phase for c in d._server.server_state.connections]


def openai_error(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    return error


def limited(path: str, reason: str) -> float:
    with raw_client(path) as http:
        return metric(http.get("/metrics").text, f'edgemm_http_connections_limited_total{{reason="{reason}"}}', 0)


def assert_answering(path: str, png: bytes) -> None:
    with raw_client(path) as http:
        wait_until(lambda: metric(http.get("/metrics").text, "edgemm_requests_in_flight") == 0, WAIT_S,
                   "every admission slot back")
        assert http.post("/v1/infer", params={"max_tokens": 2}, content=png).status_code == 200


def protocols(daemon) -> list:
    """The daemon's open connections (uvicorn's protocol objects), looked at from the test's
    thread; read again if the event loop changed the set meanwhile."""
    while True:
        try:
            return list(daemon._server.server_state.connections)
        except RuntimeError:  # set changed size during iteration
            pass


@pytest.fixture
def no_tracebacks(caplog):
    caplog.set_level(logging.WARNING)
    yield
    logged = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not logged, [r.getMessage() for r in logged]


# ---- connections -------------------------------------------------------------------------

def test_a_request_line_that_stalls_gets_408_and_is_closed(daemon, png, no_tracebacks):
    path = sock_path(daemon)
    before = limited(path, "header_timeout")
    with connect(path) as s:
        s.sendall(b"POST /v1/chat/completions HT")  # half a request line, then nothing
        status, headers, body = read_response(s)
    assert status == 408 and headers["connection"] == "close"
    assert openai_error(body)["code"] == "header_timeout"
    assert limited(path, "header_timeout") == before + 1
    assert_answering(path, png)


def test_an_idle_connection_is_closed(daemon, png, no_tracebacks):
    path = sock_path(daemon)
    with connect(path) as fresh, connect(path) as kept:
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = kept.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        # neither sends another byte: both are closed without a response
        assert read_response(fresh) == (0, {}, b"")
        assert kept.recv(65536) == b""
    assert limited(path, "idle_timeout") >= 2


def test_a_header_line_without_an_end_is_refused_with_431_unbuffered(daemon, png, no_tracebacks):
    path = sock_path(daemon)
    with connect(path) as s:
        def flood() -> None:  # a 32 MiB header line, until the daemon stops taking it
            try:
                s.sendall(b"GET /healthz HTTP/1.1\r\nX-Bomb: ")
                for _ in range(512):
                    s.sendall(b"a" * 65536)
            except OSError:
                pass
        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        status, headers, body = read_response(s)
        sender.join(WAIT_S)
    assert status == 431 and headers["connection"] == "close"
    assert "server.max_header_bytes" in openai_error(body)["message"]
    assert not sender.is_alive()  # the daemon closed the connection: the rest was never sent
    assert_answering(path, png)


def test_complete_headers_over_the_limit_get_431(daemon, png, no_tracebacks):
    with raw_client(sock_path(daemon)) as http:
        response = http.get("/healthz", headers={"X-Large": "a" * 5000})
    assert_error(response, 431, code="header_too_large")
    assert response.headers["connection"] == "close"


def trickle(s: socket.socket, stop: threading.Event, every_s: float = 0.1) -> threading.Thread:
    """Send one byte of body every `every_s` until `stop` (or the daemon closes)."""
    def send() -> None:
        try:
            while not stop.wait(every_s):
                s.sendall(b"x")
        except OSError:
            pass
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def end_trickles(stop: threading.Event, socks: list[socket.socket], senders: list[threading.Thread]) -> None:
    stop.set()
    for s in socks:
        s.close()
    for sender in senders:
        sender.join(WAIT_S)


def test_a_body_that_trickles_gets_408_within_body_timeout(daemon, png, no_tracebacks):
    path = sock_path(daemon)
    with connect(path) as s:
        s.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        stop = threading.Event()
        sender = trickle(s, stop)
        try:
            status, headers, body = read_response(s)
        finally:
            stop.set()
            sender.join(WAIT_S)
    assert status == 408 and headers["connection"] == "close"
    error = openai_error(body)
    assert error["code"] == "timeout" and "server.body_timeout_s" in error["message"]
    assert_answering(path, png)


def test_trickled_bodies_hold_no_admission_slot(runtime, png, no_tracebacks):
    """queue_size trickled bodies: before, each held a slot until request_timeout_s, and
    every valid request got 503. The body is read before admission now."""
    with running(runtime, queue_size=2, body_timeout_s=30, request_timeout_s=30, encoder_batching="off") as d:
        path = sock_path(d)
        stop = threading.Event()
        held = [connect(path) for _ in range(4)]
        senders = []
        try:
            for s, route in zip(held, ("/v1/infer", "/v1/chat/completions") * 2):
                s.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n".encode())
                senders.append(trickle(s, stop))
            wait_until(lambda: phases(d).count("busy") == 4, WAIT_S, "the four requests in their bodies")
            with raw_client(path) as http:
                for _ in range(3):
                    assert http.post("/v1/infer", params={"max_tokens": 2}, content=png).status_code == 200
            assert d.service.admission.count == 0
        finally:
            end_trickles(stop, held, senders)


def test_stalled_and_idle_connections_over_the_cap_do_not_lock_newcomers_out(runtime, png, no_tracebacks):
    # long timeouts: the stalled connections stay until the cap makes room, not until they time out
    with running(runtime, max_connections=4, header_timeout_s=60, idle_timeout_s=60, encoder_batching="off") as d:
        path = sock_path(d)
        stalled = []
        for i in range(10):
            stalled.append(connect(path))
            if i % 2:
                with contextlib.suppress(OSError):  # an older one may be closed already
                    stalled[-1].sendall(b"GET /heal")  # half a request line; the others stay idle
        try:
            for _ in range(3):  # every newcomer is answered, each closing an old stalled one
                with raw_client(path) as http:
                    assert http.get("/healthz").status_code == 200
                    assert http.post("/v1/infer", params={"max_tokens": 2}, content=png).status_code == 200
            assert limited(path, "evicted") >= 6
            gone = 0
            for s in stalled:
                s.settimeout(0.05)
                try:
                    status = read_response(s)[0]
                except TimeoutError:
                    continue  # still open
                except ConnectionResetError:  # closed before the daemon had read its half request line
                    status = 0
                # closed without a word (idle), or answered 503 (it was sending its head)
                assert status in (0, 503)
                gone += 1
            assert gone >= 6  # the oldest went first: at most the cap's worth are still open
        finally:
            for s in stalled:
                s.close()


def test_when_every_connection_is_busy_a_newcomer_gets_503_with_retry_after(runtime, png, monkeypatch, no_tracebacks):
    with running(runtime, max_connections=2, request_timeout_s=30, encoder_batching="off") as d:
        path = sock_path(d)
        held: list[Future] = []  # answers that do not come until the test says so: both connections busy

        def submit(request, pipeline, in_flight):
            held.append(Future())
            return held[-1]
        monkeypatch.setattr(d.service.router, "submit", submit)
        busy = [connect(path) for _ in range(2)]
        try:
            for s in busy:
                s.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(png) + png)
            wait_until(lambda: phases(d).count("busy") == 2, WAIT_S, "both bodies arriving")
            with connect(path) as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                status, headers, body = read_response(s)
            assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
            error = openai_error(body)
            assert error["type"] == "overloaded" and "server.max_connections" in error["message"]
        finally:
            for future in held:
                future.set_exception(Overloaded("test over"))
            for s in busy:
                s.close()
            monkeypatch.undo()
        assert_answering(path, png)


def test_trickled_bodies_over_the_cap_are_closed_slowest_first(runtime, png, no_tracebacks):
    """max_connections trickled bodies: before, every newcomer got 503 until they ended."""
    with running(runtime, max_connections=4, body_timeout_s=60, encoder_batching="off") as d:
        path = sock_path(d)
        stop = threading.Event()
        tricklers = [connect(path) for _ in range(4)]
        senders = []
        try:
            for s in tricklers:
                s.sendall(b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
                senders.append(trickle(s, stop, 0.2))
            wait_until(lambda: phases(d).count("busy") == 4, WAIT_S, "four bodies trickling")
            time.sleep(BODY_GRACE_S)  # a body younger than this is not closed yet (the newcomer would get 503)
            with raw_client(path) as http:
                for _ in range(3):  # each newcomer closes a trickler (once its body had its grace)
                    assert http.get("/readyz").status_code == 200
                    assert http.post("/v1/infer", params={"max_tokens": 2}, content=png).status_code == 200
            assert limited(path, "body_evicted") >= 1
            evicted = []
            for s in tricklers:
                s.settimeout(0.05)
                with contextlib.suppress(TimeoutError, OSError):
                    evicted.append(read_response(s))
            assert any(status == 408 and openai_error(body)["code"] == "body_evicted" for status, _, body in evicted)
        finally:
            end_trickles(stop, tricklers, senders)


def test_stream_listeners_are_bounded_and_do_not_lock_requests_out(runtime, png, no_tracebacks):
    """64 SSE listeners used to fill max_connections: every request, /readyz too, got 503."""
    with running(runtime, max_connections=3, max_stream_listeners=2, encoder_batching="off") as d:
        path = sock_path(d)
        with raw_client(path) as http:
            assert http.post("/v1/streams", json={"id": "cam", "source": "synthetic://?fps=1"}).status_code == 201
        listeners: list[socket.socket] = []
        try:
            heads = []
            for _ in range(6):
                listeners.append(s := connect(path))
                s.sendall(b"GET /v1/streams/cam/events HTTP/1.1\r\nHost: x\r\n\r\n")
                heads.append(s.recv(65536))
            assert sum(h.startswith(b"HTTP/1.1 200") for h in heads) == 2
            refused = [h for h in heads if h.startswith(b"HTTP/1.1 503")]
            assert len(refused) == 4 and all(b"retry-after: 1" in h and b"server.max_stream_listeners" in h
                                             for h in refused)
            for _ in range(3 * 3):  # more than max_connections newcomers, one after another, each answered
                with raw_client(path) as http:
                    assert http.get("/readyz").status_code == 200
            with raw_client(path) as http:
                assert http.get("/v1/streams/cam").json()["listeners"] == 2
                assert http.post("/v1/infer", params={"max_tokens": 2}, content=png).status_code == 200
        finally:
            for s in listeners:
                s.close()


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 40 + b"\r\nab\r\n0\r\n\r\n",
    b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n0\r\n\r\n",
    b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nContent-Length: 400\r\n\r\nAAAA",
    b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 30 + b"\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    b"GET /healthz HTTP/1.1\nHost: x\nX-A: b\n\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"A" * 3000 + b" / HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["chunk-40-hex", "chunk-zz", "cl-and-te", "two-cl", "cl-negative", "cl-30-digits", "nul-header", "bare-lf",
        "http2-preface", "huge-method"])
def test_malformed_framing_is_400_in_openai_shape(daemon, png, no_tracebacks, request_bytes):
    with connect(sock_path(daemon)) as s:
        s.sendall(request_bytes)
        status, headers, body = read_response(s)
    assert status == 400 and headers["content-type"] == "application/json"
    assert openai_error(body)["code"] == "malformed"
    assert_answering(sock_path(daemon), png)


def test_a_request_url_over_the_header_limit_is_431(daemon, png, no_tracebacks):
    with connect(sock_path(daemon)) as s:  # over 64 KiB: httptools' URL parser fails on it (a 400, before)
        s.sendall(b"GET /v1/models/" + b"0" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = read_response(s)
    assert status == 431 and openai_error(body)["code"] == "header_too_large"


def test_a_newcomer_over_the_cap_is_served_if_room_came_free_before_its_headers(runtime, png, no_tracebacks):
    with running(runtime, max_connections=2, body_timeout_s=30, encoder_batching="off") as d:
        path = sock_path(d)
        busy = [connect(path) for _ in range(2)]
        try:
            for s in busy:  # reading a body that does not come yet (younger than BODY_GRACE_S: not evictable)
                s.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc")
            wait_until(lambda: phases(d).count("busy") == 2, WAIT_S, "both bodies arriving")
            with connect(path) as late:
                wait_until(lambda: any(c.over_capacity for c in protocols(d)), WAIT_S, "the newcomer over the cap")
                busy.pop().close()  # one busy client goes before the newcomer's headers arrive
                wait_until(lambda: len(protocols(d)) == 2, WAIT_S, "its connection gone")
                late.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                status, _, body = read_response(late)
            assert status == 200, body
        finally:
            for s in busy:
                s.close()
        assert_answering(path, png)


def test_an_evicted_connection_sending_its_headers_is_answered_503_an_idle_one_closed(runtime, png, no_tracebacks):
    def healthz(s: socket.socket) -> int:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return read_response(s)[0]

    # a cap of one: each newcomer evicts the one connection there is, whatever the loop's clock says
    with running(runtime, max_connections=1, header_timeout_s=60, idle_timeout_s=60, encoder_batching="off") as d:
        path = sock_path(d)
        with connect(path) as idle:
            wait_until(lambda: [c.phase for c in protocols(d)] == ["idle"], WAIT_S, "the idle connection open")
            with connect(path) as newcomer:
                assert read_response(idle) == (0, {}, b"")  # it asked nothing: closed without a word
                assert healthz(newcomer) == 200
        wait_until(lambda: not protocols(d), WAIT_S, "both gone")
        with connect(path) as head:
            head.sendall(b"GET /heal")  # half a request line
            wait_until(lambda: [c.phase for c in protocols(d)] == ["head"], WAIT_S, "its head arriving")
            with connect(path) as newcomer:
                status, headers, body = read_response(head)  # answered, not reset
                assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
                error = openai_error(body)
                assert error["type"] == "overloaded" and error["code"] == "evicted"
                assert "server.max_connections" in error["message"]
                assert healthz(newcomer) == 200
        assert limited(path, "evicted") == 2


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(daemon, png, no_tracebacks):
    path = sock_path(daemon)
    for route in ("/v1/chat/completions", "/v1/infer", "/v1/streams"):
        with connect(path) as s:
            s.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n".encode() + b"{" * 100)
        assert_answering(path, png)


# ---- request bodies ----------------------------------------------------------------------

@pytest.mark.parametrize("depth", [5000, 100_000])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/streams"])
def test_json_nested_thousands_deep_is_400(daemon, png, no_tracebacks, depth, route):
    error = assert_error(post_json(sock_path(daemon), b"[" * depth + b"]" * depth, route), 400)
    assert "64 levels" in error["message"]


def array_of_ones(count: int = 8_000_000) -> bytes:
    """The hostile tester's body: 16 MB, within server.max_body_bytes, of {"prompt": [1,1,1,…]}."""
    return b'{"prompt": [' + b",".join([b"1"] * count) + b"]}"


def test_a_stream_change_or_a_stream_takes_a_small_body_only(daemon, no_tracebacks):
    """PATCH /v1/streams/p with 16 MB took 9 s to its 400, on the event loop: refused unread now."""
    path = sock_path(daemon)
    size = len(array_of_ones(300_000))  # 600 KB: more than a prompt change or a stream can hold
    for method, route in (("PATCH", "/v1/streams/p"), ("POST", "/v1/streams")):
        with connect(path) as s:  # the headers only: refused before a byte of the body is read
            s.sendall(f"{method} {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {size}\r\n\r\n".encode())
            status, _, answer = read_response(s)
        error = openai_error(answer)
        assert status == 413 and error["code"] == "request_too_large"
        assert "is larger than" in error["message"] and "stream" in error["message"]
    with raw_client(path) as http:
        spec = {"id": "small", "source": "synthetic://?fps=1", "prompt": "x" * 4000,
                "alerts": {f"a{i}": "\u00e9" * 4000 for i in range(8)}}  # the largest a stream can be
        assert http.post("/v1/streams", json=spec).status_code == 201
        assert http.patch("/v1/streams/small", json={"prompt": "\u00e9" * 4000}).status_code == 200
        assert http.delete("/v1/streams/small").status_code == 200


def test_large_json_bodies_leave_the_loop_free_and_only_a_slow_client_gets_408(runtime, no_tracebacks):
    """Four 16 MB chat bodies at once: /healthz waited 11 s, and two of the four got 408 "body did not
    arrive within 10 s" although they sent at once, as the loop parsed the others' JSON meanwhile."""
    body = array_of_ones()
    with running(runtime, body_timeout_s=3.0, encoder_batching="off") as d:
        path = sock_path(d)
        senders = [in_background(post_json, path, body) for _ in range(4)]

        def slow_client() -> int:  # sends 10 of its 1000 bytes, then nothing
            with connect(path) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 10)
                return read_response(s)[0]

        slow = in_background(slow_client)
        waits = []
        with raw_client(path, timeout=60) as http:
            while any(thread.is_alive() for thread, _ in senders):
                started = time.monotonic()
                assert http.get("/healthz").status_code == 200
                waits.append(time.monotonic() - started)
        for thread, _ in [*senders, slow]:
            thread.join(60)
        statuses = [out[0].status_code for _, out in senders]
        assert statuses == [400] * 4, [out[0].text[:200] for _, out in senders]
        assert slow[1] == [408]
        assert waits and max(waits) < 6.0, waits  # generous: it was 8-11 s on the loop


def test_brackets_in_strings_are_no_nesting():
    text = "[" * 200 + '\\"' + "{" * 200
    assert parse_json_body(json.dumps({"t": text, "u": "\\"}).encode()) == {"t": text, "u": "\\"}
    assert not json_depth_exceeds(json.dumps([[[text]]]).encode(), 3)
    assert json_depth_exceeds(json.dumps([[[[text]]]]).encode(), 3)


def test_commas_and_colons_in_strings_are_no_values():
    text = ",:" * 200 + '\\",' + "::" * 200
    assert parse_json_body(json.dumps({"t": text, "n": [1, 2, 3]}).encode()) == {"t": text, "n": [1, 2, 3]}
    assert not json_values_exceed(json.dumps([text, 1, 2]).encode(), 3)  # [ and two commas
    assert json_values_exceed(json.dumps([text, 1, 2, 3]).encode(), 3)


def test_nested_arrays_count_as_values_though_they_need_no_separator():
    """`[[[…]]],[[[…]]]` is a value per bracket and a comma per three: counting commas and colons
    alone let 6 M lists through under the 100000 limit (0.6 GB and seconds of parsing)."""
    nested = b"[" + b",".join([b"[[[]]]"] * 40_000) + b"]"
    assert nested.count(b",") + nested.count(b":") < 100_000
    with pytest.raises(ApiError, match="more than 100000 JSON values"):
        parse_json_body(nested)
    assert parse_json_body(b"[" + b",".join([b"[[[]]]"] * 20_000) + b"]")[0] == [[[]]]
    with pytest.raises(ApiError, match="more than 100000 JSON values"):
        parse_json_body(b"[" + b"0," * 100_001 + b"0]")


def test_an_integer_of_5000_digits_is_400_naming_its_field(daemon, png, no_tracebacks):
    body = json.dumps(chat(png)).encode()[:-1] + b', "seed": ' + b"9" * 5000 + b"}"
    error = assert_error(post_json(sock_path(daemon), body), 400, param="seed")
    assert error["message"] == "'seed' must be an integer, got a number of 5000 digits"


@pytest.mark.parametrize("literal, said", [(b"1" + b"0" * 400, "got a number of 401 digits"),
                                           (b"1e400", "must be a finite number, got inf")])
def test_a_temperature_beyond_a_float_is_400(daemon, png, no_tracebacks, literal, said):
    body = json.dumps(chat(png)).encode()[:-1] + b', "temperature": ' + literal + b"}"
    error = assert_error(post_json(sock_path(daemon), body), 400, param="temperature")
    assert error["message"].startswith("'temperature' must") and said in error["message"]


def test_a_lone_surrogate_in_the_text_is_400_naming_its_field(daemon, png, no_tracebacks):
    path = sock_path(daemon)
    body = json.dumps(chat(png, text="how many \ud800 ?")).encode()  # json.dumps writes it as \ud800
    error = assert_error(post_json(path, body), 400, param="messages[0].content[0].text")
    assert "unpaired surrogates" in error["message"]
    with raw_client(path) as http:
        assert_error(http.post("/v1/infer", params={"prompt": "a\x00b"}, content=png), 400, param="prompt")


def test_nul_in_a_file_path_is_400_naming_its_field(daemon, png, images, no_tracebacks):
    path = sock_path(daemon)
    body = json.dumps(chat(png, url=f"file://{images}/a%00.png")).encode()
    error = assert_error(post_json(path, body), 400, param="messages[0].content[1].image_url.url")
    assert "NUL" in error["message"]
    ok = json.dumps(chat(png, url=f"file://{images}/a.png")).encode()
    assert post_json(path, ok).status_code == 200


def test_messages_name_what_the_client_sent(daemon, png, no_tracebacks):
    path = sock_path(daemon)
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        body = json.dumps(chat(png)).encode()[:-1] + b', "temperature": ' + literal + b"}"
        error = assert_error(post_json(path, body), 400, param="temperature")
        assert error["message"].startswith("'temperature' must be a finite number, got ")
    body = json.dumps({**chat(png), "max_tokens": None, "max_completion_tokens": 0}).encode()
    error = assert_error(post_json(path, body), 400, param="max_completion_tokens")
    assert error["message"] == "'max_completion_tokens' must be in 1..4096, got 0"
    body = json.dumps({**chat(png), "max_tokens": None, "max_completion_tokens": "many"}).encode()
    assert_error(post_json(path, body), 400, param="max_completion_tokens")


def test_a_stream_whose_prompt_has_a_nul_is_400(daemon, no_tracebacks):
    spec = {"id": "bad", "source": "synthetic://?fps=1", "prompt": "a\x00b"}
    error = assert_error(post_json(sock_path(daemon), json.dumps(spec).encode(), "/v1/streams"), 400, param="prompt")
    assert "'prompt' must be text without NUL" in error["message"]


@pytest.mark.parametrize("field, value, said", [
    ("tier", "ultra", "'tier' must be one of "),
    ("prompt", "x" * 4001, "'prompt' is 4001 characters, above the 4000 limit (limits.max_prompt_chars)"),
    ("fps", 1e-300, "'fps' must be between 0.001 and 1000 or null"),
    ("source", "synthetic://?fps=1e-320", "option fps must be 0 or between 0.001 and 1000"),
    ("source", "synthetic://?fps=inf", "option fps must be 0 or between 0.001 and 1000"),
    ("source", "rtsp://127.0.0.1:99999/x", "not a valid rtsp:// address (port out of range"),
    ("source", "rtsp://127.0.0.1:0/x", "not a valid rtsp:// address (port 0)"),
    ("source", "rtsp://[::1/x", "not a valid rtsp:// address"),
    ("every", 100000000000000000000000, "'every' must be in 1..1000"),  # as an alert's every
    ("every", 1001, "'every' must be in 1..1000"),
])
def test_a_stream_every_frame_of_which_would_fail_is_400_naming_the_field(daemon, no_tracebacks, field, value, said):
    """Each of these got 201, then failed every frame or retried for ever."""
    path = sock_path(daemon)
    spec = {"id": "doomed", "source": "synthetic://?fps=1", field: value}
    error = assert_error(post_json(path, json.dumps(spec).encode(), "/v1/streams"), 400, param=field)
    assert said in error["message"]
    with raw_client(path) as http:
        assert http.get("/v1/streams").json()["data"] == []


@pytest.mark.parametrize("media", ["image/png\u0000", "image/png\ud800", "\u0000", "image/png;x=\udfff"])
def test_nul_or_a_surrogate_in_a_data_url_media_type_is_400(daemon, png, no_tracebacks, media):
    url = f"data:{media};base64," + base64.b64encode(png).decode()
    body = json.dumps(chat(png, url=url)).encode()
    error = assert_error(post_json(sock_path(daemon), body), 400, param="messages[0].content[1].image_url.url")
    assert "NUL characters or unpaired surrogates" in error["message"]


@pytest.mark.parametrize("query, param", [(b"prompt=%ed%a0%80", "prompt"), (b"prompt=%ff", "prompt"),
                                          (b"prompt=a+%ff+b", "prompt"), (b"max_tokens=%E0%A5%A7", "max_tokens"),
                                          (b"max_tokens=1_0", "max_tokens"), (b"temperature=%EF%BC%91", "temperature"),
                                          (b"seed=1_000", "seed"), (b"max_tokens=%2B5", "max_tokens"),
                                          (b"max_tokens=2&max_tokens=3", "max_tokens"), (b"tier=a&tier=b", "tier"),
                                          (b"prompt=a&prompt=b", "prompt")])
def test_infer_query_must_be_utf8_and_ascii_numbers(daemon, png, no_tracebacks, query, param):
    with raw_client(sock_path(daemon)) as http:
        response = http.post("/v1/infer?" + query.decode(), content=png)
        assert_error(response, 400, param=param)
        ok = http.post("/v1/infer?prompt=how+many+shapes+are+there+%3F&max_tokens=2&temperature=0.0", content=png)
        assert ok.status_code == 200, ok.text


# ---- the CLI and the config --------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["how many \ud800 ?", "a\x00b", "bytes \udcff from argv"])
def test_edgemm_infer_refuses_a_prompt_with_a_surrogate_or_nul(model_dir, prompt):
    result = CliRunner().invoke(main, ["infer", str(model_dir / "samples" / "scene_11.png"), "--prompt", prompt,
                                       "--threads", "1"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("edgemm: error: '--prompt' must be text without NUL")
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("server, said", [({"header_timeout_s": 0}, "'server.header_timeout_s' must be > 0"),
                                          ({"idle_timeout_s": -1}, "'server.idle_timeout_s' must be > 0"),
                                          ({"max_header_bytes": 100}, "'server.max_header_bytes' must be >= 1024")])
def test_the_connection_limits_are_validated(server, said):
    with pytest.raises(ConfigError, match=said):
        load_config({"server": server})


def test_a_config_temperature_beyond_a_float_is_a_config_error():
    with pytest.raises(ConfigError, match="'generation.temperature' must be a finite number"):
        load_config({"generation": {"temperature": 10**400}})


def test_evicting_a_connection_that_holds_no_place_admits_no_one_over_the_cap(runtime, png, monkeypatch):
    """Both places busy; then pairs: A opens (over the cap), B opens and evicts A. B must not
    count as having room: before, each B was admitted, 8 busy requests against a cap of 2."""
    with running(runtime, max_connections=2, header_timeout_s=30, idle_timeout_s=30,
                 encoder_batching="off") as d:
        path = sock_path(d)
        held: list[Future] = []

        def submit(request, pipeline, in_flight):  # the answers wait: their connections stay busy
            held.append(Future())
            return held[-1]
        monkeypatch.setattr(d.service.router, "submit", submit)
        request = b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(png) + png
        socks = [connect(path) for _ in range(2)]
        try:
            for s in socks:
                s.sendall(request)
            wait_until(lambda: len(held) == 2, WAIT_S, "two requests held")
            for _ in range(4):
                socks.append(connect(path))  # A
                socks.append(b := connect(path))  # B: evicts A, still over the cap
                b.sendall(request)
                status, headers, body = read_response(b)
                assert status == 503 and openai_error(body)["code"] == "over_capacity" and headers["retry-after"]
            assert len(held) == 2
        finally:
            for future in held:
                future.set_exception(Overloaded("test over"))
            for s in socks:
                s.close()


def test_a_connection_counts_again_once_its_event_stream_ends(runtime):
    """A listener's connection leaves the count while its events stream; after the stream is
    deleted it is an ordinary (idle, evictable) connection again."""
    with running(runtime, max_connections=2, max_stream_listeners=2, idle_timeout_s=30, encoder_batching="off") as d:
        path = sock_path(d)
        with raw_client(path) as http:
            assert http.post("/v1/streams", json={"id": "cam", "source": "synthetic://?fps=1"}).status_code == 201
        listeners = [connect(path) for _ in range(2)]
        try:
            for s in listeners:
                s.sendall(b"GET /v1/streams/cam/events HTTP/1.1\r\nHost: x\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
            wait_until(lambda: sum(c.long_lived for c in protocols(d)) == 2, WAIT_S, "two listeners")
            with raw_client(path) as http:
                assert http.delete("/v1/streams/cam").status_code == 200
            wait_until(lambda: len(protocols(d)) == 2 and not any(c.long_lived for c in protocols(d)), WAIT_S,
                       "the listeners' connections counted again")
        finally:
            for s in listeners:
                s.close()


def stall_bodies(path: str, count: int, declared: int, sent: int) -> list[socket.socket]:
    """`count` connections that each declare a body of `declared` bytes, send `sent`, and stall."""
    held = [connect(path) for _ in range(count)]
    for s in held:
        s.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % declared + b"x" * sent)
    return held


def test_stalled_bodies_filling_the_body_pool_do_not_lock_bodies_out(runtime, png, no_tracebacks):
    """queue_size clients each sending max_body_bytes - 1 and stalling: before, every request
    with a body got 503 for body_timeout_s. Now the slowest upload is closed to make room."""
    limit = 4 * len(png)
    with running(runtime, queue_size=2, max_body_bytes=limit, body_timeout_s=60, encoder_batching="off") as d:
        path = sock_path(d)
        held = stall_bodies(path, 2, limit, limit - 1)
        try:
            wait_until(lambda: sorted(getattr(c, "body_bytes", 0) for c in protocols(d)) == [limit - 1] * 2,
                       WAIT_S, "both stalled bodies in the pool")
            time.sleep(BODY_GRACE_S)  # younger bodies are not closed
            with raw_client(path) as http:
                response = http.post("/v1/infer", params={"max_tokens": 2}, content=png)
                assert response.status_code == 200, response.text
            answers = []
            for s in held:
                s.settimeout(0.5)
                with contextlib.suppress(TimeoutError, OSError):
                    answers.append(read_response(s))
            assert [(status, openai_error(body)["code"]) for status, _, body in answers] == [(408, "body_evicted")]
            assert "body-byte pool" in openai_error(answers[0][2])["message"]
        finally:
            for s in held:
                s.close()


def test_a_full_body_pool_with_nothing_to_close_is_503_with_retry_after(runtime, png, monkeypatch, no_tracebacks):
    limit = 4 * len(png)
    with running(runtime, queue_size=2, max_body_bytes=limit, body_timeout_s=60, encoder_batching="off") as d:
        monkeypatch.setattr("edgemm.server.connections.BODY_GRACE_S", 3600)  # no stalled body is old enough to close
        path = sock_path(d)
        held = stall_bodies(path, 2, limit, limit - 1)
        try:
            wait_until(lambda: sorted(getattr(c, "body_bytes", 0) for c in protocols(d)) == [limit - 1] * 2,
                       WAIT_S, "both stalled bodies in the pool")
            with raw_client(path) as http:
                response = http.post("/v1/infer", params={"max_tokens": 2}, content=png)
            error = assert_error(response, 503)
            assert response.headers["retry-after"] == "1" and error["code"] == "body_pool_full"
            assert "retry in 1 s" in error["message"] and "server.max_body_bytes" in error["message"]
        finally:
            for s in held:
                s.close()


@pytest.mark.parametrize("bad", [b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                                 b"GET /readyz HTTP/1.1\nHost: x\n\n"], ids=["cl-negative", "bare-lf"])
def test_requests_pipelined_before_bad_framing_are_answered_first(daemon, png, no_tracebacks, bad):
    """Before, only the 400 came back (the writing side shut under the three GETs), and each
    of their cycles logged 'Cannot call write() after write_eof()'."""
    with connect(sock_path(daemon)) as s:
        s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n" * 3 + bad)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", data)  # one answer right after another's body
    assert statuses == [b"200", b"200", b"200", b"400"], data
    assert b'"code":"malformed"' in data.replace(b" ", b"")
    time.sleep(0.2)  # a cycle's error, if any, is logged once its task ends
    assert_answering(sock_path(daemon), png)


# ---- clients that take nothing -------------------------------------------------------------

def stalled_listener(d, path: str, route: str) -> socket.socket:
    """An SSE listener on `route` that reads its response head and then nothing: its buffers
    (made small on both ends, so that a few events fill them) full, the daemon's writes to it
    paused (edgemm.server.connections' send deadline armed)."""
    before = set(protocols(d))  # before connecting: the daemon may accept it at once (kept: no id reused)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(WAIT_S)
    s.connect(path)
    s.sendall(f"GET {route} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert s.recv(1024).startswith(b"HTTP/1.1 200")
    wait_until(lambda: [c for c in protocols(d) if c not in before and c.long_lived], WAIT_S, "the listener")
    ours = next(c for c in protocols(d) if c not in before and c.long_lived)

    def shrink() -> None:
        ours.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ours.transport.set_write_buffer_limits(high=2048)
    d._loop.call_soon_threadsafe(shrink)
    wait_until(lambda: ours.send_deadline is not None or ours.transport.is_closing(), WAIT_S, "its writes paused")
    return s


FAST = {"id": "cam", "source": "synthetic://?size=64", "prompt": "describe the image", "max_new_tokens": 8}


@pytest.mark.parametrize("route", ["/v1/streams/cam/events", "/v1/events"])
def test_a_listener_that_reads_nothing_is_cut_off_after_send_timeout(runtime, png, route, no_tracebacks):
    with running(runtime, {"streams": [FAST]}, send_timeout_s=0.5) as d:
        path = sock_path(d)
        s = stalled_listener(d, path, route)
        try:
            wait_until(lambda: limited(path, "send_timeout") >= 1, WAIT_S, "the listener cut off")
            wait_until(lambda: d.service.streams.listener_count() == 0, WAIT_S, "its place back")
            assert not [c for c in protocols(d) if c.long_lived]  # its socket is closed, not closing
            assert_answering(path, png)
        finally:
            s.close()


def test_a_listener_that_reads_slowly_keeps_its_connection(runtime, png, no_tracebacks):
    """Its buffer full, but some of it taken before each deadline: a slow reader, not a dead one."""
    with running(runtime, {"streams": [FAST]}, send_timeout_s=0.5) as d:
        path = sock_path(d)
        s = stalled_listener(d, path, "/v1/streams/cam/events")
        try:
            read, until = 0, time.monotonic() + 3.0  # six deadlines
            while time.monotonic() < until:
                read += len(s.recv(512))  # ~5 KB a second
                time.sleep(0.1)
            assert limited(path, "send_timeout") == 0 and read > 0
            assert d.service.streams.listener_count() == 1
            # it stops reading: now it is cut off
            wait_until(lambda: limited(path, "send_timeout") >= 1, WAIT_S, "the listener cut off")
        finally:
            s.close()


def test_a_deleted_streams_listener_counts_until_its_connection_closes(runtime, no_tracebacks):
    """The stream's end cannot reach a listener that reads nothing: until the send timeout cuts it
    off (or it hangs up) it holds one of max_stream_listeners, though its stream is gone."""
    with running(runtime, {"streams": [FAST]}, send_timeout_s=60, max_stream_listeners=1) as d:
        path = sock_path(d)
        s = stalled_listener(d, path, "/v1/streams/cam/events")
        with raw_client(path) as http:
            assert http.delete("/v1/streams/cam").status_code in (200, 204)
            assert "cam" not in d.service.streams.streams
            assert d.service.streams.listener_count() == 1
            assert_error(http.get("/v1/events"), 503)  # its place is still taken
            s.close()  # it hangs up: its place is free
            wait_until(lambda: d.service.streams.listener_count() == 0, WAIT_S, "its place back")
            with http.stream("GET", "/v1/events") as events:
                assert events.status_code == 200


def test_draining_cuts_off_listeners_that_read_nothing_at_once(runtime, caplog):
    """SIGTERM with a listener that reads nothing: the daemon does not wait the grace period out
    for it (nor does uvicorn then cancel it with a traceback)."""
    caplog.set_level(logging.INFO)
    with running(runtime, {"streams": [FAST]}, send_timeout_s=60, grace_period_s=20) as d:
        s = stalled_listener(d, sock_path(d), "/v1/events")
        began = time.monotonic()
        d.stop()
        wait_until(lambda: not protocols(d), 15, "every connection closed")
        took = time.monotonic() - began
        s.close()
    assert took < 15  # the grace period is 20 s: not waited out
    assert any("cut off 1 clients that were taking nothing" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()]


# ---- clients that ask and never read: closing connections, and the drain --------------------

PAGE_REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def unpaused(d, s: socket.socket, before: set):
    """The daemon's side of `s` (connected after `before` was taken), its kernel send queue made
    small and the transport's high-water mark large: what it is sent and not taken then waits in
    the transport's buffer, without pausing the daemon's writes (so no pause arms a deadline),
    as the hostile report's 15 pages below the default 64 KiB mark did."""
    wait_until(lambda: [c for c in protocols(d) if c not in before], WAIT_S, "the connection")
    ours = next(c for c in protocols(d) if c not in before)
    shrunk = threading.Event()

    def shrink() -> None:
        ours.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ours.transport.set_write_buffer_limits(high=1 << 20)
        shrunk.set()
    d._loop.call_soon_threadsafe(shrink)
    assert shrunk.wait(WAIT_S)
    return ours


def unpaused_client(d, path: str) -> tuple[socket.socket, object]:
    """A client on the daemon's socket with a small receive buffer, and its connection's daemon
    side made so that what it does not take never pauses the daemon's writes (unpaused)."""
    before = set(protocols(d))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(WAIT_S)
    s.connect(path)
    return s, unpaused(d, s, before)


def unread_pages(d, path: str, pages: int = 4) -> tuple[socket.socket, object]:
    """A client that asks for the live-view page (some 16 KB) `pages` times in one go and reads none
    of them; returned once every answer is written (the connection idle, its bytes unsent)."""
    s, ours = unpaused_client(d, path)
    s.sendall(PAGE_REQUEST * pages)
    wait_until(lambda: ours.transport.is_closing() or ours.phase == "idle" and ours.transport.get_write_buffer_size() > 0,
               WAIT_S, "its answers written, not taken")  # (idle again only once the last is written)
    assert ours.transport.get_write_buffer_size() > 0 and not ours.flow.write_paused  # what no pause saw
    return s, ours


def test_a_connection_closed_with_answers_unread_is_cut_off_after_send_timeout(runtime, png, no_tracebacks):
    """The idle timeout closes it, but close() waits for a flush that never comes: the send
    deadline cuts it off, its file descriptor back."""
    with running(runtime, idle_timeout_s=0.5, send_timeout_s=1.0, encoder_batching="off") as d:
        path = sock_path(d)
        s, ours = unread_pages(d, path)
        try:
            wait_until(lambda: ours.transport.is_closing(), WAIT_S, "its idle timeout")
            wait_until(lambda: ours not in protocols(d), WAIT_S, "its socket closed")
            assert limited(path, "send_timeout") == 1 and limited(path, "idle_timeout") >= 1
            assert_answering(path, png)
        finally:
            s.close()


def test_a_connection_closed_with_answers_read_slowly_gets_them_all(runtime, no_tracebacks):
    """Closed by its idle timeout, but taking its answers (slowly, past several send deadlines):
    it gets every byte of them."""
    with running(runtime, idle_timeout_s=0.5, send_timeout_s=0.5, encoder_batching="off") as d:
        path = sock_path(d)
        s, ours = unread_pages(d, path)
        try:
            wait_until(lambda: ours.transport.is_closing(), WAIT_S, "its idle timeout")
            received = b""
            while chunk := s.recv(2048):  # ~20 KB a second: ~3 s for the four pages
                received += chunk
                time.sleep(0.1)
            with raw_client(path) as http:
                page = http.get("/")
            assert received.count(b"HTTP/1.1 200") == 4 and received.count(page.content) == 4
            assert limited(path, "send_timeout") == 0
        finally:
            s.close()


def test_connections_closed_with_answers_unread_count_under_the_cap(runtime, png, no_tracebacks):
    """Until they are gone they hold their places under max_connections, so clients that never
    read cannot take every file descriptor: a newcomer makes room by cutting off the one closed
    the longest."""
    with running(runtime, max_connections=2, idle_timeout_s=0.5, send_timeout_s=60, encoder_batching="off") as d:
        path = sock_path(d)
        held = []
        try:
            for _ in range(4):
                s, ours = unread_pages(d, path)
                held.append((s, ours))
                wait_until(lambda: ours.transport.is_closing(), WAIT_S, "its idle timeout")
            still_open = [i for i, (_, c) in enumerate(held) if c in protocols(d)]
            assert still_open == [2, 3]  # the two closed first were cut off to make room
            before = set(protocols(d))
            newcomer = connect(path)
            held.append((newcomer, None))
            wait_until(lambda: [c for c in protocols(d) if c not in before], WAIT_S, "the newcomer")
            ours = next(c for c in protocols(d) if c not in before)
            assert not ours.over_capacity  # the one cut off for it holds no place, though not yet gone
            assert [i for i, (_, c) in enumerate(held[:4]) if c in protocols(d)] == [3]
            newcomer.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_response(newcomer)[0] == 200
            assert limited(path, "evicted") >= 3
            assert_answering(path, png)
        finally:
            for s, _ in held:
                s.close()


def trickling_listener(d, path: str, route: str, stop: threading.Event) -> tuple[socket.socket, object]:
    """An SSE listener on `route` that reads 1 byte every 0.1 s: slow, not stalled, and never
    paused (see unpaused), events piling up in the transport's buffer."""
    s, ours = unpaused_client(d, path)
    s.sendall(f"GET {route} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert s.recv(12) == b"HTTP/1.1 200"

    def trickle() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set() and s.recv(1):
                time.sleep(0.1)
    threading.Thread(target=trickle, daemon=True).start()
    wait_until(lambda: ours.long_lived and ours.transport.get_write_buffer_size() > 0, WAIT_S, "events piling up")
    assert not ours.flow.write_paused
    return s, ours


@pytest.mark.parametrize("idle_timeout_s", [0.5, 30.0], ids=["closed-by-idle-timeout", "closed-by-the-drain"])
def test_draining_cuts_off_clients_slow_to_take_what_they_were_sent(runtime, idle_timeout_s, caplog):
    """SIGTERM with a listener taking its events slowly (its stream ends at the drain, its bytes
    still unsent) and a client whose answers wait unread (closed by its idle timeout before the
    drain, or by the drain): each gets DRAIN_SEND_S, not the grace period (20 s here) nor the
    send timeout (60 s)."""
    caplog.set_level(logging.INFO)
    stop = threading.Event()
    with running(runtime, {"streams": [FAST]}, send_timeout_s=60, grace_period_s=20,
                 idle_timeout_s=idle_timeout_s) as d:
        path = sock_path(d)
        listener, _ = trickling_listener(d, path, "/v1/events", stop)
        unread, ours = unread_pages(d, path)
        if idle_timeout_s < 1:
            wait_until(lambda: ours.transport.is_closing(), WAIT_S, "its idle timeout")
        began = time.monotonic()
        d.stop()
        wait_until(lambda: not protocols(d), 15, "every connection closed")
        took = time.monotonic() - began
        stop.set()
        listener.close()
        unread.close()
    assert took < 10  # DRAIN_SEND_S (1 s) and the streams' end, not the grace period
    assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()]
