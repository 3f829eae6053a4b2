"""Server-sent events: the one formatter, and the one writer of a listener's event stream.

Every event stream the daemon sends (a stream's /v1/streams/{id}/events, every stream's
/v1/events, a streamed chat answer) is text/event-stream, uncached, its events made by
`event`. A listener's stream (`listener_events`) sends a keepalive comment whenever it has
been quiet for KEEPALIVE_S, so idle proxies keep the connection open; a streamed chat answer
does likewise while it waits for its next tokens (edgemm.server.service).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse

from edgemm.streams.manager import END, ListenerQueue

KEEPALIVE_S = 15.0  # read at each wait, so a test may shorten it
KEEPALIVE = ": keepalive\n\n"
DONE = "data: [DONE]\n\n"  # OpenAI's last event of a streamed answer


def event(data: dict, name: str | None = None, event_id: int | None = None) -> str:
    """One server-sent event: `data` as JSON, with its `event:` name and `id:` when given."""
    return (f"id: {event_id}\n" if event_id is not None else "") + (f"event: {name}\n" if name else "") + \
        f"data: {json.dumps(data)}\n\n"


def response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def listener_events(listener: ListenerQueue, render: Callable[[tuple], Awaitable[str]],
                          close: Callable[[], None], opening: str = "") -> AsyncIterator[str]:
    """A listener's event stream: `opening` first (a comment: the headers and a first byte go at
    once), then each of its items as `render` makes it, until END (its stream stopped, or the
    daemon drains), with a keepalive comment whenever none came for KEEPALIVE_S. close() runs
    however it ends, the client leaving included."""
    try:
        if opening:
            yield opening
        while True:
            try:
                item = listener.get_nowait()  # events piling up: no timer to arm for each
            except asyncio.QueueEmpty:
                try:
                    item = await asyncio.wait_for(listener.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield KEEPALIVE
                    continue
            if item is END:
                break
            yield await render(item)
    finally:
        close()
