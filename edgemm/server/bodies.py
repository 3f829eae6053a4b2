"""Request bodies, read before admission within their limits, and parsed as JSON.

A body is at most server.max_body_bytes or its route's smaller limit (else 413), and arrives
within server.body_timeout_s of its headers (else 408). Bodies being read hold at most
queue_size × max_body_bytes together (the body-byte pool): beyond, the slowest upload is
closed to make room (edgemm.server.connections, through the scope's EVICT_BODY), else 503.
A large JSON body is parsed on JSON_PARSER's thread, off the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import ClientDisconnect, Request as HttpRequest

from edgemm.server.errors import ApiError
from edgemm.server.protocol import parse_json_body
from edgemm.server.scope_keys import EVICT_BODY
from edgemm.server.service import Service
from edgemm.streams.manager import BodyLimit

# the body-byte pool full: how long a body waits for the upload evicted for it to release its
# bytes (its reader is woken at once; this only bounds the wait)
POOL_WAIT_S = 0.5
# JSON bodies above this are parsed on JSON_PARSER's thread, not on the event loop (up to
# MAX_JSON_VALUES values: a few hundred ms); smaller ones take microseconds, less than the hop
INLINE_JSON_BYTES = 64 * 1024
JSON_PARSER = ThreadPoolExecutor(1, thread_name_prefix="edgemm-json")


class BodyReader:
    """The routes' body reader, and the pool of bytes of the bodies being read."""

    def __init__(self, service: Service):
        self.service = service
        # bytes of request bodies being received (touched only on the event loop), and their bound
        self.reading_bytes = 0
        self.reading_limit = service.server.queue_size * service.server.max_body_bytes
        self.released = asyncio.Event()  # set (and replaced) each time a body's bytes leave the pool

    async def read_body(self, http: HttpRequest, admit: bool = True, limit: BodyLimit | None = None) -> bytes:
        """The body, at most server.max_body_bytes or the route's smaller `limit` (else 413), within
        server.body_timeout_s of its headers (else 408). Read before admission, so a slow body holds
        no slot. Bodies being read hold at most queue_size × max_body_bytes together, the bound
        admission gave when it came first: beyond, the slowest upload is closed to make room
        (pool_room), else 503. `admit`: a request that needs a slot is refused
        (503) unread when there is none."""
        cfg = self.service.server
        if admit:
            self.service.check_admissible()  # no body is read for a request that would be refused anyway
        limit = limit or BodyLimit(cfg.max_body_bytes, "request body", "server.max_body_bytes")
        too_large = ApiError(f"{limit.what} is larger than {limit.size} bytes ({limit.why})",
                             status=413, code="request_too_large")
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit.size:
            raise too_large  # refused unread
        body = bytearray()

        async def receive() -> None:
            async for piece in http.stream():
                if self.reading_bytes + len(piece) > self.reading_limit:
                    await self.pool_room(http, len(piece))
                body.extend(piece)
                self.reading_bytes += len(piece)
                if len(body) > limit.size:
                    raise too_large

        try:
            # wait_for, not asyncio.timeout: Python 3.10 (JetPack 6's) has neither timeout nor
            # timeout_at, and its wait_for raises asyncio.TimeoutError, not yet the builtin one
            await asyncio.wait_for(receive(), cfg.body_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise ApiError(f"the request body did not arrive within {cfg.body_timeout_s:g} s "
                           "(server.body_timeout_s)", status=408, code="timeout") from None
        except ClientDisconnect:  # the client hung up mid-body: nobody to answer, nothing to log
            raise ApiError("the client closed the connection", status=499, kind="client_closed") from None
        finally:
            self.release_bytes(len(body))
        return bytes(body)

    def release_bytes(self, size: int) -> None:
        """`size` bytes of a body leave the pool: wakes the bodies waiting for room (pool_room)."""
        self.reading_bytes -= size
        if size:
            self.released.set()
            self.released = asyncio.Event()

    async def pool_room(self, http: HttpRequest, size: int) -> None:
        """The body-byte pool cannot take `size` more bytes: make room by closing the slowest
        upload that has had BODY_GRACE_S (edgemm.server.connections: 408 body_evicted), so clients
        stalling their bodies cannot lock every body out; wait at most POOL_WAIT_S for its
        bytes to be released. 503 if no upload can be closed, or room did not come."""
        evict = http.scope.get(EVICT_BODY)  # absent under the h11 fallback: no eviction
        loop = asyncio.get_running_loop()
        deadline = loop.time() + POOL_WAIT_S
        while self.reading_bytes + size > self.reading_limit:
            released = self.released
            # evict one upload, then wait for a release before judging whether to evict another
            if deadline <= loop.time() or not (callable(evict) and evict()):
                retry = self.service.server.retry_after_s
                raise ApiError(f"server busy: request bodies being received hold {self.reading_bytes} of "
                               f"{self.reading_limit} bytes (server.queue_size x server.max_body_bytes), and "
                               f"none arrives slowly enough to be closed; retry in {retry} s",
                               status=503, kind="overloaded", code="body_pool_full")
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(released.wait(), max(0.0, deadline - loop.time()))

    async def read_json(self, http: HttpRequest, admit: bool = True, limit: BodyLimit | None = None) -> object:
        """The body (read_body) as JSON (parse_json_body), a large one parsed off the event loop.
        Its bytes stay in the body pool until parsed, so bodies waiting for the parser are bounded
        as those arriving are; the body's clock (body_timeout_s) stopped when its last byte came."""
        body = await self.read_body(http, admit, limit)
        if len(body) <= INLINE_JSON_BYTES:
            return parse_json_body(body)
        self.reading_bytes += len(body)
        try:
            return await asyncio.get_running_loop().run_in_executor(JSON_PARSER, parse_json_body, body)
        finally:
            self.release_bytes(len(body))
