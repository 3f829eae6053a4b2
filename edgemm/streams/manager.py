"""Camera streams run by the daemon: `streams:` in the config, or POST /v1/streams.

Each stream is edgemm.streams.run.run_stream (latest frame wins for live sources) in a thread
of its own, submitting into the daemon's one pipeline, the one the API uses, so every
backend component is driven by one pipeline stage thread only. Each stream keeps to a
share of STREAM_SHARE frames in flight, and all streams together to the manager's pool
of max_streams × STREAM_SHARE; the daemon's pipeline keeps that many inbox places beyond
the API's queue_size (Pipeline `reserved`), so streams and API never crowd each other
out. Stopping a stream never closes the pipeline; its frames in flight are answered.

Its results go to whoever listens on /v1/streams/{id}/events, through a bounded buffer
per listener: a listener that falls behind loses the oldest results (counted), never
the daemon's memory. A stream's `alerts:` (edgemm.streams.alerts) ask their own questions about
its frames, in places of their own (ALERT_SHARE), with what capacity the stream leaves
spare (deferred while it is behind, but for a floor), and their state changes go to the
same listeners as `event: alert` (and to their webhooks).

A stream is "starting" until its source delivers its first frame, then "running". A
source that fails to open or to deliver (a camera unplugged, a network camera down, a
device that is not there yet) is retried with backoff (the camera's own reconnects, and
restarts after 0.5 s doubling to 30 s), and the stream is "retrying" with the error until
the source delivers again. A source that no retry can fix (edgemm.streams.sources.SourceUnusable:
no GStreamer or no such GStreamer element, a path that is no camera, permission denied)
is "failed" with the cause and not retried; POST /v1/streams refuses such a source with
400 before the stream exists (`StreamManager.check`). One stream's trouble never reaches
the API or the other streams.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from edgemm.streams.alerts.schedule import ALERT_SHARE, StreamAlerts
from edgemm.streams.alerts.webhook import check_webhooks
from edgemm.util.backoff import Backoff
from edgemm.config import MAX_ALERTS, LimitsConfig, StreamConfig, config_from_dict
from edgemm.errors import ConfigError, EdgemmError, InputError, Overloaded
from edgemm.engine.pipeline import Pipeline
from edgemm.streams.errors import SourceError, SourceUnusable, StreamConflict, StreamNotFound, StreamSpecError
from edgemm.streams.sources import check_uri, open_source
from edgemm.streams.sources.base import Source
from edgemm.streams.sources.uri import parse_uri
from edgemm.streams.api_policy import (api_may_connect_to, api_may_post_to, api_may_start, api_may_use_tokens,
                                       without_secrets)
from edgemm.streams.run import StreamOptions, run_stream
from edgemm.streams.state import StreamState
from edgemm.streams.view import LatestFrame

log = logging.getLogger("edgemm")

EVENTS_BUFFER = 32  # results buffered per listener
FIRST_RETRY_S, MAX_RETRY_S = 0.5, 30.0  # a stream that fails restarts after 0.5, 1, 2 … s, at most 30
STREAM_SHARE = 2  # frames of one stream in the pipeline at once: one encoding, one decoding
END = None  # the last item a listener gets: the stream is gone


_NAMED = re.compile(r"'([A-Za-z_][\w.\[\]]*)' must")  # the key a config check names: 'streams[0].fps' must …


def stream_spec(data: object) -> StreamConfig:
    """A POST /v1/streams body → StreamConfig, with the config file's checks (400 if wrong)."""
    if not isinstance(data, dict):
        raise StreamSpecError("a stream is a JSON object: {\"id\", \"source\", \"prompt\", …}")
    try:
        return config_from_dict({"streams": [data]}).streams[0]
    except ConfigError as e:  # keep its one-line message, with the body's own key names
        detail = e.detail.replace("streams[0].", "")
        named = _NAMED.match(detail)
        raise StreamSpecError(detail, named.group(1) if named else None) from None


class ListenerQueue(asyncio.Queue):
    """One SSE listener's events: at most EVENTS_BUFFER of them (offer() loses the oldest to make
    room), then END, after which nothing more goes in. END always has its room: it is never lost,
    nor moved to where the oldest event is taken from."""

    def __init__(self):
        super().__init__(EVENTS_BUFFER + 1)  # + room for END
        self.closed = False

    def offer(self, item: tuple) -> tuple | None:
        """Queue an event (id, record, event name); returns the oldest one it lost to make room, if any."""
        if self.closed:
            return None  # after END: dropped, as nobody reads past it
        lost = self.get_nowait() if self.qsize() >= EVENTS_BUFFER else None
        super().put_nowait(item)
        return lost

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            super().put_nowait(END)  # offer() keeps at most EVENTS_BUFFER: there is room

    def stream_ended(self) -> None:
        """The stream this queue listens to ended."""
        self.close()


class AllStreamsListener(ListenerQueue):
    """One listener on every stream (GET /v1/events, the live view page's): the same queue sits
    in each stream's listeners, so it is bounded, and loses its oldest results, like any other
    listener. One stream's end is not its end: only close() is (the daemon drains)."""

    # set by StreamManager.listen_all: counts an event lost to make room in the stream it came
    # from, for a listener that loses events other than in offer()'s return (edgemm.server.liveview's)
    on_lost: Callable[[tuple], None] | None = None

    def stream_ended(self) -> None:
        pass


@dataclass
class StreamFigures:
    state: StreamState = StreamState.STARTING
    frames: int = 0  # answered frames
    errors: int = 0
    dropped: int = 0  # live frames replaced by newer ones before processing (the current run)
    retries: int = 0  # restarts after the source failed
    last_error: str | None = None
    last_result: dict | None = None
    last_result_at: float | None = None  # time.time() of the last answer
    started: float = field(default_factory=time.time)


class ManagedStream:
    def __init__(self, spec: StreamConfig, pipeline: Pipeline, loop: asyncio.AbstractEventLoop,
                 route: Callable[[], Any] | None = None, pool: threading.Semaphore | None = None,
                 alert_pool: threading.Semaphore | None = None):
        self.spec, self.pipeline, self.loop, self.route = spec, pipeline, loop, route
        self.pool = pool  # the manager's: frames in flight of all streams together
        self.figures = StreamFigures()
        self.latest = LatestFrame()  # the last answered frame, for GET /v1/streams/{id}/frame.jpg
        self._options: StreamOptions | None = None  # the current run's: where a new prompt goes
        self.listeners: set[ListenerQueue] = set()  # touched only from the event loop
        self.lagged = 0  # results (and alert events) a slow listener missed
        self.alerts_lagged = 0  # ... of which alert events
        self.alerts = StreamAlerts(spec.id, spec.alerts, spec.webhook, pipeline, self._post_alert, spec.tier, route,
                                   alert_pool) if spec.alerts else None
        self.sent = 0  # results delivered: the SSE id of the last one
        self.finished = False  # END was delivered: the stream's thread is done
        self.deleted_at: float | None = None  # time.monotonic() of its DELETE
        self._stop = threading.Event()  # the stream is to stop for good
        self._run_stop = threading.Event()  # the current run is to stop (run_stream also sets it when done)
        self._source: Source | None = None
        self._lock = threading.Lock()  # figures: written by the stream thread, read by the API
        self.thread = threading.Thread(target=self._run, name=f"edgemm-stream-{spec.id}", daemon=True)

    # -- from the event loop --

    def describe(self) -> dict:
        with self._lock:
            figures = asdict(self.figures)
        source = self._source
        if self.deleted_at is not None:  # deleted, its thread not ended yet (a camera call under way)
            figures["state"] = StreamState.STOPPING
            figures["stopping_s"] = round(time.monotonic() - self.deleted_at, 1)  # since the DELETE
        return {"id": self.spec.id, "object": "stream", **without_secrets(asdict(self.spec)), **figures,
                # a live camera that stops delivering is first reopened by the source itself
                "source_reconnects": source.stats.reconnects if source is not None else 0,
                "listeners": len(self.listeners), "lagged": self.lagged,
                # alert questions due but put off while the stream was behind (edgemm.streams.alerts)
                "alerts_deferred": self.alerts.deferred() if self.alerts is not None else 0}

    def change_prompt(self, spec: StreamConfig) -> None:
        """PATCH /v1/streams/{id}: frames submitted from now on are asked `spec.prompt`."""
        self.spec = replace(self.spec, prompt=spec.prompt)
        options = self._options
        if options is not None:
            options.prompt = spec.prompt  # read by the stream's feeding thread for each frame it submits

    def listen(self) -> ListenerQueue:
        queue = ListenerQueue()
        if self.finished:
            queue.close()
        self.listeners.add(queue)
        return queue

    def _deliver(self, record: dict | None, event: str | None = None) -> None:
        """To every listener: (the event's id, the result, its SSE event name: None, or "alert"), or END."""
        self.finished = self.finished or record is END
        if record is END:
            for queue in self.listeners:
                queue.stream_ended()
            return
        self.sent += 1  # numbered in order, so a listener that lagged sees the gap
        for queue in self.listeners:
            lost = queue.offer((self.sent, record, event))
            if lost is not None:  # the oldest event made room: counted in the stream it came from
                (getattr(queue, "on_lost", None) or self.count_lost)(lost)

    def count_lost(self, item: tuple) -> None:
        """A listener lost this event (id, record, event name) to make room (from the event loop)."""
        self.lagged += 1
        self.alerts_lagged += item[2] == "alert"

    # -- from any thread --

    def start(self) -> None:
        self.thread.start()

    def ended(self) -> bool:
        """Its thread is done (or all but: END is delivered, or the thread has returned)."""
        return self.finished or not self.thread.is_alive()

    def stop(self) -> None:
        """Ask the stream to stop; frames in flight are still answered and delivered. Never
        waits, so the event loop may call it: the stream's own threads close its source (a
        reader in a camera call that blocks, an RTSP open to a server that never answers,
        releases the capture when that call returns, and the thread ends then)."""
        self._stop.set()
        self._run_stop.set()  # run_stream's stopper thread closes the source: wakes a reader in a backoff

    # -- the stream's own thread --

    def _run(self) -> None:
        retry = Backoff(FIRST_RETRY_S, MAX_RETRY_S)
        while not self._stop.is_set():
            answered = self.figures.frames
            try:
                error = self._run_once()
            except SourceUnusable as e:  # no retry can fix it: say so once, and stay down
                log.error("stream %s: %s; not retried", self.spec.id, e)
                self._set(StreamState.FAILED, last_error=str(e))
                break
            if self._stop.is_set():
                break
            if error is None:
                self._set(StreamState.ENDED)
                break
            if self.figures.frames > answered:  # a run that answered frames worked: start over
                retry.reset()
            delay = retry.next()
            log.warning("stream %s: %s; retrying in %.1f s", self.spec.id, error, delay)
            self._set(StreamState.RETRYING, last_error=error, retries=self.figures.retries + 1)
            self._stop.wait(delay)
        if self._stop.is_set():
            self._set(StreamState.STOPPED)
        if self.alerts is not None:
            self.alerts.settle()  # its last alert events go out before the stream's end
            self.alerts.close()
        self._post(END)

    def _run_once(self) -> str | None:
        """One run of the source; the error that ended it, or None if it simply ended."""
        spec = self.spec
        failure: list[str] = []
        self._run_stop = run_stop = threading.Event()  # set before _stop is checked: stop() can't miss it
        try:
            self._source = open_source(spec.source, **source_limits(self.pipeline.runtime.config.limits))
            if self._stop.is_set():
                return None
            self._source.on_health = self._source_health
            self._source.open()  # a camera that is not up yet: retrying, from the source's report
            if self._stop.is_set():  # stopped while the open blocked (stop() does not wait for it)
                return None
            generation = {k: v for k, v in (("tier", spec.tier), ("max_new_tokens", spec.max_new_tokens))
                          if v is not None}
            options = StreamOptions(prompt=spec.prompt, every=spec.every, fps=spec.fps,
                                    change_threshold=spec.change_threshold, generation=generation,
                                    route=self.route, live_inflight=STREAM_SHARE, lossless_inflight=STREAM_SHARE,
                                    pool=self.pool, view=self.latest,
                                    also_ask=self.alerts.ask if self.alerts is not None else None)
            self._options = options
            options.prompt = self.spec.prompt  # a prompt changed while the run was being set up
            run_stream(self.pipeline, self._source, options, lambda record: self._emit(record, failure), run_stop)
        except SourceUnusable:
            raise
        except Exception as e:  # a camera that won't open, a bad URI: the stream's problem only
            return str(e) or type(e).__name__
        finally:
            if self._source is not None:
                self._source.close()  # here, in the stream's thread: releasing a capture may take a while
        if not self._source.live:
            return None  # a file or a folder came to its end (a bad file in it is one error event)
        return failure[-1] if failure else "the source stopped delivering frames"

    def _emit(self, record: dict, failure: list[str]) -> None:
        with self._lock:
            if "error" in record:
                self.figures.errors += 1
                self.figures.last_error = record["error"]
                if "frame" not in record:  # the source itself failed (not one frame)
                    failure.append(record["error"])
            else:
                self.figures.frames += 1
                self.figures.dropped = record.get("dropped", 0)
                self.figures.last_result = record
                self.figures.last_result_at = time.time()
        self._post({"stream": self.spec.id, **record})

    def _source_health(self, reason: str | None) -> None:
        """From the source's reading thread: it delivers (None) or it failed and retries."""
        with self._lock:
            if self._stop.is_set() or not self.figures.state.live:
                return
            if reason is None:
                self.figures.state = self.figures.state.to(StreamState.RUNNING)
            else:
                self.figures.state = self.figures.state.to(StreamState.RETRYING)
                self.figures.last_error = reason

    def _post(self, record: dict | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the daemon is exiting
            self.loop.call_soon_threadsafe(self._deliver, record)

    def _post_alert(self, event: dict) -> None:
        """From the pipeline's decode thread: an alert changed state."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._deliver, event, "alert")

    def _set(self, state: StreamState, **changes: Any) -> None:
        with self._lock:
            self.figures.state = self.figures.state.to(state)
            for key, value in changes.items():
                setattr(self.figures, key, value)


@dataclass(frozen=True)
class BodyLimit:
    """The most bytes a route's request body may have, and what the 413 calls it."""
    size: int
    what: str  # "a stream's body"
    why: str   # where the limit comes from, for the message


# Room in a stream's body beside its prompts: id, source, webhook URLs, alerts' rules, JSON's own
STREAM_BODY_ROOM = 16 * 1024
ESCAPED_CHAR_BYTES = 12  # a prompt character, JSON-escaped: \ud83d\ude00 (one above U+FFFF: a surrogate pair)


def stream_body_limit(limits: LimitsConfig, server: Any, prompts: int = 1 + MAX_ALERTS) -> BodyLimit:
    """POST /v1/streams takes a stream and its alerts (1 + MAX_ALERTS prompts), PATCH one prompt
    (`prompts=1`): each of at most limits.max_prompt_chars characters. A body beyond what that can
    take is 413 unread (it was parsed on the event loop: 16 MB took 9 s there)."""
    size = min(server.max_body_bytes, STREAM_BODY_ROOM + prompts * ESCAPED_CHAR_BYTES * limits.max_prompt_chars)
    what = "a stream's body" if prompts > 1 else "a stream change's body"
    return BodyLimit(size, what, f"{prompts} prompt{'s' * (prompts > 1)} of limits.max_prompt_chars and 16 KiB "
                                 "more, within server.max_body_bytes")


def reserved_places(max_streams: int) -> int:
    """Pipeline inbox places the daemon's streams may fill, beyond the API's queue_size:
    each stream's frames and its alerts' questions."""
    return max_streams * (STREAM_SHARE + ALERT_SHARE)


def source_limits(limits: LimitsConfig) -> dict[str, int]:
    """The limits a source is opened with (open_source / check_uri keywords)."""
    return {"max_pixels": limits.max_pixels, "max_synthetic_pixels": limits.max_synthetic_pixels}


def check_configured(specs: list[StreamConfig], limit: int, limits: LimitsConfig | None = None) -> None:
    """The config's streams, checked as far as can be without opening them (a bad URI, or a
    synthetic size over limits.max_pixels / max_synthetic_pixels, fails the start)."""
    bounds = source_limits(limits or LimitsConfig())
    for i, spec in enumerate(specs):
        try:
            check_uri(spec.source, **bounds)
        except SourceError as e:
            raise InputError(f"config: streams[{i}].source ({spec.id}): {e}") from None
    if len(specs) > limit:
        raise InputError(f"config: {len(specs)} streams, above server.max_streams ({limit})")


class StreamManager:
    """The daemon's streams by id. Add and remove from the event loop.

    All streams submit into `pipeline` (the daemon's one, which must keep `reserved_places(limit)`
    inbox places for them). A removed stream may still have frames in flight while a new one
    starts: the pool keeps their total within those places all the same."""

    def __init__(self, pipeline: Pipeline, specs: list[StreamConfig], limit: int,
                 route: Callable[[], Any] | None = None, webhook_hosts: list[str] | None = None,
                 source_hosts: list[str] | None = None):
        self.source_limits = source_limits(pipeline.runtime.config.limits)
        check_configured(specs, limit, pipeline.runtime.config.limits)
        self.pipeline, self.specs, self.limit = pipeline, specs, limit
        for i, spec in enumerate(specs):
            self.check_settings(spec, f"config: streams[{i}] ({spec.id}): ")
        self.pool = threading.BoundedSemaphore(limit * STREAM_SHARE)
        self.alert_pool = threading.BoundedSemaphore(limit * ALERT_SHARE)  # the alerts' questions, likewise
        self.route = route  # the power policy's local placement, asked per frame (Router.local_route)
        self.webhook_hosts = list(webhook_hosts or [])  # server.webhook_hosts: where the API's webhooks may go
        self.source_hosts = list(source_hosts or [])  # server.source_hosts: where the API's network sources may be
        self.streams: dict[str, ManagedStream] = {}
        # removed streams whose thread has not ended yet (a camera call under way must return
        # first): they hold a thread and a connection each, so they count toward max_streams
        self.stopping: list[ManagedStream] = []
        self.all_listeners: set[AllStreamsListener] = set()  # GET /v1/events
        self.connected: set[ListenerQueue] = set()  # every SSE listener whose connection is open (event loop only)
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        for spec in self.specs:
            self.add(spec)

    def check(self, spec: StreamConfig) -> None:
        """What POST /v1/streams refuses before a stream exists: a source the API may not
        start, or a network source on a host outside server.source_hosts (403), or one that cannot work now, checked without opening it (400): no
        GStreamer or no such element, no such device or no camera at that path, permission
        denied, a synthetic size over limits.max_pixels or max_synthetic_pixels. May ask
        GStreamer's registry (a subprocess, once per element): call it off the event loop."""
        kind = self._kind(spec)
        api_may_start(kind)  # before anything looks at the daemon's files
        api_may_connect_to(spec, self.source_hosts)
        api_may_use_tokens(spec)
        api_may_post_to(spec, self.webhook_hosts)
        self.check_settings(spec)
        try:
            open_source(spec.source, **self.source_limits).check()
        except SourceError as e:
            raise StreamSpecError(str(e), "source") from None

    def check_settings(self, spec: StreamConfig, where: str = "") -> None:
        """What every frame of the stream would be refused for, refused once before it starts:
        a tier the model does not have, a prompt over limits.max_prompt_chars, a prompt the
        model's family refuses to build (one holding the image token; Preparation.check_prompt)."""
        runtime = self.pipeline.runtime
        tiers = runtime.manifest.tiers
        if spec.tier is not None and spec.tier not in tiers:
            raise StreamSpecError(f"{where}'tier' must be one of {', '.join(tiers)} (the model's tiers), "
                                  f"got {spec.tier!r}", "tier")
        limit = runtime.config.limits.max_prompt_chars
        if len(spec.prompt) > limit:
            raise StreamSpecError(f"{where}'prompt' is {len(spec.prompt)} characters, above the {limit} limit "
                                  "(limits.max_prompt_chars)", "prompt")
        for name, alert in spec.alerts.items():
            if len(alert.prompt) > limit:
                raise StreamSpecError(f"{where}'alerts.{name}.prompt' is {len(alert.prompt)} characters, above the "
                                      f"{limit} limit (limits.max_prompt_chars)", f"alerts.{name}.prompt")
        prompts = [("prompt", spec.prompt)] + [(f"alerts.{name}.prompt", a.prompt) for name, a in spec.alerts.items()]
        for param, prompt in prompts:
            try:  # the same rule every request goes through (POST /v1/chat/completions, edgemm infer)
                runtime.preparation.check_prompt(prompt, spec.tier)
            except InputError as e:
                raise StreamSpecError(f"{where}'{param}': {e}", param) from None
        try:  # a token's variable or file missing or unsafe: said now, not at the first event
            check_webhooks(spec.alerts, spec.webhook, where)
        except EdgemmError as e:
            raise StreamSpecError(str(e), "webhook") from None

    def add(self, spec: StreamConfig, from_api: bool = False) -> ManagedStream:
        """Start a stream; from the API, `check(spec)` first."""
        assert self.loop is not None, "start() first"
        if spec.id in self.streams:
            raise StreamConflict(f"a stream named {spec.id!r} exists; DELETE it first")
        if len(self.streams) >= self.limit:
            raise StreamConflict(f"{self.limit} streams are running (server.max_streams)")
        stopping = self.still_stopping()
        same = [s for s in stopping if s.spec.id == spec.id]
        if same:  # its listeners, metrics and frame would be the new one's: refused until it ends
            assert same[0].deleted_at is not None
            raise Overloaded(f"server busy: the stream {spec.id!r} deleted {time.monotonic() - same[0].deleted_at:.1f} s "
                             "ago has not ended yet (a camera call under way, or frames in flight); retry shortly")
        if len(self.streams) + len(stopping) >= self.limit:
            raise Overloaded(f"server busy: {len(self.stopping)} deleted streams have not ended yet (a camera call "
                             f"under way, or frames in flight; server.max_streams is {self.limit}); retry shortly")
        kind = self._kind(spec)
        if from_api:
            api_may_start(kind)
            api_may_connect_to(spec, self.source_hosts)
            api_may_use_tokens(spec)
            api_may_post_to(spec, self.webhook_hosts)
        stream = ManagedStream(spec, self.pipeline, self.loop, self.route, self.pool, self.alert_pool)
        stream.listeners.update(self.all_listeners)
        self.streams[spec.id] = stream
        stream.start()
        return stream

    @staticmethod
    def _kind(spec: StreamConfig) -> str:
        try:
            return parse_uri(spec.source).kind
        except SourceError as e:
            raise StreamSpecError(str(e), "source") from None

    def listener_count(self) -> int:
        """SSE listeners connected: of one stream (running, or deleted and not yet hung up on)
        or of all streams at once (server.max_stream_listeners bounds them)."""
        return len(self.connected)

    def listen(self, stream: ManagedStream) -> ListenerQueue:
        """A listener on one stream (from the event loop), counted until unlisten()."""
        queue = stream.listen()
        self.connected.add(queue)
        return queue

    def unlisten(self, stream: ManagedStream, queue: ListenerQueue) -> None:
        """Its connection ended."""
        stream.listeners.discard(queue)
        self.connected.discard(queue)

    def listen_all(self, listener: AllStreamsListener | None = None) -> AllStreamsListener:
        """A listener on every stream, those running and those added later (from the event loop):
        `listener`, or a plain one."""
        listener = AllStreamsListener() if listener is None else listener
        listener.on_lost = self._count_lost
        self.all_listeners.add(listener)
        self.connected.add(listener)
        for stream in self.streams.values():
            stream.listeners.add(listener)
        return listener

    def unlisten_all(self, listener: AllStreamsListener) -> None:
        self.all_listeners.discard(listener)
        self.connected.discard(listener)
        for stream in [*self.streams.values(), *self.stopping]:
            stream.listeners.discard(listener)

    def _count_lost(self, item: tuple) -> None:
        stream_id = item[1].get("stream") if isinstance(item[1], dict) else None
        for stream in [self.streams.get(stream_id), *self.stopping]:
            if stream is not None and stream.spec.id == stream_id:
                stream.count_lost(item)
                return

    def change_prompt(self, stream_id: str, prompt: object) -> ManagedStream:
        """A running stream's new prompt, checked as POST /v1/streams checks it (400 if wrong)."""
        stream = self.get(stream_id)
        spec = stream_spec({**asdict(stream.spec), "prompt": prompt})
        self.check_settings(spec)
        stream.change_prompt(spec)
        return stream

    def get(self, stream_id: str) -> ManagedStream:
        try:
            return self.streams[stream_id]
        except KeyError:
            raise StreamNotFound(f"no stream named {stream_id!r}") from None

    def still_stopping(self) -> list[ManagedStream]:
        """Deleted streams whose thread has not ended yet (from the event loop); the ended ones are let go."""
        self.stopping = [s for s in self.stopping if not s.ended()]
        return list(self.stopping)

    def listed(self) -> list[ManagedStream]:
        """What GET /v1/streams shows: the streams, then those deleted and still stopping."""
        return [*self.streams.values(), *self.still_stopping()]

    def find(self, stream_id: str) -> ManagedStream:
        """GET /v1/streams/{id}: a stream, or a deleted one still stopping."""
        for stream in self.listed():
            if stream.spec.id == stream_id:
                return stream
        raise StreamNotFound(f"no stream named {stream_id!r}")

    def remove(self, stream_id: str) -> ManagedStream:
        """DELETE /v1/streams/{id}: the stream stops. A deleted one still stopping is deleted already:
        the same answer again (as GET lists it, DELETE agrees it is there)."""
        stream = self.find(stream_id)
        if stream.deleted_at is not None:
            return stream
        del self.streams[stream_id]
        stream.deleted_at = time.monotonic()
        stream.stop()
        self.stopping.append(stream)
        return stream

    def stop_all(self) -> None:
        for stream in self.streams.values():
            stream.stop()
        if self.loop is not None:  # the listeners on all streams end now: the daemon is draining
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._close_all_listeners)

    def _close_all_listeners(self) -> None:
        for listener in self.all_listeners:
            listener.close()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for stream in list(self.streams.values()):
            stream.thread.join(max(0.0, deadline - time.monotonic()))
