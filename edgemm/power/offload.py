"""Cloud offload: one request to any OpenAI-compatible chat-completions endpoint.

    image bytes + prompt ─► data URL ─► POST {offload.url}/chat/completions (edgemm.net.outbound)
        per attempt, as a whole: offload.timeout_s · retried on timeouts, connection errors, 429 and 5xx,
        waiting backoff_s, 2×, 4× … · CircuitBreaker: after breaker_threshold failed requests
        in a row, no requests for breaker_cooldown_s, then one trial decides

Off by default (offload.enabled): images leave the device only when the owner says so.
The API key comes from an environment variable (offload.api_key_env) or a file only
its owner may read (offload.api_key_file, mode 0600 or 0400), never from the YAML. It is
sent only in the Authorization header and scrubbed from every message this module makes,
including text the endpoint sends back.
"""
from __future__ import annotations

import base64
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx

from edgemm.config import OffloadConfig
from edgemm.net.outbound import MAX_NAME_LOOKUPS, DeadlineBackend, NameLookups, outbound_client
from edgemm.power.errors import OffloadError, OffloadTimeout, OffloadUnavailable
from edgemm.util.backoff import Backoff
from edgemm.util.secrets import read_secret


# ---- the API key ------------------------------------------------------------------------------

def read_api_key(cfg: OffloadConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key from offload.api_key_env, else offload.api_key_file, else None (no key)."""
    return read_secret(cfg.api_key_env, cfg.api_key_file, "offload.api_key_env", "offload.api_key_file", environ)


# ---- the circuit breaker -------------------------------------------------------------------------

@dataclass
class CircuitBreaker:
    """closed: requests go · open: none go, until cooldown_s after the last failure ·
    half_open: one trial goes; its success closes the breaker, its failure opens it again."""
    threshold: int = 3  # failed requests in a row that open it
    cooldown_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    failures: int = 0  # in a row
    opened_at: float | None = None
    trial: bool = False  # a half-open trial is in flight
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.cooldown_s else "open"

    def allow(self) -> bool:
        """May a request go now? In half_open, only the first caller's trial may."""
        with self._lock:
            state = self.state
            if state == "half_open" and not self.trial:
                self.trial = True
                return True
            return state == "closed"

    def retry_in(self) -> float:
        return 0.0 if self.opened_at is None else max(0.0, self.opened_at + self.cooldown_s - self.clock())

    def success(self) -> None:
        with self._lock:
            self.failures, self.opened_at, self.trial = 0, None, False

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self.trial or self.failures >= self.threshold:
                self.opened_at = self.clock()
            self.trial = False


# ---- the client -----------------------------------------------------------------------------------

@dataclass
class OffloadReply:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    seconds: float  # wall time, retries and backoff included
    attempts: int


@dataclass
class OffloadFigures:
    requests: int = 0
    succeeded: int = 0
    failed: int = 0
    refused: int = 0  # not sent: breaker open
    retries: int = 0
    last_error: str | None = None
    last_ms: float | None = None


class OffloadClient:
    def __init__(self, cfg: OffloadConfig, api_key: str | None = None,
                 transport: httpx.BaseTransport | None = None, sleep: Callable[[float], None] = time.sleep):
        self.cfg = cfg
        self._key = api_key
        self.endpoint = cfg.url.rstrip("/") + "/chat/completions"
        self.host = urllib.parse.urlsplit(cfg.url).hostname or "the endpoint"  # no user:password@ in messages
        self.breaker = CircuitBreaker(cfg.breaker_threshold, cfg.breaker_cooldown_s)
        self.figures = OffloadFigures()
        self._sleep = sleep
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # name lookups of its own, one for each request it may send at once
        self._backend = DeadlineBackend(NameLookups(max(MAX_NAME_LOOKUPS, cfg.max_concurrent)))
        self._http = outbound_client(cfg.url, cfg.timeout_s, headers, self._backend, transport,
                                     connections=cfg.max_concurrent, senders="offload requests")

    @classmethod
    def from_config(cls, cfg: OffloadConfig, environ: Mapping[str, str] = os.environ) -> "OffloadClient":
        return cls(cfg, read_api_key(cfg, environ))

    def __repr__(self) -> str:
        return f"OffloadClient({self.endpoint!r}, model={self.cfg.model!r}, key={'set' if self._key else 'none'})"

    def close(self) -> None:
        self._http.close()

    def chat(self, image: bytes, prompt: str, options: Mapping | None = None) -> OffloadReply:
        """Ask the endpoint; raises OffloadUnavailable (breaker open), OffloadTimeout or OffloadError."""
        if not self.breaker.allow():
            self.figures.refused += 1
            raise OffloadUnavailable(f"offload: circuit breaker open after {self.breaker.failures} failed requests; "
                                     f"next try in {self.breaker.retry_in():.0f} s")
        self.figures.requests += 1
        started = time.perf_counter()
        try:
            reply = self._attempts(request_body(self.cfg.model, image, prompt, options or {}), started)
        except OffloadError as e:
            self.breaker.failure()
            self.figures.failed += 1
            self.figures.last_error = str(e)
            raise
        self.breaker.success()
        self.figures.succeeded += 1
        self.figures.last_ms = reply.seconds * 1e3
        return reply

    def _attempts(self, body: dict, started: float) -> OffloadReply:
        error: OffloadError | None = None
        backoff = Backoff(self.cfg.backoff_s)  # uncapped: offload.retries (at most 10) bounds it
        for attempt in range(1, self.cfg.retries + 2):
            if attempt > 1:
                self.figures.retries += 1
                self._sleep(backoff.next())
            try:
                with self._backend.attempt(self.cfg.timeout_s):
                    response = self._http.post(self.endpoint, json=body)
            except httpx.TimeoutException:
                error = OffloadTimeout(f"offload: no reply from {self.host} within {self.cfg.timeout_s:g} s "
                                       "(offload.timeout_s)")
                continue
            except httpx.UnsupportedProtocol as e:  # a proxy it cannot use: no retry mends that
                raise OffloadError(f"offload: cannot reach {self.host}: {e}") from None
            except httpx.HTTPError as e:
                error = OffloadError(f"offload: cannot reach {self.host}: {type(e).__name__}")
                continue
            if response.status_code == 429 or response.status_code >= 500:
                error = OffloadError(f"offload: {self.host} answered HTTP {response.status_code}")
                continue
            if response.status_code != 200:
                raise OffloadError(f"offload: {self.host} refused the request: HTTP {response.status_code}: "
                                   f"{self.scrub(error_text(response))}")
            return self.parse(response, attempt, started)
        assert error is not None
        raise type(error)(f"{error} (after {self.cfg.retries + 1} attempts)")

    def parse(self, response: httpx.Response, attempts: int, started: float) -> OffloadReply:
        try:
            data = response.json()
            choice = data["choices"][0]
            text = message_text(choice["message"]["content"])
            usage = data.get("usage") or {}
            return OffloadReply(text, str(choice.get("finish_reason") or "stop"),
                                int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                                str(data.get("model") or self.cfg.model), time.perf_counter() - started, attempts)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise OffloadError(f"offload: malformed reply from {self.host}: not a chat completion "
                               "(no choices[0].message.content)") from None

    def scrub(self, text: str) -> str:
        """`text` without the key (an endpoint may echo the request back)."""
        return text.replace(self._key, "***") if self._key else text

    def state(self) -> dict:
        f = self.figures
        return {"enabled": True, "endpoint": self.host, "model": self.cfg.model, "key": "set" if self._key else "none",
                "breaker": self.breaker.state, "failures_in_a_row": self.breaker.failures,
                "requests": f.requests, "succeeded": f.succeeded, "failed": f.failed, "refused": f.refused,
                "retries": f.retries, "last_error": f.last_error,
                "last_ms": None if f.last_ms is None else round(f.last_ms, 1)}


def request_body(model: str, image: bytes, prompt: str, options: Mapping) -> dict:
    body: dict = {"model": model, "messages": [{"role": "user", "content": [
        {"type": "text", "text": prompt}, {"type": "image_url", "image_url": {"url": data_url(image)}}]}]}
    for ours, theirs in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("seed", "seed")):
        if options.get(ours) is not None:
            body[theirs] = options[ours]
    return body


MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"),
         (b"BM", "image/bmp"), (b"II*\x00", "image/tiff"), (b"MM\x00*", "image/tiff"))


def data_url(image: bytes) -> str:
    kind = next((media for magic, media in MAGIC if image.startswith(magic)), None)
    if kind is None:
        kind = "image/webp" if image[:4] == b"RIFF" and image[8:12] == b"WEBP" else "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(image).decode()}"


def message_text(content: object) -> str:
    """A message's content: a string, or a list of parts whose text parts are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise TypeError("content is neither text nor parts")


def error_text(response: httpx.Response) -> str:
    """The endpoint's error message, on one line and short."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    return " ".join(str(message).split())[:200] or response.reason_phrase
