"""`edgemm serve`'s HTTP side: every endpoint in one table, and how errors become responses.

    client ─► uvicorn (UNIX socket, systemd's socket, or loopback TCP) ─► MeasuredApp (/metrics)
           ─► its endpoint (create_app's table): body (≤ server.max_body_bytes or the route's smaller limit, else 413;
              within server.body_timeout_s of its headers, else 408; before admission: edgemm.server.bodies)
              ─► JSON (a large body on its own thread, off the event loop) ─► OpenAI schema (edgemm.server.protocol)
           ─► the service (edgemm.server.service: admission, the pipeline, cancellation)
           ─► JSON, or server-sent events (edgemm.server.sse)

The handlers live by endpoint group: inference_routes (chat, infer, models), stream_routes
(camera streams, their events, alerts), liveview (the page and what it needs beyond the API),
health_routes (health, readiness, metrics, status).

Every error a route raises becomes OpenAI's error shape with its status
(edgemm.server.errors.describe): a 503 carries Retry-After, and a 408, 413 or 503 closes the
connection, since its body may be unread. The daemon around it (sockets, systemd, signals,
draining) is edgemm.server.daemon.
"""
from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgemm.errors import EdgemmError
from edgemm.server.bodies import BodyReader
from edgemm.server.errors import describe
from edgemm.server.health_routes import HealthRoutes
from edgemm.server.inference_routes import InferenceRoutes
from edgemm.server.liveview import LiveView
from edgemm.server.metrics import MeasuredApp
from edgemm.server.protocol import error_body
from edgemm.server.service import Service
from edgemm.server.stream_routes import StreamRoutes


def create_app(service: Service) -> MeasuredApp:
    bodies = BodyReader(service)
    inference, streams = InferenceRoutes(service, bodies), StreamRoutes(service, bodies)
    live, health = LiveView(service), HealthRoutes(service)
    endpoints = [  # method, path, handler: every endpoint the daemon serves
        ("POST", "/v1/chat/completions", inference.chat_completions),
        ("POST", "/v1/infer", inference.infer),
        ("GET", "/v1/models", inference.models),
        ("GET", "/v1/models/{model:path}", inference.model),
        ("GET", "/v1/streams", streams.list_streams),
        ("POST", "/v1/streams", streams.add_stream),
        ("GET", "/v1/streams/{id}", streams.get_stream),
        ("PATCH", "/v1/streams/{id}", streams.patch_stream),
        ("DELETE", "/v1/streams/{id}", streams.delete_stream),
        ("GET", "/v1/streams/{id}/events", streams.stream_events),
        ("GET", "/v1/streams/{id}/frame.jpg", live.frame_jpeg),
        ("GET", "/v1/alerts", streams.list_alerts),
        ("GET", "/v1/events", live.all_events),
        ("GET", "/", live.index),
        ("GET", "/v1/status", health.status),
        ("GET", "/healthz", health.healthz),
        ("GET", "/readyz", health.readyz),
        ("GET", "/metrics", health.metrics_text),
    ]

    async def on_error(http: HttpRequest, error: Exception) -> Response:
        status, kind, message = describe(error)
        headers = {}
        if status == 503:
            headers["Retry-After"] = str(service.server.retry_after_s)
        if status in (408, 413, 503):
            headers["Connection"] = "close"  # the body may be unread: don't reuse the connection
        return JSONResponse(error_body(message, kind, getattr(error, "param", None), getattr(error, "code", None)),
                            status, headers)

    app = Starlette(routes=[Route(path, handler, methods=[method]) for method, path, handler in endpoints],
                    exception_handlers={HTTPException: on_error, EdgemmError: on_error, Exception: on_error})
    return MeasuredApp(app, service.metrics)
