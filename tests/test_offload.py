"""The offload client against a real OpenAI-compatible test server on loopback."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import edgemm.net.outbound
from edgemm.config import OffloadConfig, load_config
from edgemm.power.errors import OffloadError, OffloadTimeout, OffloadUnavailable
from edgemm.power.offload import CircuitBreaker, OffloadClient, data_url, read_api_key
from edgemm.util.errors import CredentialsError

KEY = "sk-test-5f3c2a9e-SECRET"
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32


def completion(text: str = "three shapes") -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "remote-vlm",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}}


class FakeEndpoint:
    """Answers POST /v1/chat/completions with the next scripted behaviour (the last one repeats):
    ok · slow · 500 · 503 · 429 · 400 · malformed · not_json · echo_key (401 quoting the header)."""

    def __init__(self):
        self.script: list[str] = ["ok"]
        self.requests: list[dict] = []
        self.slow_s = 1.0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                behaviour = endpoint.script.pop(0) if len(endpoint.script) > 1 else endpoint.script[0]
                if behaviour == "slow":
                    time.sleep(endpoint.slow_s)
                    return self.reply(200, completion())
                if behaviour.isdigit():
                    return self.reply(int(behaviour), {"error": {"message": f"status {behaviour}"}})
                if behaviour == "malformed":
                    return self.reply(200, {"choices": []})
                if behaviour == "not_json":
                    return self.reply(200, b"<html>gateway</html>")
                if behaviour == "echo_key":
                    return self.reply(401, {"error": {"message": f"bad key: {self.headers['Authorization']}"}})
                return self.reply(200, completion())

            def reply(self, status: int, payload) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client may have timed out and left
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[FakeEndpoint]:
    server = FakeEndpoint()
    yield server
    server.close()


def make_client(endpoint: FakeEndpoint, key: str | None = KEY, **cfg) -> tuple[OffloadClient, list[float]]:
    sleeps: list[float] = []
    config = OffloadConfig(enabled=True, url=endpoint.url, model="remote-vlm", **{"timeout_s": 2.0, **cfg})
    return OffloadClient(config, key, sleep=sleeps.append), sleeps


def test_success(endpoint):
    client, _ = make_client(endpoint)
    reply = client.chat(PNG, "how many shapes are there ?", {"max_new_tokens": 8, "temperature": 0.0})
    assert reply.text == "three shapes" and reply.finish_reason == "stop" and reply.attempts == 1
    assert (reply.prompt_tokens, reply.completion_tokens, reply.model) == (20, 2, "remote-vlm")
    sent = endpoint.requests[0]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["headers"]["Authorization"] == f"Bearer {KEY}"
    assert sent["body"]["model"] == "remote-vlm" and sent["body"]["max_tokens"] == 8
    text, image = sent["body"]["messages"][0]["content"]
    assert text == {"type": "text", "text": "how many shapes are there ?"}
    assert image["image_url"]["url"].startswith("data:image/png;base64,")
    assert client.breaker.state == "closed" and client.state()["succeeded"] == 1


def test_no_key_sends_no_authorization(endpoint):
    client, _ = make_client(endpoint, key=None)
    client.chat(PNG, "describe the image")
    assert "Authorization" not in endpoint.requests[0]["headers"]


def test_slow_endpoint_times_out(endpoint):
    endpoint.script = ["slow"]
    client, _ = make_client(endpoint, timeout_s=0.2, retries=0)
    started = time.monotonic()
    with pytest.raises(OffloadTimeout) as info:
        client.chat(PNG, "describe the image")
    assert time.monotonic() - started < 0.9
    assert "within 0.2 s" in str(info.value) and info.value.http_status == 504


def test_requests_at_once_each_keep_their_own_deadline_on_connections_of_their_own(endpoint):
    """The offload workers send at once (offload.max_concurrent): each attempt has its own deadline
    (one thread's does not cut another's short) and its own connection (none waits for another's)."""
    endpoint.script = ["slow"]
    endpoint.slow_s = 0.6
    client, _ = make_client(endpoint, timeout_s=2.0, retries=0, max_concurrent=2)
    replies: list = []
    started = time.monotonic()
    threads = [threading.Thread(target=lambda: replies.append(client.chat(PNG, "describe the image")))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [r.text for r in replies] == ["three shapes"] * 2
    assert time.monotonic() - started < 1.1  # side by side, not one after the other (1.2 s)


def test_offload_resolves_names_with_lookups_of_its_own_not_the_webhooks(endpoint, monkeypatch):
    """A webhook host whose resolver hangs holds the webhooks' shared name lookups: offload,
    which needs a name looked up for its endpoint, still answers."""
    shared = edgemm.net.outbound.NameLookups(limit=1)
    assert shared._slots.acquire(blocking=False)  # the only slot, held by a webhook's hung lookup
    monkeypatch.setattr(edgemm.net.outbound, "NAME_LOOKUPS", shared)
    config = OffloadConfig(enabled=True, url=endpoint.url.replace("127.0.0.1", "localhost"), model="remote-vlm",
                           timeout_s=2.0, retries=0)
    assert OffloadClient(config, KEY).chat(PNG, "describe the image").text == "three shapes"


def test_a_proxy_offload_cannot_use_fails_at_once_saying_why(endpoint, monkeypatch):
    monkeypatch.setenv("ALL_PROXY", "socks5://127.0.0.1:1080")
    client, sleeps = make_client(endpoint, retries=3)
    with pytest.raises(OffloadError, match=r"offload requests go through http:// and https:// proxies only, "
                                           r"not socks5://"):
        client.chat(PNG, "describe the image")
    assert sleeps == [] and endpoint.requests == []  # not retried: no retry mends the proxy


def test_an_attempt_is_bounded_as_a_whole_not_per_read(monkeypatch):
    """offload.timeout_s holds for the whole attempt: an endpoint that sends its reply a byte at a
    time (each read well within the timeout) still times out at it."""
    import socket
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def drip() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 1000:
                if stop.wait(0.05):
                    return
                with contextlib.suppress(OSError):
                    conn.sendall(bytes([byte]))

    threading.Thread(target=drip, daemon=True).start()
    config = OffloadConfig(enabled=True, url=f"http://127.0.0.1:{server.getsockname()[1]}/v1", model="m",
                           timeout_s=0.5, retries=0)
    client = OffloadClient(config, KEY)
    started = time.monotonic()
    try:
        with pytest.raises(OffloadTimeout, match="within 0.5 s"):
            client.chat(PNG, "describe the image")
        assert time.monotonic() - started < 2.0
    finally:
        stop.set()
        client.close()
        server.close()


def test_5xx_is_retried_with_backoff(endpoint):
    endpoint.script = ["503", "500", "ok"]
    client, sleeps = make_client(endpoint, retries=2, backoff_s=0.1)
    reply = client.chat(PNG, "describe the image")
    assert reply.attempts == 3 and len(endpoint.requests) == 3
    assert sleeps == [0.1, 0.2]  # exponential backoff between attempts
    assert client.breaker.failures == 0  # one request, and it succeeded


def test_retries_are_bounded(endpoint):
    endpoint.script = ["500"]
    client, sleeps = make_client(endpoint, retries=2, backoff_s=0.0)
    with pytest.raises(OffloadError, match=r"HTTP 500 \(after 3 attempts\)") as info:
        client.chat(PNG, "describe the image")
    assert len(endpoint.requests) == 3 and info.value.http_status == 502


def test_429_is_retried_and_4xx_is_not(endpoint):
    endpoint.script = ["429", "ok"]
    client, _ = make_client(endpoint, retries=1)
    assert client.chat(PNG, "x").attempts == 2
    endpoint.script, endpoint.requests = ["400"], []
    with pytest.raises(OffloadError, match="refused the request: HTTP 400: status 400"):
        client.chat(PNG, "x")
    assert len(endpoint.requests) == 1


@pytest.mark.parametrize("behaviour", ["malformed", "not_json"])
def test_malformed_reply(endpoint, behaviour):
    endpoint.script = [behaviour]
    client, _ = make_client(endpoint)
    with pytest.raises(OffloadError, match="malformed reply from 127.0.0.1"):
        client.chat(PNG, "x")
    assert len(endpoint.requests) == 1  # a broken reply is not retried: it would break again


def test_unreachable_endpoint(endpoint):
    url = endpoint.url
    endpoint.close()
    client = OffloadClient(OffloadConfig(enabled=True, url=url, model="m", retries=1, backoff_s=0), None)
    with pytest.raises(OffloadError, match="cannot reach 127.0.0.1: ConnectError"):
        client.chat(PNG, "x")


def test_breaker_opens_and_closes_after_cooldown(endpoint):
    endpoint.script = ["500"]
    client, _ = make_client(endpoint, retries=0, breaker_threshold=2, breaker_cooldown_s=30)
    now = [1000.0]
    client.breaker.clock = lambda: now[0]
    for _ in range(2):
        with pytest.raises(OffloadError):
            client.chat(PNG, "x")
    assert client.breaker.state == "open"
    with pytest.raises(OffloadUnavailable, match="circuit breaker open after 2 failed requests; next try in 30 s"):
        client.chat(PNG, "x")
    assert len(endpoint.requests) == 2  # an open breaker sends nothing
    now[0] += 30
    assert client.breaker.state == "half_open"
    with pytest.raises(OffloadError):  # the trial fails: open again, for a new cooldown
        client.chat(PNG, "x")
    assert client.breaker.state == "open" and len(endpoint.requests) == 3
    now[0] += 30
    endpoint.script = ["ok"]
    assert client.chat(PNG, "x").text == "three shapes"  # the trial succeeds: closed
    assert client.breaker.state == "closed" and client.breaker.failures == 0
    assert client.state()["refused"] == 1


def test_half_open_lets_one_trial_through():
    now = [0.0]
    breaker = CircuitBreaker(threshold=1, cooldown_s=5, clock=lambda: now[0])
    assert breaker.allow()
    breaker.failure()
    assert not breaker.allow()
    now[0] = 5
    assert breaker.allow() and not breaker.allow()  # the second caller waits for the trial's outcome
    breaker.success()
    assert breaker.state == "closed" and breaker.allow()


def test_the_key_never_appears_in_logs_or_errors(endpoint, caplog):
    caplog.set_level(logging.DEBUG)  # httpx and httpcore included
    endpoint.script = ["echo_key"]
    client, _ = make_client(endpoint)
    with pytest.raises(OffloadError) as info:
        client.chat(PNG, "x")
    assert "bad key: Bearer ***" in str(info.value)  # the endpoint quoted it; we did not
    endpoint.script = ["500"]
    for _ in range(3):
        with contextlib.suppress(OffloadError):
            client.chat(PNG, "x")
    logging.getLogger("edgemm").warning("offload failed: %s", client.state()["last_error"])
    for text in (str(info.value), repr(client), json.dumps(client.state()), caplog.text):
        assert KEY not in text
    assert endpoint.requests[0]["headers"]["Authorization"] == f"Bearer {KEY}"  # it was sent, only there


# ---- the key's sources -------------------------------------------------------------------------


def test_key_from_environment_variable():
    cfg = OffloadConfig(api_key_env="EDGEMM_TEST_KEY")
    assert read_api_key(cfg, {"EDGEMM_TEST_KEY": f" {KEY}\n"}) == KEY
    with pytest.raises(CredentialsError, match="EDGEMM_TEST_KEY is not set"):
        read_api_key(cfg, {})
    assert read_api_key(OffloadConfig(), {"OPENAI_API_KEY": KEY}) is None  # only the variable named


def test_key_file_must_be_owner_only(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    for mode in (0o600, 0o400):
        path.chmod(mode)
        assert read_api_key(OffloadConfig(api_key_file=str(path)), {}) == KEY
    for mode in (0o644, 0o640, 0o604, 0o620):
        path.chmod(mode)
        with pytest.raises(CredentialsError, match=f"mode {mode:04o} lets group or others access it") as info:
            read_api_key(OffloadConfig(api_key_file=str(path)), {})
        assert KEY not in str(info.value)


@pytest.mark.parametrize("problem", ["missing", "empty", "folder"])
def test_bad_key_files(tmp_path, problem):
    path = tmp_path / "key"
    if problem == "empty":
        path.write_text("\n")
        path.chmod(0o600)
    elif problem == "folder":
        path.mkdir(mode=0o700)
    with pytest.raises(CredentialsError, match="offload.api_key_file"):
        read_api_key(OffloadConfig(api_key_file=str(path)), {})


def test_env_wins_over_file_and_file_is_relative_to_the_config(tmp_path):
    (tmp_path / "key").write_text("from-file")
    os.chmod(tmp_path / "key", 0o600)
    (tmp_path / "edgemm.yaml").write_text("offload:\n  api_key_env: EDGEMM_TEST_KEY\n  api_key_file: key\n")
    cfg = load_config(tmp_path / "edgemm.yaml").offload
    assert cfg.api_key_file == str(tmp_path / "key")
    assert read_api_key(cfg, {"EDGEMM_TEST_KEY": "from-env"}) == "from-env"
    assert read_api_key(cfg, {}) == "from-file"


def test_a_key_in_the_yaml_is_refused_without_echoing_it():
    with pytest.raises(Exception) as info:
        load_config({"offload": {"api_key": KEY}})
    assert "unknown key 'offload.api_key'" in str(info.value) and KEY not in str(info.value)


def test_offload_is_off_by_default():
    assert load_config(None).offload.enabled is False


def test_data_url_media_types():
    assert data_url(PNG).startswith("data:image/png;base64,")
    assert data_url(b"\xff\xd8\xff\xe0").startswith("data:image/jpeg;base64,")
    assert data_url(b"RIFF\0\0\0\0WEBPVP8 ").startswith("data:image/webp;base64,")
    assert data_url(b"???").startswith("data:application/octet-stream;base64,")


def test_client_overhead_is_small(endpoint):
    """The added latency of the client itself: round trips to an instant loopback server."""
    client, _ = make_client(endpoint)
    client.chat(PNG, "warm up")
    times = []
    for _ in range(20):
        started = time.perf_counter()
        client.chat(PNG, "x")
        times.append((time.perf_counter() - started) * 1e3)
    median = sorted(times)[len(times) // 2]
    print(f"offload client round trip on loopback: median {median:.2f} ms")
    assert median < 100  # generous: a busy 2-core CI box
