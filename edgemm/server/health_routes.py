"""The endpoints that tell how the daemon is: GET /healthz (alive), /readyz (taking requests),
/metrics (Prometheus, edgemm.server.metrics), /v1/status (the status report `edgemm status` shows)."""
from __future__ import annotations

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from edgemm.server.metrics import CONTENT_TYPE
from edgemm.server.service import Service


class HealthRoutes:
    def __init__(self, service: Service):
        self.service = service

    async def healthz(self, http: HttpRequest) -> Response:
        """Liveness: 503 when the pipeline can no longer answer (a stage thread died, or a stage
        is stalled past server.stall_s), the same condition on which the systemd watchdog
        stops being pinged, so a container's liveness probe restarts it as systemd would.
        Draining is alive: the requests in flight are being finished."""
        health = self.service.health()
        if not health.ok:
            return self.unavailable({"status": "unhealthy", "reason": health.reason})
        return JSONResponse({"status": "ok"})

    async def readyz(self, http: HttpRequest) -> Response:
        if self.service.draining:
            return self.unavailable({"status": "draining"})
        health = self.service.health()
        if not health.ok:
            return self.unavailable({"status": "unhealthy", "reason": health.reason})
        return JSONResponse({"status": "ready", "model": self.service.model_id, "precision": self.service.runtime.precision})

    def unavailable(self, body: dict) -> Response:
        return JSONResponse(body, 503, {"Retry-After": str(self.service.server.retry_after_s)})

    async def metrics_text(self, http: HttpRequest) -> Response:
        return Response(self.service.metrics.registry.render(), media_type=CONTENT_TYPE)

    async def status(self, http: HttpRequest) -> Response:
        return JSONResponse(self.service.status_report())
