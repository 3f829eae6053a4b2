"""Counters, gauges and histograms, rendered as Prometheus text (exposition format 0.0.4):
what the daemon's /metrics (edgemm/server/metrics.py) and a stream's alerts are made of.

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
from collections.abc import Callable, Iterable
from typing import TypeVar

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
