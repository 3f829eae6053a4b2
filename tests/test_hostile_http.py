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
import socket
import threading
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from test_server import assert_error, metric, raw_client, running, sock_path, wait_until

from edgemm.cli import main
from edgemm.config import ConfigError, load_config
from edgemm.openai_api import json_depth_exceeds, parse_json_body

WAIT_S = 30  # bound for anything that should happen "now"; never a timing assumption
SHORT = {"header_timeout_s": 0.5, "idle_timeout_s": 0.5, "request_timeout_s": 2.0, "max_header_bytes": 4096,
         "encoder_batching": "off"}


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


def test_a_body_that_trickles_gets_408_within_request_timeout(daemon, png, no_tracebacks):
    path = sock_path(daemon)
    with connect(path) as s:
        s.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
        stop = threading.Event()

        def trickle() -> None:  # 1 byte / 100 ms: never done
            try:
                while not stop.wait(0.1):
                    s.sendall(b"x")
            except OSError:
                pass
        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            status, headers, body = read_response(s)
        finally:
            stop.set()
            sender.join(WAIT_S)
    assert status == 408 and headers["connection"] == "close"
    error = openai_error(body)
    assert error["code"] == "timeout" and "server.request_timeout_s" in error["message"]
    assert_answering(path, png)  # the slot came back


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


def test_when_every_connection_is_busy_a_newcomer_gets_503_with_retry_after(runtime, png, no_tracebacks):
    with running(runtime, max_connections=2, request_timeout_s=30, encoder_batching="off") as d:
        path = sock_path(d)
        busy = [connect(path) for _ in range(2)]
        try:
            for s in busy:  # admitted, reading a body that does not come yet
                s.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc")
            wait_until(lambda: d.service.admission.count == 2, WAIT_S, "both requests admitted")
            with connect(path) as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                status, headers, body = read_response(s)
            assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
            error = openai_error(body)
            assert error["type"] == "overloaded" and "server.max_connections" in error["message"]
        finally:
            for s in busy:
                s.close()
        assert_answering(path, png)


def test_a_newcomer_over_the_cap_is_served_if_room_came_free_before_its_headers(runtime, png, no_tracebacks):
    with running(runtime, max_connections=2, request_timeout_s=30, encoder_batching="off") as d:
        path = sock_path(d)
        busy = [connect(path) for _ in range(2)]
        try:
            for s in busy:  # admitted, reading a body that does not come yet
                s.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc")
            wait_until(lambda: d.service.admission.count == 2, WAIT_S, "both requests admitted")
            with connect(path) as late:
                wait_until(lambda: any(c.over_capacity for c in protocols(d)), WAIT_S, "the newcomer over the cap")
                busy.pop().close()  # one busy client goes before the newcomer's headers arrive
                wait_until(lambda: len(protocols(d)) == 2 and d.service.admission.count == 1, WAIT_S,
                           "its connection and its admission slot gone")
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


def test_brackets_in_strings_are_no_nesting():
    text = "[" * 200 + '\\"' + "{" * 200
    assert parse_json_body(json.dumps({"t": text, "u": "\\"}).encode()) == {"t": text, "u": "\\"}
    assert not json_depth_exceeds(json.dumps([[[text]]]).encode(), 3)
    assert json_depth_exceeds(json.dumps([[[[text]]]]).encode(), 3)


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
    error = assert_error(post_json(sock_path(daemon), json.dumps(spec).encode(), "/v1/streams"), 400)
    assert "'prompt' must be text without NUL" in error["message"]


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
