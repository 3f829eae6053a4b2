"""Alert events POSTed to webhooks: a bounded queue per webhook and a thread that sends it,
over the one outbound HTTP client (edgemm.net.outbound). See edgemm.streams.alerts."""
from __future__ import annotations

import logging
import math
import os
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from edgemm.config import AlertConfig, WebhookConfig
from edgemm.errors import one_line
from edgemm.net.outbound import DISCONNECTED, DeadlineBackend, certificate_failure, outbound_client
from edgemm.util.backoff import Backoff
from edgemm.util.secrets import read_secret

log = logging.getLogger("edgemm")

WEBHOOK_QUEUE = 64  # events waiting per webhook; beyond, the oldest is dropped (counted)
WEBHOOK_MAX_BACKOFF_S = 30.0
REPLY_BYTES = 4096  # of a webhook's reply body, at most this much is read (its status is what counts)
MAX_DRAINING = 16  # closed webhooks still delivering what they held, all streams together


def check_webhooks(alerts: Mapping[str, AlertConfig], webhook: WebhookConfig | None, where: str,
                   environ: Mapping[str, str] = os.environ) -> None:
    """The webhooks' tokens can be read (CredentialsError, one line, if not): at start-up."""
    for hook, name in [(webhook, f"{where}webhook"),
                       *((cfg.webhook, f"{where}alerts.{n}.webhook") for n, cfg in alerts.items())]:
        if hook is not None:
            read_token(hook, name, environ)


def read_token(cfg: WebhookConfig, where: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The webhook's bearer token: from token_env, else token_file (owner-only), else none."""
    return read_secret(cfg.token_env, cfg.token_file, f"{where}.token_env", f"{where}.token_file", environ)


@dataclass
class WebhookFigures:
    delivered: int = 0
    failed: int = 0  # events given up on after every attempt, or refused (4xx)
    dropped: int = 0  # events the queue had no room for (the oldest go), or sent after close
    retries: int = 0
    last_error: str | None = None


class WebhookSender:
    """POSTs each event given to `send` as JSON to the webhook, in order, from a thread of its
    own; retried on timeouts, connection errors, 429 and 5xx with backoff (not on another 4xx, nor
    on a reply that is not HTTP, nor on a TLS certificate not trusted). `send` never waits.
    Each attempt ends within timeout_s (a `transport` given for tests has no such deadline)."""

    _draining = 0  # closed senders still delivering, all of them (MAX_DRAINING)
    _draining_lock = threading.Lock()

    def __init__(self, cfg: WebhookConfig, where: str, environ: Mapping[str, str] = os.environ,
                 transport: httpx.BaseTransport | None = None, queue_size: int | None = None):
        self.cfg, self.where = cfg, where
        token = read_token(cfg, where, environ)
        self.host = urllib.parse.urlsplit(cfg.url).hostname or "the webhook"  # no user:password@ in messages
        self.queue_size = queue_size or WEBHOOK_QUEUE
        self.figures = WebhookFigures()
        self._queue: deque[dict] = deque()
        self._cond = threading.Condition()
        self._closing = threading.Event()  # also cuts a backoff wait short
        self._close_deadline = math.inf  # after close(): deliver until then, drop the rest
        self._drains = False  # counted in WebhookSender._draining
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._backend = DeadlineBackend()
        self._transport = transport
        self._http: httpx.Client | None = None  # made by the sender's thread (_client)
        self._failing = False  # logged once when it starts failing, once when it works again
        self.thread = threading.Thread(target=self._run, name="edgemm-webhook", daemon=True)
        self.thread.start()

    def __repr__(self) -> str:  # never the token
        return f"WebhookSender({self.host!r}, queued={len(self._queue)})"

    def send(self, event: dict) -> None:
        with self._cond:
            if self._closing.is_set():
                self.figures.dropped += 1
                return
            if len(self._queue) >= self.queue_size:
                self._queue.popleft()  # the oldest makes room: the newest state matters most
                self.figures.dropped += 1
            self._queue.append(event)
            self._cond.notify()

    def queued(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Deliver what is queued for at most one timeout_s more (no more retries), drop the
        rest, then stop. With MAX_DRAINING closed senders draining already: stop now."""
        with self._cond:
            if self._closing.is_set():
                return
            self._closing.set()
            with WebhookSender._draining_lock:
                if WebhookSender._draining < MAX_DRAINING:
                    WebhookSender._draining += 1
                    self._drains = True
            self._close_deadline = time.monotonic() + self.cfg.timeout_s if self._drains else -math.inf
            self._backend.cutoff = min(self._backend.cutoff, self._close_deadline)
            self._cond.notify()
        if not self._drains:
            self._backend.abandon()

    def _client(self) -> httpx.Client:
        """The sender's HTTP client, made on its own thread: a TLS context loads the system's CA
        bundle (tens of ms), which on the event loop (where streams are created) would hold up
        every client of the daemon."""
        return outbound_client(self.cfg.url, self.cfg.timeout_s, self._headers, self._backend, self._transport)

    def _run(self) -> None:
        try:
            try:
                self._http = self._client()
            except Exception as e:  # e.g. no CA bundle: nothing can be sent; what comes is dropped (counted)
                error = one_line(f"cannot send anything: {type(e).__name__}: {e}", 200)
                log.error("%s: the webhook to %s %s", self.where, self.host, error)
                with self._cond:
                    self.figures.last_error = error
                    self._closing.set()
                    self.figures.dropped += len(self._queue)
                    self._queue.clear()
                return
            while True:
                with self._cond:
                    while not self._queue and not self._closing.is_set():
                        self._cond.wait()
                    if not self._queue:
                        return
                    if time.monotonic() >= self._close_deadline:  # closed a timeout_s ago: give up
                        self.figures.dropped += len(self._queue)
                        self._queue.clear()
                        return
                    event = self._queue.popleft()
                self._deliver(event)
        finally:
            if self._http is not None:
                self._http.close()
            if self._drains:
                with WebhookSender._draining_lock:
                    WebhookSender._draining -= 1

    def _attempt(self, event: dict) -> int:
        """One POST, within timeout_s as a whole: the reply's status (at most REPLY_BYTES of
        its body read, the rest never)."""
        # close() brings the backend's cutoff forward, which this attempt keeps to as well
        with self._backend.attempt(self.cfg.timeout_s), self._http.stream("POST", self.cfg.url, json=event) as response:
            read = 0
            for chunk in response.iter_raw(REPLY_BYTES):
                read += len(chunk)
                if read >= REPLY_BYTES:
                    break
            return response.status_code

    def _deliver(self, event: dict) -> None:
        cfg, error = self.cfg, "not sent"
        backoff = Backoff(cfg.backoff_s, WEBHOOK_MAX_BACKOFF_S)
        for attempt in range(cfg.retries + 1):
            if attempt:
                if self._closing.wait(backoff.next()):
                    break  # closing: no more retries
                self.figures.retries += 1
            try:
                status = self._attempt(event)
            except httpx.TimeoutException:
                error = f"no reply from {self.host} within {cfg.timeout_s:g} s (timeout_s)"
                continue
            except httpx.ProtocolError as e:
                if str(e).startswith(DISCONNECTED):  # no reply at all: as a connection error
                    error = f"{self.host} closed the connection without a reply"
                    continue
                # connected, and the reply was not HTTP that h11 takes (a header over its bound,
                # another protocol): the host was reached, and would answer the same again, so
                # it is final, as a 4xx is, not retried
                detail = " ".join(str(e).split())[:100]
                error = f"bad reply from {self.host}: {type(e).__name__}" + (f" ({detail})" if detail else "")
                break
            except httpx.UnsupportedProtocol as e:  # the proxy cannot be used: its reason, final
                error = f"cannot reach {self.host}: {e}"
                break
            except httpx.HTTPError as e:
                untrusted = certificate_failure(e)
                if untrusted is not None:  # the same certificate again on a retry: final, as a 4xx is
                    error = f"TLS certificate of {self.host} not trusted: {untrusted}"
                    break
                error = f"cannot reach {self.host}: {type(e).__name__}"
                continue
            if status == 429 or status >= 500:
                error = f"{self.host} answered HTTP {status}"
                continue
            if 200 <= status < 300:
                self.figures.delivered += 1
                if self._failing:
                    self._failing = False
                    log.info("%s: delivering again to %s", self.where, self.host)
                return
            error = f"{self.host} refused the event: HTTP {status}"
            break  # another 4xx: the same event would be refused again
        self.figures.failed += 1
        self.figures.last_error = error
        if not self._failing:  # once, not once per event, while the endpoint stays down
            self._failing = True
            log.warning("%s: an alert event was not delivered: %s", self.where, error)
