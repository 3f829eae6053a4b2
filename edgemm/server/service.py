"""The service behind the HTTP API: admission, jobs in the pipeline, cancellation, SSE.

    the body, read before admission (within server.body_timeout_s: edgemm.server.bodies)
    ─► admission: at most server.queue_size requests at once; beyond, Overloaded (503 + Retry-After);
      from admission on, server.request_timeout_s covers the answer
    ─► Router.submit (the power policy: the local pipeline, or the cloud) ─► concurrent Future
    ─► asyncio (wrap_future, shielded) ─► an InferenceResult, or the SSE chunks of one

The pipeline runs in its own threads; the event loop only waits on its futures and on
the text of streamed answers (pushed from the decode thread with call_soon_threadsafe).
A request keeps its admission slot until the pipeline is done with it, so requests that
time out or whose client left still count until their work stops: memory is bounded by
queue_size.

A client that goes away (or a request that times out) sets the request's `cancelled`
flag; the decode loop stops its answer at the next step (a request still waiting for the
encoder is encoded, then stopped before its prefill). Only a streamed answer is
detokenized as it goes.

Camera streams the daemon runs (edgemm.streams.manager) submit into the same pipeline, each
within its own share; the service lists, adds and removes them. The HTTP side (routes,
error mapping) is edgemm.server.app, /metrics is edgemm.server.metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from starlette.requests import Request as HttpRequest

from edgemm.streams.alerts.metrics import alert_metrics
from edgemm.engine.answering import InferenceResult
from edgemm.config import Config, ServerConfig
from edgemm.errors import EdgemmError, Overloaded, internal_message
from edgemm.server import sse
from edgemm.server.errors import ApiError, describe
from edgemm.server.metrics import ServiceMetrics
from edgemm.server.protocol import ChatRequest, ImagePolicy, chunk, error_body, extras, finish_reason, usage
from edgemm.engine.pipeline import Health, Pipeline, Request, mark_logged, was_logged
from edgemm.power.router import Router
from edgemm.engine.runtime import Runtime
from edgemm.streams.manager import StreamManager
from edgemm.streams.state import StreamState

log = logging.getLogger("edgemm")


# ---- admission: a bounded number of requests at once ------------------------------------

class Admission:
    """Requests admitted: from once their body is in until the pipeline is done with them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0  # in flight now
        self.admitted = 0  # ever, for tests and figures that wait for requests to be in
        self._lock = threading.Lock()  # released from pipeline threads too

    def enter(self, retry_after_s: int) -> "Ticket":
        with self._lock:
            if self.count >= self.limit:
                raise Overloaded(f"server busy: {self.limit} requests in flight (server.queue_size); "
                                 f"retry in {retry_after_s} s")
            self.count += 1
            self.admitted += 1
        return Ticket(self)

    def leave(self) -> None:
        with self._lock:
            self.count -= 1


class Ticket:
    """One admission slot; release() is idempotent, so every path may call it."""

    def __init__(self, admission: Admission):
        self._admission, self._held = admission, True
        self._lock = threading.Lock()
        self.deadline = math.inf  # loop.time() by which the answer is due

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
                                     route=self.router.local_route, webhook_hosts=self.server.webhook_hosts,
                                     source_hosts=self.server.source_hosts)
        self.draining = False
        self.metrics = ServiceMetrics(self)
        alert_metrics(self.metrics.registry, self.streams.streams)

    def health(self) -> Health:
        """The pipeline's health (Pipeline.health with server.stall_s): /readyz, /healthz,
        /v1/status, the watchdog."""
        return self.pipeline.health(self.server.stall_s)

    # -- the steps every inference request goes through --

    def check_admissible(self) -> None:
        """Overloaded (503) if a request would not be admitted now: checked before its body is read."""
        if self.draining:
            raise Overloaded("the server is shutting down")
        if self.admission.count >= self.admission.limit:
            raise Overloaded(f"server busy: {self.admission.limit} requests in flight (server.queue_size); "
                             f"retry in {self.server.retry_after_s} s")

    def check_listener_room(self) -> None:
        """Overloaded (503) if server.max_stream_listeners SSE listeners are connected."""
        limit = self.server.max_stream_listeners
        if self.streams.listener_count() >= limit:
            raise Overloaded(f"server busy: {limit} stream listeners are connected (server.max_stream_listeners); "
                             f"retry in {self.server.retry_after_s} s")

    @contextlib.contextmanager
    def admitted(self) -> Iterator[Ticket]:
        """A slot, or Overloaded (503); taken once the request's body is in. The slot goes back
        if the request fails before the pipeline."""
        if self.draining:
            raise Overloaded("the server is shutting down")
        ticket = self.admission.enter(self.server.retry_after_s)
        ticket.deadline = asyncio.get_running_loop().time() + self.server.request_timeout_s
        try:
            yield ticket
        except BaseException:
            ticket.release()
            raise

    def submit(self, ticket: Ticket, image: bytes | str, prompt: str, options: dict,
               stream: bool = False) -> Job:
        """Into the pipeline without waiting; a full pipeline raises Overloaded (503)."""
        loop = asyncio.get_running_loop()
        feed = TokenFeed(loop) if stream else None
        # only a streamed answer is detokenized as it goes; the decode loop checks the
        # request's cancel flag between steps (edgemm/engine/decode.py)
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
        return Job(future, done, min(ticket.deadline, loop.time() + self.server.request_timeout_s), cancelled, feed)

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
        except EdgemmError:  # Cancelled included
            raise
        except Exception as e:  # a bug or a backend failure: a 500 for the client
            message = internal_message(e)
            if not was_logged(e):  # once: a stage's crash barrier, or another request sharing it, may have
                log.error("inference failed: %s", message, exc_info=e)
                mark_logged(e)
            raise EdgemmError(message) from e

    async def chunks(self, job: Job, chat: ChatRequest, request_id: str, created: int) -> AsyncIterator[str]:
        """The SSE body: a role chunk, content deltas, a finish chunk, [usage], [DONE]; a
        keepalive comment whenever no token came for sse.KEEPALIVE_S between two tokens (the response starts
        at the first token, so that an error before it keeps its HTTP status)."""
        feed = job.feed
        assert feed is not None

        def piece(delta: dict | None, finish: str | None = None, **more) -> str:
            return sse.event(chunk(request_id, self.model_id, created, delta, finish, **more))

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
                remaining = job.remaining()
                try:
                    await asyncio.wait_for(feed.changed.wait(), min(remaining, sse.KEEPALIVE_S))
                except asyncio.TimeoutError:
                    if remaining > sse.KEEPALIVE_S:
                        yield sse.KEEPALIVE
                        continue
                    job.cancelled.set()
                    yield sse.event(error_body(f"no answer within {self.server.request_timeout_s} s", "timeout",
                                               code="timeout"))
                    break
            if feed.finished:
                yield self.last_chunks(job, chat, sent, piece)
            yield sse.DONE
        finally:
            if not job.future.done():
                job.cancelled.set()  # the client went away mid-answer

    def last_chunks(self, job: Job, chat: ChatRequest, sent: str, piece: Callable[..., str]) -> str:
        """The rest of the text, the finish chunk with edgemm's figures, and usage if asked."""
        try:
            result = self.outcome(job)
        except Exception as e:  # headers are sent: OpenAI's way is an error event in the stream
            _, kind, message = describe(e)
            return sse.event(error_body(message, kind, code=getattr(e, "code", None)))
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
        exact_encoder = self.runtime.models.batches_exactly(self.runtime.models.loaded.vision_encoder)
        return {"daemon": "draining" if self.draining else "serving", "model": self.model_id,
                "health": {**health.to_dict(), "stall_s": self.server.stall_s},
                "precision": self.runtime.precision,
                "scheduler": {"policy": self.runtime.scheduler.name, "reason": self.runtime.scheduler.why},
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
                          # 1 where the component answers one request per call (a dynamic int8 graph)
                          "encoder_batch": {tier: self.pipeline.encoder_batch.get(tier, self.pipeline.max_batch)
                                            if exact_encoder else 1 for tier in self.runtime.manifest.tiers},
                          "decoder_batch": self.pipeline.max_batch if self.runtime.decodes_batched(None) else 1,
                          "continuous_batching": self.pipeline.joins.mode},
                "streams": len(self.streams.streams),
                # deleted streams whose camera call has not returned: each still holds a server.max_streams place
                "streams_stopping": len(self.streams.still_stopping())}

    def status_line(self) -> str:
        stats = self.pipeline.stats
        state = "draining" if self.draining else "serving"
        health = self.health()
        if not health.ok:
            state = f"unhealthy ({health.reason}), {state}"
        running = sum(s.figures.state is StreamState.RUNNING for s in self.streams.streams.values())
        stopping = len(self.streams.still_stopping())
        return (f"{state} {self.model_id}: {self.admission.count} in flight, {stats.completed} answered, "
                f"{stats.failed} failed, {self.metrics.refused} refused; "
                f"streams {running}/{len(self.streams.streams)} running" + f", {stopping} stopping" * (stopping > 0))


def components(runtime: Runtime) -> dict:
    """Loaded graphs: stage → device, precision, what runs them and the standby devices
    the power policy can move the stage to (placement.keep_alternatives)."""
    return {c.name: {"device": c.device, "precision": c.precision, "provider": c.provider,
                     "standby": list(runtime.placements[c.name].standby),
                     "skipped": runtime.placements[c.name].to_dict()["skipped"],  # earlier devices, and why
                     **({"precision_choice": runtime.models.precision_choices[c.name]}  # precision auto: why
                        if c.name in runtime.models.precision_choices else {})}
            for c in runtime.components.all()}


async def disconnected(http: HttpRequest) -> None:
    """Returns when the client closes the connection (the request body is read by then)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
