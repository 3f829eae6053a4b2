"""The endpoints of the camera streams the daemon runs (edgemm.streams.manager):
/v1/streams (list, add), /v1/streams/{id} (get, change its prompt, delete), a stream's
results as server-sent events, and every stream's alerts.

A stream takes no request slot: its bodies are read with admit=False, within their own
limits (stream_body_limit). A listener is one of server.max_stream_listeners (503 beyond)
and is not counted in server.max_connections (edgemm.server.scope_keys.LONG_LIVED).
"""
from __future__ import annotations

import asyncio

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from edgemm.errors import Overloaded
from edgemm.server import sse
from edgemm.server.bodies import BodyReader
from edgemm.server.scope_keys import mark_long_lived
from edgemm.server.service import Service
from edgemm.streams.errors import StreamSpecError
from edgemm.streams.manager import stream_body_limit, stream_spec

PATCHABLE = ("prompt",)  # what PATCH /v1/streams/{id} changes on a running stream


class StreamRoutes:
    def __init__(self, service: Service, bodies: BodyReader):
        self.service, self.bodies = service, bodies

    async def list_streams(self, http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [s.describe() for s in self.service.streams.listed()]})

    async def add_stream(self, http: HttpRequest) -> Response:
        if self.service.draining:
            raise Overloaded("the server is shutting down")
        limit = stream_body_limit(self.service.runtime.config.limits, self.service.server)
        spec = stream_spec(await self.bodies.read_json(http, admit=False, limit=limit))  # a stream takes no request slot
        await asyncio.to_thread(self.service.streams.check, spec)  # 403/400 now; may ask GStreamer
        stream = self.service.streams.add(spec, from_api=True)
        return JSONResponse(stream.describe(), 201)

    async def get_stream(self, http: HttpRequest) -> Response:
        return JSONResponse(self.service.streams.find(http.path_params["id"]).describe())

    async def patch_stream(self, http: HttpRequest) -> Response:
        """{"prompt": …}: the prompt of the frames submitted from now on, checked as POST checks it."""
        limit = stream_body_limit(self.service.runtime.config.limits, self.service.server, prompts=1)
        body = await self.bodies.read_json(http, admit=False, limit=limit)  # like POST /v1/streams: no request slot
        if not isinstance(body, dict) or not body:
            raise StreamSpecError("a stream change is a JSON object: {\"prompt\": …}")
        unknown = sorted(set(body) - set(PATCHABLE))
        if unknown:
            raise StreamSpecError(f"only {', '.join(PATCHABLE)} can be changed on a running stream, "
                                  f"not {unknown[0]!r} (DELETE it and POST it anew)", unknown[0])
        stream = self.service.streams.change_prompt(http.path_params["id"], body["prompt"])
        return JSONResponse(stream.describe())

    async def delete_stream(self, http: HttpRequest) -> Response:
        stream = self.service.streams.remove(http.path_params["id"])
        return JSONResponse({"id": stream.spec.id, "object": "stream.deleted", "deleted": True})

    async def stream_events(self, http: HttpRequest) -> Response:
        """The stream's results as server-sent events, until the stream stops or the client leaves."""
        stream = self.service.streams.get(http.path_params["id"])
        self.service.check_listener_room()
        mark_long_lived(http.scope)
        queue = self.service.streams.listen(stream)

        async def render(item: tuple) -> str:
            event_id, record, name = item  # name: None for a result, "alert" for an alert's change
            return sse.event(record, name, event_id)

        return sse.response(sse.listener_events(queue, render, lambda: self.service.streams.unlisten(stream, queue)))

    async def list_alerts(self, http: HttpRequest) -> Response:
        """Every stream's alerts (edgemm.streams.alerts): state, and the frame and time it last changed."""
        streams = list(self.service.streams.streams.values())
        return JSONResponse({"object": "list", "data": [row for s in streams if s.alerts is not None
                                                         for row in s.alerts.states()]})
