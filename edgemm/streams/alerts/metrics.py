"""The alerts' figures on /metrics."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from edgemm.streams.alerts.schedule import Alert
from edgemm.streams.alerts.webhook import WebhookSender
from edgemm.util.prometheus import Gauge, Registry


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
