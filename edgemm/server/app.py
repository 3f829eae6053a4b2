"""`edgemm serve`'s HTTP side: the routes and how errors become responses.

    client ─► uvicorn (UNIX socket, systemd's socket, or loopback TCP) ─► MeasuredApp (/metrics)
           ─► a route: body (≤ server.max_body_bytes or the route's smaller limit, else 413; within
              server.body_timeout_s of its headers, else 408; before admission) ─► JSON (a large
              body on JSON_PARSER's thread, off the event loop) ─► OpenAI schema (edgemm.server.protocol)
           ─► the service (edgemm.server.service: admission, the pipeline, cancellation, SSE)
           ─► JSON, or server-sent events

Every error a route raises becomes OpenAI's error shape with its status (`describe`):
a 503 carries Retry-After, and a 413 or 503 closes the connection, since its body may
be unread. The daemon around it (sockets, systemd, signals, draining) is edgemm.server.daemon.
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgemm.errors import EdgemmError, Overloaded
from edgemm.util.errors import LimitError
from edgemm.util.generation_limits import check_text
from edgemm.server.liveview import live_view_routes
from edgemm.server.metrics import CONTENT_TYPE, MeasuredApp
from edgemm.server.protocol import (DEFAULT_PROMPT, ApiError, completion, error_body, generation_options, load_image_url,
                               parse_chat_request, parse_json_body)
from edgemm.server.service import Service, describe, sse
from edgemm.streams.manager import END, BodyLimit, stream_body_limit, stream_spec

# the scope key of edgemm.server.connections.LONG_LIVED, not imported from there: that module needs
# httptools, which the h11 fallback runs without (and then there is no connection count)
LONG_LIVED = "edgemm.long_lived"
EVICT_BODY = "edgemm.evict_body"  # edgemm.server.connections.EVICT_BODY, likewise
# the body-byte pool full: how long a body waits for the upload evicted for it to release its
# bytes (its reader is woken at once; this only bounds the wait)
POOL_WAIT_S = 0.5
# JSON bodies above this are parsed on JSON_PARSER's thread, not on the event loop (up to
# MAX_JSON_VALUES values: a few hundred ms); smaller ones take microseconds, less than the hop
INLINE_JSON_BYTES = 64 * 1024
JSON_PARSER = ThreadPoolExecutor(1, thread_name_prefix="edgemm-json")


class Routes:
    """The endpoints: HTTP in, the service's work, HTTP out."""

    def __init__(self, service: Service):
        self.service = service
        # bytes of request bodies being received (touched only on the event loop), and their bound
        self.reading_bytes = 0
        self.reading_limit = service.server.queue_size * service.server.max_body_bytes
        self.released = asyncio.Event()  # set (and replaced) each time a body's bytes leave the pool

    # -- endpoints --

    async def chat_completions(self, http: HttpRequest) -> Response:
        # the body first, under its own deadline: a client trickling it holds no admission slot
        chat = parse_chat_request(await self.read_json(http))
        self.check_model(chat.model)
        with self.service.admitted() as ticket:
            if chat.image_url[:5].lower() == "data:":  # in memory: decoding inline (~0.02 ms) beats a thread hop
                image = load_image_url(chat.image_url, chat.image_param, self.service.images)
            else:  # file and http(s) URLs block on I/O: off the event loop
                image = await asyncio.to_thread(load_image_url, chat.image_url, chat.image_param, self.service.images)
            job = self.service.submit(ticket, image, chat.prompt, chat.options, stream=chat.stream)
        request_id, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if chat.stream:
            assert job.feed is not None
            await self.service.wait(job, http, job.feed.changed.wait())
            if job.future.done():
                self.service.outcome(job)  # an error before the first token keeps its HTTP status
            return StreamingResponse(self.service.chunks(job, chat, request_id, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        result = await self.service.answer(job, http)
        return JSONResponse(completion(result, request_id, self.service.model_id, created))

    async def infer(self, http: HttpRequest) -> Response:
        prompt, options = infer_query(query_params(http.scope["query_string"]))
        image = await self.read_body(http)  # before admission, as for chat
        if not image:
            raise ApiError("no image: send the image file as the request body "
                           "(curl --data-binary @photo.jpg)", code="missing_image")
        with self.service.admitted() as ticket:
            job = self.service.submit(ticket, image, prompt, options)
        result = await self.service.answer(job, http)
        return JSONResponse({"answer": result.text, "prompt": prompt, **result.to_dict()})

    async def models(self, http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self.service.model_card()]})

    async def model(self, http: HttpRequest) -> Response:
        self.check_model(http.path_params["model"])
        return JSONResponse(self.service.model_card())

    async def healthz(self, http: HttpRequest) -> Response:
        """Liveness: 503 when the pipeline can no longer answer (a stage thread died, or a stage
        is stalled past server.stall_s), the same condition on which the systemd watchdog
        stops being pinged, so a container's liveness probe restarts it as systemd would.
        Draining is alive: the requests in flight are being finished."""
        health = self.service.health()
        if not health.ok:
            return JSONResponse({"status": "unhealthy", "reason": health.reason}, 503,
                                {"Retry-After": str(self.service.server.retry_after_s)})
        return JSONResponse({"status": "ok"})

    async def readyz(self, http: HttpRequest) -> Response:
        if self.service.draining:
            return JSONResponse({"status": "draining"}, 503, {"Retry-After": str(self.service.server.retry_after_s)})
        health = self.service.health()
        if not health.ok:
            return JSONResponse({"status": "unhealthy", "reason": health.reason}, 503,
                                {"Retry-After": str(self.service.server.retry_after_s)})
        return JSONResponse({"status": "ready", "model": self.service.model_id, "precision": self.service.runtime.precision})

    async def metrics_text(self, http: HttpRequest) -> Response:
        return Response(self.service.metrics.registry.render(), media_type=CONTENT_TYPE)

    async def status(self, http: HttpRequest) -> Response:
        return JSONResponse(self.service.status_report())

    # -- camera streams run by the daemon (edgemm.streams.manager) --

    async def list_streams(self, http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [s.describe() for s in self.service.streams.listed()]})

    async def add_stream(self, http: HttpRequest) -> Response:
        if self.service.draining:
            raise Overloaded("the server is shutting down")
        limit = stream_body_limit(self.service.runtime.config.limits, self.service.server)
        spec = stream_spec(await self.read_json(http, admit=False, limit=limit))  # a stream takes no request slot
        await asyncio.to_thread(self.service.streams.check, spec)  # 403/400 now; may ask GStreamer
        stream = self.service.streams.add(spec, from_api=True)
        return JSONResponse(stream.describe(), 201)

    async def get_stream(self, http: HttpRequest) -> Response:
        return JSONResponse(self.service.streams.find(http.path_params["id"]).describe())

    async def delete_stream(self, http: HttpRequest) -> Response:
        stream = self.service.streams.remove(http.path_params["id"])
        return JSONResponse({"id": stream.spec.id, "object": "stream.deleted", "deleted": True})

    async def stream_events(self, http: HttpRequest) -> Response:
        """The stream's results as server-sent events, until the stream stops or the client leaves."""
        stream = self.service.streams.get(http.path_params["id"])
        limit = self.service.server.max_stream_listeners
        if self.service.streams.listener_count() >= limit:
            raise Overloaded(f"server busy: {limit} stream listeners are connected (server.max_stream_listeners); "
                             f"retry in {self.service.server.retry_after_s} s")
        # a listener stays for as long as the stream runs: out of server.max_connections (edgemm.server.connections)
        if callable(mark := http.scope.get(LONG_LIVED)):
            mark()
        queue = self.service.streams.listen(stream)

        async def events():
            try:
                while (item := await queue.get()) is not END:
                    event_id, record, event = item  # event: None for a result, "alert" for an alert's change
                    yield f"id: {event_id}\n" + (f"event: {event}\n" if event else "") + sse(record)
            finally:
                self.service.streams.unlisten(stream, queue)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def list_alerts(self, http: HttpRequest) -> Response:
        """Every stream's alerts (edgemm.streams.alerts): state, and the frame and time it last changed."""
        streams = list(self.service.streams.streams.values())
        return JSONResponse({"object": "list", "data": [row for s in streams if s.alerts is not None
                                                         for row in s.alerts.states()]})

    async def read_body(self, http: HttpRequest, admit: bool = True, limit: BodyLimit | None = None) -> bytes:
        """The body, at most server.max_body_bytes or the route's smaller `limit` (else 413), within
        server.body_timeout_s of its headers (else 408). Read before admission, so a slow body holds
        no slot. Bodies being read hold at most queue_size × max_body_bytes together, the bound
        admission gave when it came first: beyond, the slowest upload is closed to make room
        (pool_room), else 503. `admit`: a request that needs a slot is refused
        (503) unread when there is none."""
        cfg = self.service.server
        if admit:
            self.service.check_admissible()  # no body is read for a request that would be refused anyway
        limit = limit or BodyLimit(cfg.max_body_bytes, "request body", "server.max_body_bytes")
        too_large = ApiError(f"{limit.what} is larger than {limit.size} bytes ({limit.why})",
                             status=413, code="request_too_large")
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit.size:
            raise too_large  # refused unread
        body = bytearray()

        async def receive() -> None:
            async for piece in http.stream():
                if self.reading_bytes + len(piece) > self.reading_limit:
                    await self.pool_room(http, len(piece))
                body.extend(piece)
                self.reading_bytes += len(piece)
                if len(body) > limit.size:
                    raise too_large

        try:
            # wait_for, not asyncio.timeout: Python 3.10 (JetPack 6's) has neither timeout nor
            # timeout_at, and its wait_for raises asyncio.TimeoutError, not yet the builtin one
            await asyncio.wait_for(receive(), cfg.body_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise ApiError(f"the request body did not arrive within {cfg.body_timeout_s:g} s "
                           "(server.body_timeout_s)", status=408, code="timeout") from None
        except ClientDisconnect:  # the client hung up mid-body: nobody to answer, nothing to log
            raise ApiError("the client closed the connection", status=499, kind="client_closed") from None
        finally:
            self.release_bytes(len(body))
        return bytes(body)

    def release_bytes(self, size: int) -> None:
        """`size` bytes of a body leave the pool: wakes the bodies waiting for room (pool_room)."""
        self.reading_bytes -= size
        if size:
            self.released.set()
            self.released = asyncio.Event()

    async def pool_room(self, http: HttpRequest, size: int) -> None:
        """The body-byte pool cannot take `size` more bytes: make room by closing the slowest
        upload that has had BODY_GRACE_S (edgemm.server.connections: 408 body_evicted), so clients
        stalling their bodies cannot lock every body out; wait at most POOL_WAIT_S for its
        bytes to be released. 503 if no upload can be closed, or room did not come."""
        evict = http.scope.get(EVICT_BODY)  # absent under the h11 fallback: no eviction
        loop = asyncio.get_running_loop()
        deadline = loop.time() + POOL_WAIT_S
        while self.reading_bytes + size > self.reading_limit:
            released = self.released
            # evict one upload, then wait for a release before judging whether to evict another
            if deadline <= loop.time() or not (callable(evict) and evict()):
                retry = self.service.server.retry_after_s
                raise ApiError(f"server busy: request bodies being received hold {self.reading_bytes} of "
                               f"{self.reading_limit} bytes (server.queue_size x server.max_body_bytes), and "
                               f"none arrives slowly enough to be closed; retry in {retry} s",
                               status=503, kind="overloaded", code="body_pool_full")
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(released.wait(), max(0.0, deadline - loop.time()))

    async def read_json(self, http: HttpRequest, admit: bool = True, limit: BodyLimit | None = None) -> object:
        """The body (read_body) as JSON (parse_json_body), a large one parsed off the event loop.
        Its bytes stay in the body pool until parsed, so bodies waiting for the parser are bounded
        as those arriving are; the body's clock (body_timeout_s) stopped when its last byte came."""
        body = await self.read_body(http, admit, limit)
        if len(body) <= INLINE_JSON_BYTES:
            return parse_json_body(body)
        self.reading_bytes += len(body)
        try:
            return await asyncio.get_running_loop().run_in_executor(JSON_PARSER, parse_json_body, body)
        finally:
            self.release_bytes(len(body))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.service.model_id:
            raise ApiError(f"model {model!r} is not served here (this server has {self.service.model_id!r})",
                           status=404, param="model", code="model_not_found")


def query_params(query: bytes) -> dict[str, str]:
    """The query string's parameters, refusing what is not UTF-8 (`?prompt=%ed%a0%80`,
    `%ff`), where Starlette would put U+FFFD in its place, and a parameter given twice
    (which one was meant is not ours to guess), each with a 400 naming the parameter."""
    params: dict[str, str] = {}
    # latin-1 maps each byte to one character, so the percent-decoded bytes come back intact
    for key, value in urllib.parse.parse_qsl(query.decode("latin-1"), keep_blank_values=True, encoding="latin-1"):
        key = _utf8(key, "the query string")
        if key in params:
            raise ApiError(f"query parameter {key!r} is given more than once", param=key)
        params[key] = _utf8(value, key)
    return params


def _utf8(text: str, param: str) -> str:
    try:
        return text.encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(f"{param!r} must be UTF-8 text (percent-encoded), got percent-encoded bytes that are not UTF-8", param=param) from None


_INTEGER = re.compile(r"[0-9]+")  # int() would take '१', '1_0' and '+5' (%2B5) too
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(nan|inf|infinity)", re.IGNORECASE)


def infer_query(params: dict[str, str]) -> tuple[str, dict]:
    """/v1/infer?prompt=…&max_tokens=…&temperature=…&top_p=…&seed=…&tier=… → (prompt, options).
    Integers are ASCII digits only, without a sign (a negative one is out of range anyway); numbers are ASCII
    (nan and inf are left to the limits, which name them)."""
    typed: dict = {}
    for key, kind in (("max_tokens", int), ("seed", int), ("temperature", float), ("top_p", float)):
        if key in params:
            text = params.pop(key)
            if not (_INTEGER if kind is int else _NUMBER).fullmatch(text):
                raise ApiError(f"'{key}' must be {'an integer' if kind is int else 'a number'} in ASCII digits, "
                               f"got {text[:40]!r}", param=key)
            try:
                typed[key] = kind(text)
            except ValueError:  # an integer beyond Python's 4300 digits
                raise ApiError(f"'{key}' must be an integer, got one of {len(text)} digits", param=key) from None
    if "tier" in params:
        typed["edgemm"] = {"tier": params.pop("tier")}
    prompt = params.pop("prompt", DEFAULT_PROMPT)
    try:
        check_text(prompt, "prompt")  # ?prompt=%00
    except LimitError as e:
        raise ApiError(str(e), param="prompt") from None
    if params:
        raise ApiError(f"unknown query parameter {sorted(params)[0]!r} "
                       "(known: prompt, max_tokens, temperature, top_p, seed, tier)", param=sorted(params)[0])
    return prompt, generation_options(typed)


def create_app(service: Service) -> MeasuredApp:
    api = Routes(service)
    routes = [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/infer", api.infer, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/v1/streams", api.list_streams, methods=["GET"]),
        Route("/v1/streams", api.add_stream, methods=["POST"]),
        Route("/v1/streams/{id}", api.get_stream, methods=["GET"]),
        Route("/v1/streams/{id}", api.delete_stream, methods=["DELETE"]),
        Route("/v1/streams/{id}/events", api.stream_events, methods=["GET"]),
        Route("/v1/alerts", api.list_alerts, methods=["GET"]),
        Route("/v1/status", api.status, methods=["GET"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/readyz", api.readyz, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
    ]
    routes += live_view_routes(service, api.read_json)  # GET /, /v1/events, frame.jpg, PATCH a stream

    async def on_error(http: HttpRequest, error: Exception) -> Response:
        status, kind, message = describe(error)
        headers = {}
        if status == 503:
            headers["Retry-After"] = str(service.server.retry_after_s)
        if status in (408, 413, 503):
            headers["Connection"] = "close"  # the body may be unread: don't reuse the connection
        return JSONResponse(error_body(message, kind, getattr(error, "param", None), getattr(error, "code", None)),
                            status, headers)

    app = Starlette(routes=routes, exception_handlers={HTTPException: on_error, EdgemmError: on_error,
                                                       Exception: on_error})
    return MeasuredApp(app, service.metrics)
