"""The live view: the page at `GET /`, and the endpoints it needs beyond the API's.

    GET /                              edgemm/server/web/index.html: one self-contained page, no build step
    GET /v1/events[?rate=R]            every stream's results (and alert events) as one SSE
                                       stream, so a page watching many streams holds one connection;
                                       with `rate`, at most R results per stream per second
                                       (ThinnedListener); with `rate` and `frames=jpeg`, each result
                                       carries its own frame as base64 JPEG in `jpeg` (what the page
                                       draws: no frame.jpg request per draw)
    GET /v1/streams/{id}/frame.jpg     the latest answered frame, a JPEG of at most 640 px a side
                                       (edgemm.streams.view.LatestFrame: encoded once per answer, on a pool of
                                       ENCODE_THREADS of its own); 404 before one
    PATCH /v1/streams/{id}             {"prompt": …}: the prompt of the frames submitted from now on

Everything is bounded as the rest of the API: a page's /v1/events is one of
server.max_stream_listeners (503 beyond) and loses its oldest events when the browser reads
slowly (counted in the streams' `lagged`); frame.jpg serves the latest frame only, nothing
is queued for it. The page itself uses the existing API for the rest (GET/POST/DELETE
/v1/streams, /v1/status, /v1/alerts where the daemon has alerts).
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgemm.server.protocol import ApiError
from edgemm.engine.pipeline import Overloaded
from edgemm.server.service import Service
from edgemm.streams.errors import StreamSpecError
from edgemm.streams.manager import END, AllStreamsListener, stream_body_limit
from edgemm.streams.view import LatestFrame

log = logging.getLogger("edgemm")

# the scope key of edgemm.server.connections.LONG_LIVED (see edgemm.server.app for why it is not imported)
LONG_LIVED = "edgemm.long_lived"
KEEPALIVE_S = 15.0  # an SSE comment this often on a quiet /v1/events, so idle proxies keep it open
PATCHABLE = ("prompt",)


def page() -> bytes:
    return resources.files("edgemm").joinpath("server/web/index.html").read_bytes()


def event_text(record: dict, event: str | None) -> str:
    """One SSE event: a result as a plain one, an alert's change as `event: alert` (as the stream's own
    /v1/streams/{id}/events sends them; their ids are per stream, so none is sent here)."""
    kind = f"event: {event}\n" if event else ""
    return f"{kind}data: {json.dumps(record)}\n\n"


# frame.jpg's encodes: a bounded pool of the daemon's own. Its queue holds at most one encode per
# stream: the viewers that ask meanwhile wait for that one (`encoding`)
ENCODE_THREADS = 2
ENCODER = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="edgemm-jpeg")
encoding: dict[LatestFrame, asyncio.Future] = {}  # a stream's frame → its encode under way (event loop only)


async def shared_encode(latest: LatestFrame) -> tuple[int, bytes] | None:
    """latest.jpeg() on ENCODER, one call per stream at a time, shared by the viewers that ask meanwhile."""
    future = encoding.get(latest)
    if future is None:
        future = asyncio.get_running_loop().run_in_executor(ENCODER, latest.jpeg)
        encoding[latest] = future
        future.add_done_callback(lambda _: encoding.pop(latest, None))
    return await asyncio.shield(future)  # a viewer that leaves does not cancel it for the others


async def shared_encode_of(latest: LatestFrame, frame_number: object) -> bytes | None:
    """latest.jpeg_of(frame_number) on ENCODER, shared as shared_encode is (the page's listeners
    ask for the same frame)."""
    key = (latest, frame_number)
    future = encoding.get(key)
    if future is None:
        future = asyncio.get_running_loop().run_in_executor(ENCODER, latest.jpeg_of, frame_number)
        encoding[key] = future
        future.add_done_callback(lambda _: encoding.pop(key, None))
    return await asyncio.shield(future)


async def with_frame(service: Service, record: dict) -> dict:
    """A result with its own frame, base64 JPEG, as `jpeg` (GET /v1/events?frames=jpeg); without
    it when the frame is no longer kept (KEPT_ANSWERED_FRAMES newer answers) or the stream is gone."""
    stream = service.streams.streams.get(record.get("stream"))
    if stream is None or "frame" not in record:
        return record
    try:
        data = await shared_encode_of(stream.latest, record["frame"])
    except Exception:  # a frame that does not encode: the result goes without it (the page fetches frame.jpg)
        log.exception("encoding a stream's frame for /v1/events failed")
        return record
    return {**record, "jpeg": base64.b64encode(data).decode("ascii")} if data is not None else record


# ---- /v1/events?rate=R ---------------------------------------------------------------------------

MAX_RATE = 1000.0  # results per stream per second a listener may ask for; more is every result anyway
MIN_RATE = 0.01  # one result per 100 s: below, a result would wait longer than anyone watches
_RATE = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


def parse_rate(values: list[str]) -> float | None:
    """`?rate=R` of GET /v1/events: None when absent (every result), else a number in [MIN_RATE, MAX_RATE]."""
    if not values:
        return None
    if len(values) > 1:
        raise ApiError("query parameter 'rate' is given more than once", param="rate")
    text = values[0]
    rate = float(text) if _RATE.fullmatch(text) else math.nan
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ApiError(f"'rate' is results per stream per second, a number from {MIN_RATE:g} to {MAX_RATE:g}, "
                       f"got {text[:40]!r}", param="rate")
    return rate


MAX_FRAMES_RATE = 30.0  # ?frames=jpeg: each result sent is a JPEG encode (a few ms): so many a second per stream at most


def parse_frames(values: list[str], rate: float | None) -> bool:
    """`?frames=jpeg` of GET /v1/events: each result with its frame; only with a `rate` up to MAX_FRAMES_RATE."""
    if not values:
        return False
    if len(values) > 1 or values[0] != "jpeg":
        raise ApiError(f"'frames' is 'jpeg' (each result with its frame), given once, got {values[0][:40]!r}",
                       param="frames")
    if rate is None or rate > MAX_FRAMES_RATE:
        raise ApiError(f"'frames=jpeg' needs a 'rate' of at most {MAX_FRAMES_RATE:g} results per stream per second "
                       "(each result sent is a JPEG encode)", param="rate")
    return True


@dataclass
class Thinning:
    """One listener's results, at most `rate` per stream per second. A result that comes sooner
    after its stream's last one sent waits, and a newer one of that stream takes its place
    (newest wins), and goes when its time comes: a stream's latest result reaches the page
    within 1 / rate seconds of its answer. A frame's error record is a result here: a failing
    stream fails every frame (hundreds a second), and the page shows only its newest error
    or answer, whichever came last (a newer answer clears an error, a newer error replaces an
    answer), so the two share the stream's one waiting place and its rate. Alert events are
    never thinned: they go at once, after the result of their stream that was waiting (the
    order of a stream's events is kept). Items are the listeners' (id, record, SSE event name).

    Why: the page draws at most a few times a second; a saturated stream answers ~90 times a
    second with the built-in model, and every event it cannot show costs the daemon a wake-up,
    a JSON encode and a write, and the browser a parse (docs/BENCHMARKS.md, "The live view thinned")."""
    rate: float
    clock: Callable[[], float] = time.monotonic
    waiting: dict[str, tuple] = field(default_factory=dict)  # stream → its newest result unsent
    next_at: dict[str, float] = field(default_factory=dict)  # stream → when its next result may go

    def offer(self, item: tuple) -> list[tuple]:
        """The items to send now, in order, for one that came from the streams."""
        _, record, event = item
        stream = record.get("stream")
        if event is not None or not isinstance(stream, str):
            held = self.waiting.pop(stream, None) if isinstance(stream, str) else None
            return [held, item] if held is not None else [item]
        now = self.clock()
        if now >= self.next_at.get(stream, -math.inf):
            self.waiting.pop(stream, None)
            self._sent(stream, now)
            return [item]
        self.waiting[stream] = item
        return []

    def due(self) -> list[tuple]:
        """The waiting results whose time has come."""
        now = self.clock()
        ready = [s for s in self.waiting if self.next_at[s] <= now]
        for stream in ready:
            self._sent(stream, now)
        return [self.waiting.pop(s) for s in ready]

    def due_all(self) -> list[tuple]:
        """Every waiting result, due or not (the listener ends)."""
        ready = list(self.waiting.values())
        self.waiting.clear()
        return ready

    def wait_s(self) -> float | None:
        """Seconds until the first waiting result is due (None: none is waiting)."""
        if not self.waiting:
            return None
        return max(0.0, min(self.next_at[s] for s in self.waiting) - self.clock())

    def _sent(self, stream: str, now: float) -> None:
        self.next_at[stream] = now + 1.0 / self.rate
        if len(self.next_at) > FORGET_ABOVE:  # streams come and go: one free to send again is as if unseen
            for gone in [s for s, at in self.next_at.items() if at <= now and s not in self.waiting]:
                del self.next_at[gone]


FORGET_ABOVE = 64  # streams a Thinning remembers before it forgets those free to send again


class ThinnedListener(AllStreamsListener):
    """GET /v1/events?rate=R's listener. The streams offer it every result (on the event loop);
    only what Thinning lets through goes into the queue, at once or when its time comes (a timer
    of the loop's, armed for the first result due), so a result that will not be sent never
    wakes the reader. An event the full queue loses to make room is counted in its stream's
    `lagged` (on_lost), whichever path put the newer one in."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.thinning = Thinning(rate, clock)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0  # loop time the timer fires at

    def offer(self, item: tuple) -> None:
        if not self.closed:
            self._enqueue(self.thinning.offer(item))
            self._schedule()
        return None  # what it lost is counted by _enqueue

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.closed:
            self._enqueue(self.thinning.due_all())  # the daemon drains: what waited goes before END
        super().close()

    def _enqueue(self, items: list[tuple]) -> None:
        for item in items:
            lost = super().offer(item)
            if lost is not None and self.on_lost is not None:
                self.on_lost(lost)

    def _schedule(self) -> None:
        wait = self.thinning.wait_s()
        if wait is None:
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + wait
        if self._timer is not None and self._timer_due <= due:
            return  # armed for something due sooner (its _flush arms the next)
        if self._timer is not None:
            self._timer.cancel()
        # (the due time is kept here: uvloop's timer handles have no when())
        self._timer, self._timer_due = loop.call_later(wait, self._flush), due

    def _flush(self) -> None:
        self._timer = None
        if not self.closed:
            self._enqueue(self.thinning.due())
            self._schedule()


def live_view_routes(service: Service, read_json: Callable[..., Awaitable[object]]) -> list[Route]:
    """The page's routes; `read_json` is edgemm.server.app's body reader (its limits and timeouts)."""
    html = page()  # read once: the page is part of the package

    async def index(http: HttpRequest) -> Response:
        return Response(html, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    async def all_events(http: HttpRequest) -> Response:
        manager = service.streams
        rate = parse_rate(http.query_params.getlist("rate"))  # before the listener's place is taken
        frames = parse_frames(http.query_params.getlist("frames"), rate)
        limit = service.server.max_stream_listeners
        if manager.listener_count() >= limit:
            raise Overloaded(f"server busy: {limit} stream listeners are connected (server.max_stream_listeners); "
                             f"retry in {service.server.retry_after_s} s")
        if callable(mark := http.scope.get(LONG_LIVED)):
            mark()  # out of server.max_connections, as a stream's own listener
        listener = manager.listen_all(ThinnedListener(rate) if rate is not None else None)

        async def events():
            try:
                yield ": edgemm live view\n\n"  # the headers and a first byte now: EventSource opens at once
                while True:
                    try:
                        item = await asyncio.wait_for(listener.get(), KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                    if item is END:
                        break
                    _, record, event = item
                    if frames and event is None and "answer" in record:
                        record = await with_frame(service, record)
                    yield event_text(record, event)
            finally:
                manager.unlisten_all(listener)
                if not listener.closed:
                    listener.close()  # the client left: a thinned one's timer goes with it

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def frame_jpeg(http: HttpRequest) -> Response:
        stream = service.streams.get(http.path_params["id"])  # 404 for no such stream
        latest = stream.latest
        # encoding (a few ms for 640 px) off the event loop, on the live view's own threads (not
        # asyncio's default executor, which remote image fetches use); a frame already encoded is
        # not encoded again, and viewers asking while it is share that one encode
        encoded = latest.cached() or await shared_encode(latest)
        if encoded is None:
            raise ApiError(f"stream {stream.spec.id!r} has no answered frame yet", status=404, code="no_frame")
        number, data = encoded
        return Response(data, media_type="image/jpeg",
                        headers={"Cache-Control": "no-store", "X-Edgemm-Answer": str(number)})

    async def patch_stream(http: HttpRequest) -> Response:
        limit = stream_body_limit(service.runtime.config.limits, service.server, prompts=1)
        body = await read_json(http, admit=False, limit=limit)  # like POST /v1/streams: no request slot
        if not isinstance(body, dict) or not body:
            raise StreamSpecError("a stream change is a JSON object: {\"prompt\": …}")
        unknown = sorted(set(body) - set(PATCHABLE))
        if unknown:
            raise StreamSpecError(f"only {', '.join(PATCHABLE)} can be changed on a running stream, "
                                  f"not {unknown[0]!r} (DELETE it and POST it anew)", unknown[0])
        stream = service.streams.change_prompt(http.path_params["id"], body["prompt"])
        return JSONResponse(stream.describe())

    return [
        Route("/", index, methods=["GET"]),
        Route("/v1/events", all_events, methods=["GET"]),
        Route("/v1/streams/{id}/frame.jpg", frame_jpeg, methods=["GET"]),
        Route("/v1/streams/{id}", patch_stream, methods=["PATCH"]),
    ]
