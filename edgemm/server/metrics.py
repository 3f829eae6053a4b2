"""What the daemon's /metrics shows: the service's counters, gauges and histograms (built from
edgemm/util/prometheus.py's primitives), the power figures, and the ASGI wrapper that times
every HTTP request. Gauges are read from their source (queue depths, pipeline counters) when
scraped rather than copied on every change.
"""
from __future__ import annotations

import time
from collections import Counter as Tally
from typing import Protocol

from edgemm.engine.answering import InferenceResult
from edgemm.power.router import Router
from edgemm.streams.state import StreamState
from edgemm.util.prometheus import CONTENT_TYPE, Counter, Gauge, Histogram, Registry

__all__ = ["CONTENT_TYPE", "MeasuredApp", "ServiceMetrics", "endpoint_label"]


class MeasuredService(Protocol):
    """What ServiceMetrics reads of the service (edgemm/server/service.py builds it with itself):
    named here so this module needs no import of the service that imports it."""
    pipeline: object
    router: Router
    admission: object
    streams: object
    runtime: object
    draining: bool

    def health(self): ...


# ---- the daemon's metrics ------------------------------------------------------------------

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ENDPOINTS = ("/v1/chat/completions", "/v1/infer", "/v1/models", "/v1/streams", "/v1/alerts", "/v1/status", "/healthz",
             "/readyz", "/metrics")


class ServiceMetrics:
    """What /metrics shows. Updated from the event loop only; pipeline figures are read when scraped."""

    def __init__(self, service: MeasuredService):
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
        self.connections_limited = r.add(Counter(
            "edgemm_http_connections_limited_total", "Connections the HTTP limits closed or refused, by reason "
            "(idle_timeout, header_timeout, header_too_large, evicted, body_evicted, over_capacity, malformed, "
            "send_timeout).", ("reason",)))
        self.tiers = r.add(Counter("edgemm_answers_total", "Answers, by the resolution tier chosen.", ("tier",)))
        self.tokens = r.add(Counter("edgemm_generated_tokens_total", "Tokens generated."))
        r.add(Gauge("edgemm_requests_in_flight", "Requests admitted and not finished (queued or running).",
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
                    ("stream",), lambda: {(k,): int(v.figures.state is StreamState.RUNNING) for k, v in streams.items()}))
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

    def connection_limited(self, reason: str) -> None:
        self.connections_limited.inc(reason)

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
