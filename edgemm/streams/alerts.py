"""Alerts: named questions a daemon stream asks about its frames, read as true / false /
unknown, debounced, and announced when they change.

    a frame the stream submits ─► StreamAlerts.ask: each alert that is due (every N frames,
        the stream not behind or the alert at its floor, fewer than ALERT_INFLIGHT of its
        questions unanswered, a place free) ─► a question riding with the frame's own request
        (Request.followers: the frame decoded, scheduled and encoded once for all of them,
        the questions decoded beside it, each reusing the image's prompt prefix)
    its answer (decode thread) ─► Rule.read: "true" | "false" | "unknown"
        ─► Debounce: on_after true / off_after false readings in a row change the state
        ─► an event {"stream", "alert", "state", "frame", "time"}: the stream's SSE
           listeners (`event: alert`) and the alert's webhook (WebhookSender)

The stream's own answers come first: alerts take the capacity that is spare. An alert due
on a frame the stream is behind on (the frame waited for a place of the stream's: the
source delivers faster than the stream answers, edgemm.streams.run), or on one of the
SPARE_AFTER - 1 frames after it, is deferred to the next frame (counted), unless it has
gone max(every, max_every) frames without being asked: that floor keeps a saturated
stream's alerts alive at a cost bounded by (number of alerts) / max_every questions per
frame, and it is what they cost a stream that has no capacity to spare. A stream that keeps up with its source (a camera with compute left over) asks every
alert on every frame it is due.

What is fair and bounded. The stream's own prompt keeps its share of the pipeline
(edgemm.streams.manager.STREAM_SHARE frames in flight) untouched: alert questions have places of
their own, ALERT_SHARE per stream, and an alert has at most ALERT_INFLIGHT questions in
flight. An alert that is due when it has that many unanswered, or no place is free, is
asked on the next frame instead (counted as skipped); the alerts that waited longest go
first. A reading about an older frame than one already read (overtaken) is left out.
Nothing waits for a place: asking never slows the stream's own frames down beyond the
pipeline work the questions are. Riding with a frame, a question takes no inbox place of
the pipeline's; asked without one (`ask` with no leader) it is a request of its own, for
which the daemon's pipeline keeps max_streams × ALERT_SHARE inbox places
(edgemm.streams.manager.reserved_places), so they never crowd out the API. A frame the pipeline
refuses takes its questions with it: never asked, they are counted as skipped.

A webhook is a thread of its own with a bounded queue: when it falls behind (an endpoint
that is slow, down or hangs), the oldest events are dropped and counted; the stream never
waits for it. Each attempt has a deadline of timeout_s as a whole (every connect, write and
read of it gets what is left, DeadlineBackend), and only the reply's status and at most
REPLY_BYTES of its body are read. A closed webhook delivers what it holds for at most one
timeout_s more, then drops the rest; at most MAX_DRAINING closed webhooks drain at once
(another is abandoned at once: its connection, or its connect in progress, shut and its
queue dropped, so its thread ends within moments even against a host that drops SYNs).
Its token comes from an environment variable or an owner-only file, as the offload
client's key does, and is sent only in the Authorization header.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import re
import select
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpcore
import httpx
from httpcore._backends.sync import SyncStream  # httpcore's socket stream; its package does not export it

from edgemm.util.backoff import Backoff
from edgemm.config import AlertConfig, WebhookConfig
from edgemm.errors import one_line
from edgemm.util.prometheus import Gauge, Registry
from edgemm.power.offload import CredentialsError, read_key_file
from edgemm.engine.pipeline import Overloaded, Pipeline, Request
from edgemm.streams.sources.base import Frame
from edgemm.streams.sources.uri import redact_uri

log = logging.getLogger("edgemm")

ALERT_SHARE = 4  # alert questions of one stream in the pipeline at once
# questions of one alert in the pipeline at once: two, so that an alert still reads every
# frame when an answer takes longer than the time between frames (up to twice as long)
ALERT_INFLIGHT = 2
# a stream is behind from a frame that waited for its place until this many frames in a row
# have not: one frame that happened to find a place free (the source slow for a moment) is not
# capacity to spare
SPARE_AFTER = 3
SETTLE_S = 10.0  # how long a stream that ends waits for its alerts' last answers, so their events precede its end
WEBHOOK_QUEUE = 64  # events waiting per webhook; beyond, the oldest is dropped (counted)
WEBHOOK_MAX_BACKOFF_S = 30.0
REPLY_BYTES = 4096  # of a webhook's reply body, at most this much is read (its status is what counts)
MAX_DRAINING = 16  # closed webhooks still delivering what they held, all streams together
STATES = ("true", "false", "unknown")

# ---- reading an answer -----------------------------------------------------------------------

NUMBER_WORDS = {word: n for n, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty".split())} | {"no": 0, "none": 0}
_WORD = re.compile(r"[0-9]+(?:\.[0-9]+)?|[^\W\d_]+")  # a number, or a run of letters


def words(text: str) -> list[str]:
    """The answer's words, lower case, without punctuation: 'Yes, a red one.' → yes a red one."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Rule:
    """How an answer reads as true / false / unknown (AlertConfig's rule keys)."""
    match: tuple[str, ...] = ()  # these words, in order, somewhere in the answer
    above: float | None = None
    below: float | None = None

    @classmethod
    def of(cls, cfg: AlertConfig) -> "Rule":
        return cls(tuple(words(cfg.match)) if cfg.match is not None else (), cfg.above, cfg.below)

    def read(self, answer: str) -> str:
        found = words(answer)
        if not found:
            return "unknown"
        if self.match:
            n = len(self.match)
            return str(any(tuple(found[i:i + n]) == self.match for i in range(len(found) - n + 1))).lower()
        if self.above is not None or self.below is not None:
            number = first_number(found)
            if number is None:
                return "unknown"
            holds = (self.above is None or number > self.above) and (self.below is None or number < self.below)
            return str(holds).lower()
        return {"yes": "true", "no": "false"}.get(found[0], "unknown")  # a yes/no question


def first_number(found: Iterable[str]) -> float | None:
    """The first number among the words: digits ('3') or a word ('three'); 'no' counts as 0."""
    for word in found:
        if word[0].isdigit():
            return float(word)
        if word in NUMBER_WORDS:
            return float(NUMBER_WORDS[word])
    return None


# ---- the state ---------------------------------------------------------------------------------

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


def check_webhooks(alerts: Mapping[str, AlertConfig], webhook: WebhookConfig | None, where: str,
                   environ: Mapping[str, str] = os.environ) -> None:
    """The webhooks' tokens can be read (CredentialsError, one line, if not): at start-up."""
    for hook, name in [(webhook, f"{where}webhook"),
                       *((cfg.webhook, f"{where}alerts.{n}.webhook") for n, cfg in alerts.items())]:
        if hook is not None:
            read_token(hook, name, environ)


def read_token(cfg: WebhookConfig, where: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The webhook's bearer token: from token_env, else token_file (owner-only), else none."""
    if cfg.token_env is not None:
        token = environ.get(cfg.token_env, "").strip()
        if not token:
            raise CredentialsError(f"{where}.token_env: the environment variable {cfg.token_env} is not set")
        return token
    if cfg.token_file is not None:
        return read_key_file(Path(cfg.token_file), f"{where}.token_file")
    return None


def without_secrets(spec: dict) -> dict:
    """A stream's config as GET /v1/streams shows it: a webhook URL is shown as its scheme and
    host only (a webhook's path often is its secret, as Slack's and Teams' are), a source's
    user:password@ as ***@ (an RTSP camera's credentials)."""
    def hidden(hook: dict | None) -> dict | None:
        if hook is None:
            return None
        parts = urllib.parse.urlsplit(hook["url"])
        return {**hook, "url": f"{parts.scheme}://{parts.hostname or ''}/…"}
    return {**spec, "source": redact_uri(spec["source"]), "webhook": hidden(spec.get("webhook")),
            "alerts": {name: {**alert, "webhook": hidden(alert.get("webhook"))}
                       for name, alert in spec.get("alerts", {}).items()}}


# ---- webhooks ------------------------------------------------------------------------------------

@dataclass
class WebhookFigures:
    delivered: int = 0
    failed: int = 0  # events given up on after every attempt, or refused (4xx)
    dropped: int = 0  # events the queue had no room for (the oldest go), or sent after close
    retries: int = 0
    last_error: str | None = None


MAX_NAME_LOOKUPS = 4  # webhook host names being resolved at once, every webhook together


class NameLookups:
    """socket.getaddrinfo within a wait. httpcore's connect timeout does not cover the name:
    its SyncBackend calls socket.create_connection, whose getaddrinfo waits as long as the
    system's resolver does (resolv.conf's timeout x attempts x servers, or forever on a
    stuck NSS module). Here each lookup runs in a thread of its own and the attempt waits
    for it at most until its deadline; a lookup that outlives its attempt keeps its thread
    until the resolver returns, so at most MAX_NAME_LOOKUPS run at once and an attempt
    that finds them all busy fails at once (a ConnectError, retried with backoff)."""

    def __init__(self, limit: int = MAX_NAME_LOOKUPS) -> None:
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    def resolve(self, host: str, port: int, wait: float) -> list[tuple]:
        try:  # an address needs no lookup
            return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        except socket.gaierror:
            pass
        if not self._slots.acquire(blocking=False):
            raise httpcore.ConnectError(f"{self.limit} name lookups are still waiting for the resolver")
        found: dict[str, Any] = {}
        done = threading.Event()

        def look() -> None:
            try:
                found["addresses"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:
                found["error"] = e
            finally:
                self._slots.release()
                done.set()

        try:
            threading.Thread(target=look, name="edgemm-webhook-lookup", daemon=True).start()
        except RuntimeError as e:  # no thread to be had: the slot comes back
            self._slots.release()
            raise httpcore.ConnectError(f"cannot start a name lookup: {e}") from e
        if not done.wait(wait):
            raise httpcore.ConnectTimeout(f"the name lookup of {host} did not finish before the attempt's deadline")
        if "error" in found:
            raise httpcore.ConnectError(f"cannot resolve {host}: {found['error']}")
        return found["addresses"]


NAME_LOOKUPS = NameLookups()


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's sockets, where each name lookup, connect, write and read waits at most
    until `deadline` (time.monotonic()), whatever its own timeout: a whole attempt within
    timeout_s, even against a resolver that hangs or a server that drips its reply a byte
    at a time. `abandon()` (any thread) shuts the open connections, which wakes a read in
    progress, and the sockets still connecting, which wakes their connect: a host that
    drops the SYNs (firewalled, or its accept queue full) holds no thread past abandon()."""

    def __init__(self) -> None:
        self.deadline = math.inf
        self._inner = httpcore.SyncBackend()
        self._lock = threading.Lock()
        self._open: set["DeadlineStream"] = set()
        self._connecting: set[socket.socket] = set()

    def left(self, timeout: float | None) -> float | None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise httpcore.TimeoutException("the attempt's deadline passed")
        return remaining if timeout is None else min(timeout, remaining)

    def _track(self, inner: httpcore.NetworkStream) -> "DeadlineStream":
        stream = DeadlineStream(inner, self)
        with self._lock:
            self._open.add(stream)
        return stream

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        """The name resolved within the deadline (NameLookups), then its addresses tried in
        the resolver's order, as socket.create_connection tries them (IPv6 with its scope).
        TLS still checks the host name: httpcore gives start_tls the URL's host, not the address."""
        failure: Exception = httpcore.ConnectError(f"{host} has no address")
        for family, kind, proto, _, address in NAME_LOOKUPS.resolve(host, port, self.left(timeout)):
            try:
                sock = self._connect(family, kind, proto, address, timeout, local_address, socket_options)
            except httpcore.ConnectError as e:  # a timeout is the deadline's: no next address
                failure = e
                continue
            # httpcore's own stream on it, as SyncBackend.connect_tcp returns (reads, writes, TLS)
            return self._track(SyncStream(sock))
        raise failure

    def _connect(self, family: int, kind: int, proto: int, address: tuple, timeout: float | None,
                 local_address: str | None, socket_options: Iterable[tuple] | None) -> socket.socket:
        """One address connected within the deadline, as httpcore's SyncBackend connects (its
        socket options, then TCP_NODELAY), but on a socket abandon() can reach: it is
        registered once the connect has begun (a SYN sent, so a shutdown wakes it; one
        registered later is caught by the deadline check after it) and until it ends."""
        self.left(timeout)  # abandoned, or out of time, after a failed address: no next one
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as e:  # out of fds, or no IPv6 here: the next address may do
            raise httpcore.ConnectError(f"cannot make a socket: {e}") from e
        try:
            for option in socket_options or ():
                sock.setsockopt(*option)
            if local_address is not None:
                sock.bind((local_address, 0))
            sock.setblocking(False)
            started = sock.connect_ex(address)
            with self._lock:
                self._connecting.add(sock)
            try:
                if started not in (0, errno.EINPROGRESS):
                    raise OSError(started, os.strerror(started))
                wait = self.left(timeout)  # after registering: an abandon() before it is seen here
                if started == errno.EINPROGRESS:
                    poll = select.poll()  # not select(): fds above 1024 are a busy daemon's ordinary case
                    poll.register(sock, select.POLLOUT)
                    if not poll.poll(None if wait is None else math.ceil(wait * 1000)):
                        raise httpcore.ConnectTimeout(f"no connection to {address[0]} within the attempt's deadline")
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise OSError(error, os.strerror(error))
                self.left(None)  # abandoned while connecting: a shut socket is no connection
            finally:
                with self._lock:
                    self._connecting.discard(sock)
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            sock.close()
            raise httpcore.ConnectError(str(e)) from e
        except BaseException:
            sock.close()
            raise

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return self._track(self._inner.connect_unix_socket(path, self.left(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)

    def forget(self, stream: "DeadlineStream") -> None:
        with self._lock:
            self._open.discard(stream)

    def abandon(self) -> None:
        """Shut, not close: the thread using a socket closes it (a closed fd could be reused
        by then). A connect in progress wakes with ECONNRESET, a read with end of stream."""
        self.deadline = -math.inf
        with self._lock:
            sockets = [stream.get_extra_info("socket") for stream in self._open] + list(self._connecting)
        for sock in sockets:
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, backend: DeadlineBackend):
        self._inner, self._backend = inner, backend

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, self._backend.left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._backend.left(timeout))

    def close(self) -> None:
        self._backend.forget(self)
        self._inner.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        """The TLS handshake within the deadline, on a socket abandon() can reach all along (httpcore's
        own start_tls wraps the socket, which takes the fd from the one abandon() would shut)."""
        raw = self._inner.get_extra_info("socket")
        if raw is None or not isinstance(self._inner, SyncStream):  # not a socket of ours (a proxy's TLS-in-TLS)
            tls_stream = self._inner.start_tls(ssl_context, server_hostname, self._backend.left(timeout))
            self._backend.forget(self)
            return self._backend._track(tls_stream)
        try:
            tls = ssl_context.wrap_socket(raw, server_hostname=server_hostname, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError) as e:
            raise httpcore.ConnectError(str(e)) from e
        self._backend.forget(self)  # the plain stream is the TLS one's now
        with self._backend._lock:
            self._backend._connecting.add(tls)
        try:
            tls.settimeout(self._backend.left(timeout))
            tls.do_handshake()
            self._backend.left(None)  # abandoned during the handshake: no connection
        except socket.timeout as e:
            tls.close()
            raise httpcore.ConnectTimeout(f"TLS handshake: {e}") from e
        except (OSError, ssl.SSLError) as e:
            tls.close()
            raise httpcore.ConnectError(f"TLS handshake: {e}") from e
        except BaseException:
            tls.close()
            raise
        finally:
            with self._backend._lock:
                self._backend._connecting.discard(tls)
        return self._backend._track(SyncStream(tls))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class DeadlineTransport(httpx.BaseTransport):
    """httpx's transport on `backend`'s sockets (httpx has no total timeout of its own): one
    httpcore connection pool, as httpx.HTTPTransport has, with httpcore's errors raised as
    httpx's. Through `proxy` if given, as httpx.HTTPTransport goes through one: plain HTTP
    as absolute-URI requests to it, HTTPS through a CONNECT tunnel (the proxy's own
    connection is on `backend` too, so the deadline covers it)."""

    def __init__(self, backend: DeadlineBackend, proxy_url: str | None = None) -> None:
        # a context of its own: httpcore sets its ALPN protocols on every connect, which is not safe
        # on a context another webhook's thread is making a connection from
        ssl_context = httpx.create_ssl_context()
        self._refusal: str | None = None  # a proxy it cannot use: each attempt fails, saying so
        self._pool: httpcore.ConnectionPool | httpcore.HTTPProxy | None = None
        scheme = urllib.parse.urlsplit(proxy_url).scheme if proxy_url else None
        try:
            proxy = httpx.Proxy(proxy_url) if scheme in ("http", "https") else None
        except (ValueError, httpx.InvalidURL) as e:
            self._refusal = f"the proxy URL cannot be used: {e}"
            return
        if proxy_url is None:
            self._pool = httpcore.ConnectionPool(ssl_context=ssl_context, max_connections=1,
                                                 network_backend=backend)
        elif proxy is not None:
            self._pool = httpcore.HTTPProxy(
                proxy_url=httpcore.URL(scheme=proxy.url.raw_scheme, host=proxy.url.raw_host,
                                       port=proxy.url.port, target=proxy.url.raw_path),
                proxy_auth=proxy.raw_auth, proxy_headers=proxy.headers.raw, ssl_context=ssl_context,
                proxy_ssl_context=proxy.ssl_context, max_connections=1, network_backend=backend)
        else:
            self._refusal = f"webhooks go through http:// and https:// proxies only, not {scheme}://"

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self._pool is None:
            raise httpx.UnsupportedProtocol(self._refusal or "closed")
        url = request.url
        core = httpcore.Request(request.method, httpcore.URL(scheme=url.raw_scheme, host=url.raw_host,
                                                              port=url.port, target=url.raw_path),
                                headers=request.headers.raw, content=request.stream,
                                extensions=request.extensions)
        with httpx_errors():
            response = self._pool.handle_request(core)
        return httpx.Response(response.status, headers=response.headers, stream=ReplyStream(response.stream),
                              extensions=response.extensions)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def environment_proxy(url: str) -> str | None:
    """The proxy URL the environment names for `url`: HTTP_PROXY / HTTPS_PROXY / ALL_PROXY,
    none for a host NO_PROXY lists, by the standard library's rules (a host matches an entry
    equal to it or ending in it after a dot; `*` matches every host)."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    if not parts.hostname or urllib.request.proxy_bypass(parts.hostname):
        return None
    named = proxies.get(parts.scheme) or proxies.get("all")
    if not named:
        return None
    return named if "://" in named else f"http://{named}"


class ReplyStream(httpx.SyncByteStream):
    def __init__(self, inner: Iterable[bytes]) -> None:
        self._inner = inner

    def __iter__(self) -> Iterator[bytes]:
        with httpx_errors():
            yield from self._inner

    def close(self) -> None:
        with httpx_errors():
            self._inner.close()


# httpcore's errors as httpx's, the most specific first (a ReadTimeout is a TimeoutException)
HTTPX_ERRORS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout), (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout), (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError), (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError), (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError), (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextmanager
def httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as e:
        for core, ours in HTTPX_ERRORS:
            if isinstance(e, core):
                raise ours(str(e)) from e
        raise


# how httpcore's RemoteProtocolError begins when the server closed the connection before any
# reply (it restarted, or dropped an idle keep-alive connection): retried, unlike a bad reply
DISCONNECTED = "Server disconnected"


def certificate_failure(error: BaseException) -> str | None:
    """Why the webhook's TLS certificate was not trusted ("self-signed certificate", "Hostname
    mismatch, …"), one line, when that is what `error` (an httpx error) comes from; else None.
    httpx raises a plain ConnectError whose cause (the chain httpcore raised it from) holds
    ssl's SSLCertVerificationError."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ssl.SSLCertVerificationError):
            reason = cause.verify_message or cause.reason or str(cause)
            return " ".join(str(reason).split())[:200]
        cause = cause.__cause__ or cause.__context__
    return None


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
            self._backend.deadline = min(self._backend.deadline, self._close_deadline)
            self._cond.notify()
        if not self._drains:
            self._backend.abandon()

    def _client(self) -> httpx.Client:
        """The sender's HTTP client, made on its own thread: a TLS context loads the system's CA
        bundle (tens of ms), which on the event loop (where streams are created) would hold up
        every client of the daemon."""
        transport = self._transport or DeadlineTransport(self._backend, environment_proxy(self.cfg.url))
        return httpx.Client(timeout=httpx.Timeout(self.cfg.timeout_s), headers=self._headers, transport=transport,
                            trust_env=False,  # the proxy is the transport's already
                            follow_redirects=False)  # a redirect must not carry the token elsewhere

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
        with self._cond:  # as close() sets it: an abandoned sender's deadline (-inf) stays
            self._backend.deadline = min(time.monotonic() + self.cfg.timeout_s, self._close_deadline)
        with self._http.stream("POST", self.cfg.url, json=event) as response:
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


# ---- /metrics --------------------------------------------------------------------------------------

def alert_metrics(registry: Registry, streams: Mapping[str, Any]) -> None:
    """The alerts' figures, read when scraped: `streams` is the daemon's id → ManagedStream
    (those with alerts have `.alerts`, a StreamAlerts)."""
    def each() -> Iterable[tuple[str, Any, Alert]]:
        for stream_id, stream in list(streams.items()):
            if stream.alerts is not None:
                for alert in stream.alerts.alerts:
                    yield stream_id, stream, alert

    def senders() -> Iterable[tuple[str, str, WebhookSender]]:
        for stream_id, stream in list(streams.items()):
            if stream.alerts is not None:
                for name, sender in stream.alerts.senders.items():
                    yield stream_id, name, sender

    registry.add(Gauge("edgemm_alert_state", "1 for each alert's current state (true, false, unknown).",
                       ("stream", "alert", "state"),
                       lambda: {(s, a.name, a.debounce.state): 1 for s, _, a in each()}))
    registry.add(Gauge("edgemm_alert_transitions_total", "Alert state changes, by the state changed to.",
                       ("stream", "alert", "state"),
                       lambda: {(s, a.name, state): n for s, _, a in each()
                                for state, n in a.figures.transitions.items()}, kind="counter"))
    registry.add(Gauge("edgemm_alert_answers_total", "Alert answers, by how they read (unknown: neither "
                       "yes nor no, no number, or the question failed).", ("stream", "alert", "reading"),
                       lambda: {(s, a.name, reading): n for s, _, a in each()
                                for reading, n in a.figures.readings.items()}, kind="counter"))
    registry.add(Gauge("edgemm_alert_evaluations_total", "Alert questions asked (submitted into the pipeline).",
                       ("stream", "alert"), lambda: {(s, a.name): a.figures.asked for s, _, a in each()},
                       kind="counter"))
    registry.add(Gauge("edgemm_alert_deferred_total", "Alert questions due but deferred to a later frame: the "
                       "stream was behind its source (asked again with spare capacity, or at the max_every floor).",
                       ("stream", "alert"), lambda: {(s, a.name): a.figures.deferred for s, _, a in each()},
                       kind="counter"))
    registry.add(Gauge("edgemm_alert_skipped_total", "Alert questions due but asked on a later frame (the last "
                       "one unanswered, or the stream's alert places full).", ("stream", "alert"),
                       lambda: {(s, a.name): a.figures.skipped for s, _, a in each()}, kind="counter"))
    def dropped() -> dict:
        counts = {(s, "listener"): st.alerts_lagged for s, st in list(streams.items()) if st.alerts is not None}
        for s, _, sender in senders():
            counts[(s, "webhook")] = counts.get((s, "webhook"), 0) + sender.figures.dropped
        return counts

    registry.add(Gauge("edgemm_alert_events_dropped_total", "Alert events lost: a slow SSE listener's oldest "
                       "(sink listener), or a webhook queue's oldest (sink webhook).", ("stream", "sink"),
                       dropped, kind="counter"))
    registry.add(Gauge("edgemm_alert_webhook_events_total", "Alert events sent to webhooks, by outcome (delivered, "
                       "failed after its retries or refused, dropped from a full queue) and retries.",
                       ("stream", "webhook", "outcome"),
                       lambda: {(s, name, outcome): getattr(w.figures, outcome) for s, name, w in senders()
                                for outcome in ("delivered", "failed", "dropped", "retries")}, kind="counter"))

