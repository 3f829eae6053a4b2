"""`edgemm serve`: the HTTP API on a UNIX socket, in front of one pipeline.

    client ─► uvicorn (UNIX socket, systemd's socket, or loopback TCP)
           ─► admission: at most server.queue_size requests at once; beyond, 503 + Retry-After
           ─► body (≤ server.max_body_bytes, else 413) ─► OpenAI schema (edgemm.openai_api)
           ─► Pipeline.submit ─► concurrent Future ─► asyncio ─► JSON, or SSE chunks

The pipeline runs in its own threads; the event loop only waits on its futures
(through asyncio.wrap_future) and on the text-so-far of streamed answers (pushed
from the decode thread with call_soon_threadsafe). A request keeps its admission
slot until the pipeline is done with it, so requests that time out or whose client
left still count until their work stops: memory is bounded by queue_size.

A client that goes away (or a request that times out) sets the job's `cancelled`
flag; the decoder stops at its next token. A request still waiting for the encoder
cannot be taken out of the pipeline (it has no cancel), so it is encoded and then
dropped at its first token.

Camera streams the daemon runs (edgemm.streams) are listed, added and removed under
/v1/streams; their frames go into the same pipeline as the API's requests (each stream
within its own share, edgemm.streams) and their results go out as server-sent events.

The daemon around it (sockets, systemd, signals, draining) is edgemm.daemon.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgemm.config import Config, ServerConfig
from edgemm.errors import Cancelled, EdgemmError, internal_message
from edgemm.metrics import CONTENT_TYPE, Counter, Gauge, Histogram, Registry
from edgemm.openai_api import (DEFAULT_PROMPT, ApiError, ChatRequest, ImagePolicy, chunk, completion, error_body,
                               extras, finish_reason, generation_options, load_image_url, parse_chat_request,
                               usage)
from edgemm.pipeline import Health, Overloaded, Pipeline, Request, mark_logged, was_logged
from edgemm.router import Router
from edgemm.answering import InferenceResult
from edgemm.runtime import Runtime
from edgemm.streams import END, StreamManager, stream_spec

log = logging.getLogger("edgemm")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ENDPOINTS = ("/v1/chat/completions", "/v1/infer", "/v1/models", "/v1/streams", "/v1/status", "/healthz", "/readyz",
             "/metrics")


# ---- admission: a bounded number of requests at once ------------------------------------

class Admission:
    """Requests admitted: from before their body is read until the pipeline is done with them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0
        self._lock = threading.Lock()  # released from pipeline threads too

    def enter(self, retry_after_s: int) -> "Ticket":
        with self._lock:
            if self.count >= self.limit:
                raise Overloaded(f"server busy: {self.limit} requests in flight (server.queue_size); "
                                 f"retry in {retry_after_s} s")
            self.count += 1
        return Ticket(self)

    def leave(self) -> None:
        with self._lock:
            self.count -= 1


class Ticket:
    """One admission slot; release() is idempotent, so every path may call it."""

    def __init__(self, admission: Admission):
        self._admission, self._held = admission, True
        self._lock = threading.Lock()

    def release(self, *_: object) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._admission.leave()


# ---- a request in the pipeline, seen from the event loop --------------------------------

class TokenFeed:
    """The answer so far, from the decode thread to the event loop.

    The decoder hands over the text each token adds; the feed appends it, and the SSE
    writer sends what it has not sent yet. No queue: a slow client gets what was
    generated meanwhile as one larger delta, so nothing piles up between decoder and
    socket (the text itself is bounded by max_tokens).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.text = ""
        self.finished = False
        self.changed = asyncio.Event()

    def push(self, text: str | None, finished: bool = False) -> None:
        """From any thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is exiting
            self.loop.call_soon_threadsafe(self._update, text, finished)

    def _update(self, text: str | None, finished: bool) -> None:
        if text is not None:
            self.text += text
        self.finished = self.finished or finished
        self.changed.set()


@dataclass
class Job:
    future: Future  # the pipeline's
    done: asyncio.Future  # the same, awaitable; shielded so that no cancel reaches the pipeline
    deadline: float  # loop.time() by which the answer is due
    cancelled: threading.Event = field(default_factory=threading.Event)
    feed: TokenFeed | None = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())


# ---- the service: HTTP requests ↔ pipeline -------------------------------------------------

class Service:
    def __init__(self, runtime: Runtime, pipeline: Pipeline, config: Config, router: Router | None = None):
        self.runtime, self.pipeline, self.config = runtime, pipeline, config
        self.router = router or Router(config)  # without one: no telemetry, no offload, all local
        self.server: ServerConfig = config.server
        self.model_id = runtime.manifest.name
        self.created = int(time.time())
        self.admission = Admission(self.server.queue_size)
        self.images = ImagePolicy(self.server.image_dirs, self.server.remote_images,
                                  self.server.remote_timeout_s, config.limits.max_image_bytes)
        self.streams = StreamManager(pipeline, config.streams, self.server.max_streams,
                                     route=self.router.local_route)
        self.draining = False
        self.metrics = ServiceMetrics(self)

    # -- endpoints --

    async def chat_completions(self, http: HttpRequest) -> Response:
        with self.admitted() as ticket:
            chat = parse_chat_request(await self.read_json(http))
            self.check_model(chat.model)
            if chat.image_url[:5].lower() == "data:":  # in memory: decoding inline (~0.02 ms) beats a thread hop
                image = load_image_url(chat.image_url, chat.image_param, self.images)
            else:  # file and http(s) URLs block on I/O: off the event loop
                image = await asyncio.to_thread(load_image_url, chat.image_url, chat.image_param, self.images)
            job = self.submit(ticket, image, chat.prompt, chat.options, stream=chat.stream)
        request_id, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if chat.stream:
            assert job.feed is not None
            await self.wait(job, http, job.feed.changed.wait())
            if job.future.done():
                self.outcome(job)  # an error before the first token keeps its HTTP status
            return StreamingResponse(self.chunks(job, chat, request_id, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        result = await self.answer(job, http)
        return JSONResponse(completion(result, request_id, self.model_id, created))

    async def infer(self, http: HttpRequest) -> Response:
        with self.admitted() as ticket:
            prompt, options = infer_query(dict(http.query_params))
            image = await self.read_body(http)
            if not image:
                raise ApiError("no image: send the image file as the request body "
                               "(curl --data-binary @photo.jpg)", code="missing_image")
            job = self.submit(ticket, image, prompt, options)
        result = await self.answer(job, http)
        return JSONResponse({"answer": result.text, "prompt": prompt, **result.to_dict()})

    async def models(self, http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, http: HttpRequest) -> Response:
        self.check_model(http.path_params["model"])
        return JSONResponse(self.model_card())

    async def healthz(self, http: HttpRequest) -> Response:
        """Liveness: 503 when the pipeline can no longer answer (a stage thread died, or a stage
        is stalled past server.stall_s), the same condition on which the systemd watchdog
        stops being pinged, so a container's liveness probe restarts it as systemd would.
        Draining is alive: the requests in flight are being finished."""
        health = self.health()
        if not health.ok:
            return JSONResponse({"status": "unhealthy", "reason": health.reason}, 503,
                                {"Retry-After": str(self.server.retry_after_s)})
        return JSONResponse({"status": "ok"})

    async def readyz(self, http: HttpRequest) -> Response:
        if self.draining:
            return JSONResponse({"status": "draining"}, 503, {"Retry-After": str(self.server.retry_after_s)})
        health = self.health()
        if not health.ok:
            return JSONResponse({"status": "unhealthy", "reason": health.reason}, 503,
                                {"Retry-After": str(self.server.retry_after_s)})
        return JSONResponse({"status": "ready", "model": self.model_id, "precision": self.runtime.precision})

    async def metrics_text(self, http: HttpRequest) -> Response:
        return Response(self.metrics.registry.render(), media_type=CONTENT_TYPE)

    async def status(self, http: HttpRequest) -> Response:
        return JSONResponse(self.status_report())

    # -- camera streams run by the daemon (edgemm.streams) --

    async def list_streams(self, http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [s.describe() for s in self.streams.streams.values()]})

    async def add_stream(self, http: HttpRequest) -> Response:
        if self.draining:
            raise Overloaded("the server is shutting down")
        stream = self.streams.add(stream_spec(await self.read_json(http)), from_api=True)
        return JSONResponse(stream.describe(), 201)

    async def get_stream(self, http: HttpRequest) -> Response:
        return JSONResponse(self.streams.get(http.path_params["id"]).describe())

    async def delete_stream(self, http: HttpRequest) -> Response:
        stream = self.streams.remove(http.path_params["id"])
        return JSONResponse({"id": stream.spec.id, "object": "stream.deleted", "deleted": True})

    async def stream_events(self, http: HttpRequest) -> Response:
        """The stream's results as server-sent events, until the stream stops or the client leaves."""
        stream = self.streams.get(http.path_params["id"])
        queue = stream.listen()

        async def events():
            try:
                while (record := await queue.get()) is not END:
                    yield sse(record)
            finally:
                stream.listeners.discard(queue)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def health(self) -> Health:
        """The pipeline's health (Pipeline.health with server.stall_s): /readyz, /healthz,
        /v1/status, the watchdog."""
        return self.pipeline.health(self.server.stall_s)

    # -- the steps every inference request goes through --

    @contextlib.contextmanager
    def admitted(self) -> Iterator[Ticket]:
        """A slot, or Overloaded (503). The slot goes back if the request fails before the pipeline."""
        if self.draining:
            raise Overloaded("the server is shutting down")
        ticket = self.admission.enter(self.server.retry_after_s)
        try:
            yield ticket
        except BaseException:
            ticket.release()
            raise

    async def read_body(self, http: HttpRequest) -> bytes:
        limit = self.server.max_body_bytes
        too_large = ApiError(f"request body is larger than {limit} bytes (server.max_body_bytes)",
                             status=413, code="request_too_large")
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large  # refused unread
        body = bytearray()
        async for piece in http.stream():
            body += piece
            if len(body) > limit:
                raise too_large
        return bytes(body)

    async def read_json(self, http: HttpRequest) -> object:
        body = await self.read_body(http)
        try:
            return json.loads(body)
        except UnicodeDecodeError:
            raise ApiError("the request body is not UTF-8 JSON") from None
        except json.JSONDecodeError as e:
            raise ApiError(f"the request body is not valid JSON: {e.msg} (line {e.lineno} column {e.colno})") from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise ApiError(f"model {model!r} is not served here (this server has {self.model_id!r})",
                           status=404, param="model", code="model_not_found")

    def submit(self, ticket: Ticket, image: bytes | str, prompt: str, options: dict,
               stream: bool = False) -> Job:
        """Into the pipeline without waiting; a full pipeline raises Overloaded (503)."""
        loop = asyncio.get_running_loop()
        feed = TokenFeed(loop) if stream else None
        # only a streamed answer is detokenized as it goes; the decode loop checks the
        # request's cancel flag between steps (edgemm/decode.py)
        request = Request(image, prompt, options, on_token=(lambda _token, text: feed.push(text)) if feed else None)
        cancelled = request.cancelled
        future = self.router.submit(request, self.pipeline, self.admission.count - 1)  # local, or the cloud
        future.add_done_callback(ticket.release)
        if feed is not None:
            future.add_done_callback(lambda _: feed.push(None, finished=True))
        # wrap_future would cancel the pipeline's future if the asyncio one were cancelled
        # (and the pipeline can't take that), so the handlers only ever see a shield.
        done = asyncio.shield(asyncio.wrap_future(future))
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen: its client may be gone
        return Job(future, done, loop.time() + self.server.request_timeout_s, cancelled, feed)

    async def wait(self, job: Job, http: HttpRequest, event: Awaitable) -> None:
        """Until `event`; on timeout (504) or a client that left (499) the job is cancelled."""
        waiting = asyncio.ensure_future(event)
        gone = asyncio.ensure_future(disconnected(http))
        try:
            finished, _ = await asyncio.wait({waiting, gone}, timeout=job.remaining(),
                                             return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if waiting is not job.done:
                waiting.cancel()
        if waiting in finished:
            return
        job.cancelled.set()
        if gone in finished:
            raise ApiError("the client closed the connection", status=499, kind="client_closed")
        raise ApiError(f"no answer within {self.server.request_timeout_s} s (server.request_timeout_s)",
                       status=504, kind="timeout", code="timeout")

    async def answer(self, job: Job, http: HttpRequest) -> InferenceResult:
        await self.wait(job, http, job.done)
        result = self.outcome(job)
        self.metrics.answered(result)
        return result

    def outcome(self, job: Job) -> InferenceResult:
        """A finished job's result, or its error as one the client is answered with."""
        try:
            return job.future.result()
        except (EdgemmError, Cancelled):
            raise
        except Exception as e:  # a bug or a backend failure: a 500 for the client
            message = internal_message(e)
            if not was_logged(e):  # once: a stage's crash barrier, or another request sharing it, may have
                log.error("inference failed: %s", message, exc_info=e)
                mark_logged(e)
            raise EdgemmError(message) from e

    async def chunks(self, job: Job, chat: ChatRequest, request_id: str, created: int):
        """The SSE body: a role chunk, content deltas, a finish chunk, [usage], [DONE]."""
        feed = job.feed
        assert feed is not None

        def piece(delta: dict | None, finish: str | None = None, **more) -> str:
            return sse(chunk(request_id, self.model_id, created, delta, finish, **more))

        sent = ""
        try:
            yield piece({"role": "assistant", "content": ""})
            while True:
                if feed.text[len(sent):]:
                    yield piece({"content": feed.text[len(sent):]})
                    sent = feed.text
                if feed.finished:
                    break
                feed.changed.clear()
                try:
                    await asyncio.wait_for(feed.changed.wait(), job.remaining())
                except asyncio.TimeoutError:
                    job.cancelled.set()
                    yield sse(error_body(f"no answer within {self.server.request_timeout_s} s", "timeout",
                                         code="timeout"))
                    break
            if feed.finished:
                yield self.last_chunks(job, chat, sent, piece)
            yield "data: [DONE]\n\n"
        finally:
            if not job.future.done():
                job.cancelled.set()  # the client went away mid-answer

    def last_chunks(self, job: Job, chat: ChatRequest, sent: str, piece: Callable[..., str]) -> str:
        """The rest of the text, the finish chunk with edgemm's figures, and usage if asked."""
        try:
            result = self.outcome(job)
        except Exception as e:  # headers are sent: OpenAI's way is an error event in the stream
            _, kind, message = describe(e)
            return sse(error_body(message, kind, code=getattr(e, "code", None)))
        self.metrics.answered(result)
        tail = result.text[len(sent):] if result.text.startswith(sent) else ""
        out = piece({"content": tail}) if tail else ""
        out += piece({}, finish_reason(result), edgemm=extras(result))
        if chat.include_usage:
            out += piece(None, usage=usage(result))
        return out

    # -- for /v1/models and STATUS= --

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "edgemm"}

    def status_report(self) -> dict:
        """GET /v1/status and `edgemm status`: telemetry, placement and why, devices, offload, cache, queues."""
        sampler = self.router.sampler
        telemetry = sampler.latest() if sampler else None
        cache = self.runtime.cache.stats().to_dict() if getattr(self.runtime, "cache", None) else None
        stats = self.pipeline.stats
        health = self.health()
        return {"daemon": "draining" if self.draining else "serving", "model": self.model_id,
                "health": {**health.to_dict(), "stall_s": self.server.stall_s},
                "precision": self.runtime.precision,
                "telemetry": telemetry.to_dict() if telemetry else None,
                "placement": self.router.preview(self.admission.count).to_dict(),
                "last_placement": self.router.governor.last.to_dict() if self.router.governor.last else None,
                "power": self.router.governor.figures(),
                "components": components(self.runtime),
                "offload": self.router.offload_status(),
                "cache": cache,
                "queue": {"in_flight": self.admission.count, "limit": self.admission.limit,
                          "depths": self.pipeline.depths(), "completed": stats.completed, "failed": stats.failed,
                          "rejected": stats.rejected,
                          "encoder_batch": {tier: self.pipeline.encoder_batch.get(tier, self.pipeline.max_batch)
                                            for tier in self.runtime.manifest.tiers},
                          "decoder_batch": self.pipeline.max_batch,
                          "continuous_batching": self.pipeline.joins.mode},
                "streams": len(self.streams.streams)}

    def status_line(self) -> str:
        stats = self.pipeline.stats
        state = "draining" if self.draining else "serving"
        health = self.health()
        if not health.ok:
            state = f"unhealthy ({health.reason}), {state}"
        running = sum(s.figures.state == "running" for s in self.streams.streams.values())
        return (f"{state} {self.model_id}: {self.admission.count} in flight, {stats.completed} answered, "
                f"{stats.failed} failed, {self.metrics.refused} refused; "
                f"streams {running}/{len(self.streams.streams)} running")


def components(runtime: Runtime) -> dict:
    """Loaded graphs: stage → device, precision, what runs them and the standby devices
    the power policy can move the stage to (placement.keep_alternatives)."""
    return {c.name: {"device": c.device, "precision": c.precision, "provider": c.provider,
                     "standby": list(runtime.placements[c.name].standby)}
            for c in runtime.components.all()}


def sse(data: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


async def disconnected(http: HttpRequest) -> None:
    """Returns when the client closes the connection (the request body is read by then)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def infer_query(params: dict[str, str]) -> tuple[str, dict]:
    """/v1/infer?prompt=…&max_tokens=…&temperature=…&top_p=…&seed=…&tier=… → (prompt, options)."""
    typed: dict = {}
    for key, kind in (("max_tokens", int), ("seed", int), ("temperature", float), ("top_p", float)):
        if key in params:
            try:
                typed[key] = kind(params.pop(key))
            except ValueError:
                raise ApiError(f"'{key}' must be {'an integer' if kind is int else 'a number'}", param=key) from None
    if "tier" in params:
        typed["edgemm"] = {"tier": params.pop("tier")}
    prompt = params.pop("prompt", DEFAULT_PROMPT)
    if params:
        raise ApiError(f"unknown query parameter {sorted(params)[0]!r} "
                       "(known: prompt, max_tokens, temperature, top_p, seed, tier)", param=sorted(params)[0])
    return prompt, generation_options(typed)


def describe(error: BaseException) -> tuple[int, str, str]:
    """(HTTP status, OpenAI error type, message) for any error."""
    if isinstance(error, HTTPException):
        return error.status_code, "invalid_request_error" if error.status_code < 500 else "server_error", \
            str(error.detail)
    if isinstance(error, Cancelled):
        return 499, "client_closed", str(error)
    if isinstance(error, EdgemmError):
        return error.http_status, error.kind, str(error)
    return 500, "server_error", internal_message(error)


# ---- metrics -----------------------------------------------------------------------------

class ServiceMetrics:
    """What /metrics shows. Updated from the event loop only; pipeline figures are read when scraped."""

    def __init__(self, service: Service):
        self.registry = r = Registry()
        pipeline = service.pipeline
        self.router = service.router
        self.energy = r.add(Histogram("edgemm_request_energy_joules",
                                      "Board energy over each answered request (rail power × time; an upper bound "
                                      "when requests overlap).", (), ENERGY_BUCKETS))
        power_gauges(r, service.router)
        self.requests = r.add(Counter("edgemm_http_requests_total", "HTTP requests answered, by endpoint and status.",
                                      ("endpoint", "status")))
        self.latency = r.add(Histogram("edgemm_http_request_duration_seconds",
                                       "Time from request to the end of its response.", ("endpoint",), LATENCY_BUCKETS))
        self.stages = r.add(Histogram("edgemm_stage_duration_seconds",
                                      "Time per pipeline stage of answered requests (total = queueing included).",
                                      ("stage",), LATENCY_BUCKETS))
        self.tiers = r.add(Counter("edgemm_answers_total", "Answers, by the resolution tier chosen.", ("tier",)))
        self.tokens = r.add(Counter("edgemm_generated_tokens_total", "Tokens generated."))
        r.add(Gauge("edgemm_requests_in_flight", "Requests admitted and not finished (body, queue or running).",
                    (), lambda: {(): service.admission.count}))
        r.add(Gauge("edgemm_admission_limit", "Most requests admitted at once (server.queue_size).",
                    (), lambda: {(): service.admission.limit}))
        r.add(Gauge("edgemm_queue_depth", "Requests waiting in front of each pipeline stage.", ("stage",),
                    lambda: {(k,): v for k, v in pipeline.depths().items()}))
        r.add(Gauge("edgemm_encoder_recent_batches", "Encoder calls among the last 1000, by batch size.",
                    ("size",), lambda: {(str(k),): v for k, v in Tally(pipeline.stats.batches).items()}))
        r.add(Gauge("edgemm_decoder_steps_total", "Decoder calls that each gave one token to every row, "
                    "by rows stepped together.", ("rows",),
                    lambda: {(str(k),): v for k, v in dict(pipeline.stats.decode_steps).items()}, kind="counter"))
        r.add(Gauge("edgemm_pipeline_requests_total", "Requests the pipeline finished, by outcome.", ("outcome",),
                    lambda: {("completed",): pipeline.stats.completed, ("failed",): pipeline.stats.failed},
                    kind="counter"))
        r.add(Gauge("edgemm_ready", "1 while serving, 0 while draining or unhealthy (see /readyz).", (),
                    lambda: {(): 0 if service.draining or not service.health().ok else 1}))
        streams = service.streams.streams
        r.add(Gauge("edgemm_stream_frames_total", "Frames answered per daemon-run stream.", ("stream",),
                    lambda: {(k,): v.figures.frames for k, v in streams.items()}, kind="counter"))
        r.add(Gauge("edgemm_stream_running", "1 while a stream's source delivers, 0 while it is retrying.",
                    ("stream",), lambda: {(k,): int(v.figures.state == "running") for k, v in streams.items()}))
        cache = getattr(service.runtime, "cache", None)
        if cache is not None:
            r.add(Gauge("edgemm_feature_cache_lookups_total", "Visual-feature cache lookups, by result.",
                        ("result",), lambda: {("hit",): cache.stats().hits, ("miss",): cache.stats().misses},
                        kind="counter"))
            r.add(Gauge("edgemm_feature_cache_bytes", "Bytes of image features held by the cache.", (),
                        lambda: {(): cache.stats().bytes}))

    @property
    def refused(self) -> int:
        return int(sum(v for (_, status), v in self.requests.values.items() if status == "503"))

    def answered(self, result: InferenceResult) -> None:
        energy = self.router.answered(result)
        if energy is not None:
            self.energy.observe(energy)
        for stage, ms in result.timings_ms.items():
            self.stages.observe(ms / 1e3, stage)
        self.tiers.inc(result.tier)
        self.tokens.inc(amount=len(result.tokens))

    def http(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.inc(endpoint, str(status))
        self.latency.observe(seconds, endpoint)


ENERGY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100)


def power_gauges(r: Registry, router: Router) -> None:
    """Telemetry, placement and offload figures, read when scraped. Absent sensors have no sample
    (a missing line), never 0."""
    def telemetry():
        return router.sampler.latest() if router.sampler else None

    def present(values: dict) -> dict:
        return {k: v for k, v in values.items() if v is not None}

    def scalar(read):
        return lambda: present({(): read(t)} if (t := telemetry()) else {})

    r.add(Gauge("edgemm_power_rail_watts", "Power per INA3221 rail.", ("rail",),
                lambda: present({(k,): v for k, v in (telemetry().rails_w if telemetry() else {}).items()})))
    r.add(Gauge("edgemm_board_power_watts", "Board power: VDD_IN, else the sum of rails.", (),
                scalar(lambda t: t.total_w)))
    r.add(Gauge("edgemm_temperature_celsius", "Temperature per thermal zone.", ("zone",),
                lambda: present({(k,): v for k, v in (telemetry().temps_c if telemetry() else {}).items()})))
    r.add(Gauge("edgemm_gpu_load_ratio", "GPU load (devfreq), 0..1.", (), scalar(lambda t: t.gpu_load)))
    r.add(Gauge("edgemm_dla_cores", "DLA cores on this module.", (), scalar(lambda t: t.dla_cores)))
    r.add(Gauge("edgemm_placement_device", "The last placement: 1 for the device each stage was given.",
                ("stage", "device"), lambda: {(stage, device): 1 for stage, device in
                                              (router.governor.last.stages.items() if router.governor.last else ())}))
    r.add(Gauge("edgemm_power_condition", "Conditions active at the last placement (hot, critical, over_budget, "
                "slo_at_risk, slo_miss).", ("condition",),
                lambda: {(c,): 1 for c in (router.governor.last.conditions if router.governor.last else ())}))
    r.add(Gauge("edgemm_placement_decisions_total", "Requests placed, by target.", ("target",),
                lambda: {(k,): v for k, v in router.governor.decisions.items()}, kind="counter"))
    r.add(Gauge("edgemm_energy_joules_total", "Board energy over answered requests.", (),
                lambda: {(): router.governor.energy_total_j}, kind="counter"))
    r.add(Gauge("edgemm_offload_breaker_state", "Offload circuit breaker: 1 for its state (off when disabled).",
                ("state",), lambda: {(router.offload_state(),): 1}))
    r.add(Gauge("edgemm_offload_requests_total", "Offload requests, by outcome.", ("outcome",),
                lambda: {} if router.client is None else {
                    ("succeeded",): router.client.figures.succeeded, ("failed",): router.client.figures.failed,
                    ("refused",): router.client.figures.refused, ("answered_locally",): router.fallbacks},
                kind="counter"))


class MeasuredApp:
    """ASGI wrapper: status and duration of every HTTP request into the metrics."""

    def __init__(self, app, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500
        endpoint = endpoint_label(scope.get("path", ""))

        async def send_measured(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_measured)
        finally:
            self.metrics.http(endpoint, status, time.perf_counter() - started)


def endpoint_label(path: str) -> str:
    """The route a path belongs to, so that ids and typos don't make new label values."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    if path.startswith("/v1/streams/"):
        return "/v1/streams/{id}/events" if path.endswith("/events") else "/v1/streams/{id}"
    return "other"


# ---- the app -------------------------------------------------------------------------------

def create_app(service: Service) -> MeasuredApp:
    routes = [
        Route("/v1/chat/completions", service.chat_completions, methods=["POST"]),
        Route("/v1/infer", service.infer, methods=["POST"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model:path}", service.model, methods=["GET"]),
        Route("/v1/streams", service.list_streams, methods=["GET"]),
        Route("/v1/streams", service.add_stream, methods=["POST"]),
        Route("/v1/streams/{id}", service.get_stream, methods=["GET"]),
        Route("/v1/streams/{id}", service.delete_stream, methods=["DELETE"]),
        Route("/v1/streams/{id}/events", service.stream_events, methods=["GET"]),
        Route("/v1/status", service.status, methods=["GET"]),
        Route("/healthz", service.healthz, methods=["GET"]),
        Route("/readyz", service.readyz, methods=["GET"]),
        Route("/metrics", service.metrics_text, methods=["GET"]),
    ]

    async def on_error(http: HttpRequest, error: Exception) -> Response:
        status, kind, message = describe(error)
        headers = {}
        if status == 503:
            headers["Retry-After"] = str(service.server.retry_after_s)
        if status in (413, 503):
            headers["Connection"] = "close"  # the body may be unread: don't reuse the connection
        return JSONResponse(error_body(message, kind, getattr(error, "param", None), getattr(error, "code", None)),
                            status, headers)

    app = Starlette(routes=routes, exception_handlers={HTTPException: on_error, EdgemmError: on_error,
                                                       Exception: on_error})
    return MeasuredApp(app, service.metrics)
