"""What /metrics shows, and the counters, gauges and histograms it is made of, rendered as
Prometheus text (exposition format 0.0.4).

Small on purpose: the daemon updates them from its event loop only, so there are
no locks, and gauges are read from their source (queue depths, pipeline counters)
when scraped rather than copied on every change.

    registry = Registry()
    requests = registry.add(Counter("edgemm_requests_total", "HTTP requests.", ("endpoint", "status")))
    requests.inc("/v1/infer", "200")
    print(registry.render())
"""
from __future__ import annotations

import bisect
import math
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # the service and the router build on this module, never the other way
    from edgemm.answering import InferenceResult
    from edgemm.router import Router
    from edgemm.service import Service

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[str, ...]


def _labels(names: Labels, values: Labels, extra: str = "") -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)] + ([extra] if extra else [])
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labels: Labels = ()):
        self.name, self.help, self.label_names = name, help, labels

    def samples(self) -> Iterable[str]:
        raise NotImplementedError

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self.samples()]


class Counter(Metric):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Labels = ()):
        super().__init__(name, help, labels)
        self.values: dict[Labels, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def samples(self) -> Iterable[str]:
        for labels, value in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.label_names, labels)} {_number(value)}"


class Gauge(Metric):
    """A value read when scraped: `read()` returns {label values: value}.

    kind="counter" is for totals kept elsewhere (e.g. the pipeline's own counters).
    """

    def __init__(self, name: str, help: str, labels: Labels, read: Callable[[], dict[Labels, float]],
                 kind: str = "gauge"):
        super().__init__(name, help, labels)
        self.read, self.kind = read, kind

    def samples(self) -> Iterable[str]:
        for labels, value in sorted(self.read().items()):
            yield f"{self.name}{_labels(self.label_names, labels)} {_number(value)}"


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, labels: Labels, buckets: Iterable[float]):
        super().__init__(name, help, labels)
        self.bounds = sorted(buckets)
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}  # per-bucket counts, [sum]

    def observe(self, value: float, *labels: str) -> None:
        counts, total = self.series.setdefault(labels, ([0] * (len(self.bounds) + 1), [0.0]))
        counts[bisect.bisect_left(self.bounds, value)] += 1  # bucket i holds values <= bounds[i]
        total[0] += value

    def samples(self) -> Iterable[str]:
        for labels, (counts, total) in sorted(self.series.items()):
            running = 0
            for bound, count in zip([*self.bounds, math.inf], counts, strict=True):
                running += count
                le = f'le="{_number(bound)}"'
                yield f"{self.name}_bucket{_labels(self.label_names, labels, le)} {running}"
            yield f"{self.name}_sum{_labels(self.label_names, labels)} {_number(total[0])}"
            yield f"{self.name}_count{_labels(self.label_names, labels)} {running}"


M = TypeVar("M", bound=Metric)


class Registry:
    def __init__(self):
        self.metrics: list[Metric] = []

    def add(self, metric: M) -> M:
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"


# ---- the daemon's metrics ------------------------------------------------------------------

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ENDPOINTS = ("/v1/chat/completions", "/v1/infer", "/v1/models", "/v1/streams", "/v1/alerts", "/v1/status", "/healthz",
             "/readyz", "/metrics")


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
