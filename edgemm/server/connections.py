"""The limits of one HTTP connection, enforced before any route runs.

uvicorn's httptools protocol, with what it lacks for clients that are slow, stalled or
hostile. A connection is always in one of three phases:

    connect ─► idle  no byte of a request yet (new, or kept alive between requests):
                     closed after server.idle_timeout_s
            ─► head  its request line and headers are arriving: 408 unless complete within
                     server.header_timeout_s of their first byte; 431 once they pass
                     server.max_header_bytes (counted as bytes arrive, so a header line
                     that never ends is not buffered whole)
            ─► busy  the request is in the app (its body is read within
                     server.body_timeout_s: edgemm.server.bodies) ─► idle again (keep-alive)

At most server.max_connections connections are open. One more evicts the connection that
has been idle or sending its head the longest, so stalled and idle clients cannot lock
newcomers out: an idle one is simply closed, one sending its head is answered 503 with
Retry-After; failing that, the busy one whose body has been arriving for BODY_GRACE_S at
the lowest rate (408), so trickled bodies cannot either. If every other connection is busy
otherwise, the newcomer's request is answered 503 with Retry-After and its connection
closed, unless room has come free (a request ended, a connection went) by the time its
head is complete. Every refusal is OpenAI's error shape, malformed requests included
(400: uvicorn answers those in plain text), and a request line over
server.max_header_bytes is 431.

A client that takes none of what is sent to it for server.send_timeout_s (the transport's
buffer full, and no smaller, all that time) is cut off: its socket is closed at once,
whatever it holds. A slow reader is not: any progress arms the deadline again. A
connection that is closed (idle timeout, eviction, shutdown, a response that closes) with
bytes still unsent has the same deadline: a transport's close() waits for its buffer to
drain, for ever if the client reads nothing, though the buffer never filled enough to
pause our writes. Until it is gone it still holds its place under server.max_connections;
making room aborts such a connection first (the one closing the longest).

While the daemon drains (cut_off_stalled), a connection that only has bytes to flush (its
response complete, or an event stream, which ends then) gets DRAIN_SEND_S from the drain's
start, or from its response's end if that is later, to take them, progress or not; an
event stream whose writes are paused is cut off at once. A response still being written
keeps its send timeout as ever.

A route that keeps its connection for long (a stream's SSE listeners, bounded by
server.max_stream_listeners in edgemm.server.stream_routes) marks it long-lived through the scope's
LONG_LIVED callable; such connections are not counted in server.max_connections, so
listeners cannot lock ordinary requests out.

uvicorn's own limit_concurrency is not used: it counts idle connections too, and answers
503 in plain text without Retry-After.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import struct
import sys
import termios
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from starlette.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from edgemm.server.protocol import error_body
from edgemm.server.scope_keys import EVICT_BODY, LONG_LIVED

IDLE, HEAD, BUSY = "idle", "head", "busy"
LINGER_S = 2.0  # after a refusal: how long the rest of the client's request is read and dropped
# a body that has been arriving this long may be closed to make room, slowest first: long
# enough that a body sent at once is in, short enough that a trickler goes soon
BODY_GRACE_S = 1.0
DRAIN_SEND_S = 1.0  # while the daemon drains: how long a client may take to flush what it was sent


@dataclass
class ConnectionLimits:
    """server.* limits of a connection, and where the refusals are counted."""
    max_connections: int
    header_timeout_s: float
    idle_timeout_s: float
    max_header_bytes: int
    retry_after_s: int
    # called with the reason each time the limits close or refuse a connection: idle_timeout,
    # header_timeout, header_too_large, evicted, body_evicted, over_capacity, malformed, send_timeout
    on_limit: Callable[[str], None] = field(default=lambda reason: None)
    send_timeout_s: float = 30.0
    draining: bool = False  # set by cut_off_stalled: the daemon is draining


def limited_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn (`http=`), bound to these limits."""
    return type("EdgemmHttpProtocol", (LimitedHttpProtocol,), {"limits": limits})


def cut_off_stalled(limits: ConnectionLimits, connections) -> int:
    """The daemon drains: cut off now every event stream whose client takes nothing (its writes
    paused), and give every connection that only has bytes to flush DRAIN_SEND_S to take them
    (slow or not), so that their end does not wait the grace period out (uvicorn would then
    cancel each with a traceback). A response in flight is left to finish (its send timeout
    as ever). Returns how many were cut off now."""
    limits.draining = True
    protocols = [c for c in list(connections) if isinstance(c, LimitedHttpProtocol)]
    stalled = [c for c in protocols if c.send_deadline is not None and c.long_lived]
    for connection in stalled:
        connection._cancel_send_deadline()
        connection._send_expired()
    for connection in protocols:
        if connection not in stalled:
            connection._drain_deadline()
    return len(stalled)


def response_bytes(status: int, body: dict, headers: dict[str, str]) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for refusals made while a
    request's head is still incomplete (there is no request for the app to answer)."""
    payload = json.dumps(body).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
             f"content-length: {len(payload)}", *(f"{k}: {v}" for k, v in headers.items()), "connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


class LimitedHttpProtocol(HttpToolsProtocol):
    limits: ConnectionLimits

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase = IDLE
        self.since = 0.0  # loop time the phase began: the oldest idle or head connection goes first
        self.deadline: asyncio.TimerHandle | None = None  # the idle or the head timeout
        self.head_bytes = 0  # bytes received outside a body since the last complete head
        self.head_size = 0  # the current request's line and headers, as parsed
        self.reading_body = False
        self.body_bytes = 0  # of the current request's body, received so far
        self.long_lived = False  # marked by its route (LONG_LIVED): not counted in max_connections
        self.over_capacity = False  # opened while every other connection was busy; looked at again at its head's end
        self.refused = False  # answered by the limits: whatever else arrives is ignored
        self.refusal_after: tuple[int, str, str] | None = None  # for a malformed head behind pipelined requests
        self.send_deadline: asyncio.TimerHandle | None = None  # armed while the transport's buffer is full, or it flushes
        self.send_buffered = 0  # the buffer's size when the deadline was armed
        self.send_draining = False  # the deadline is the drain's (DRAIN_SEND_S, progress or not)
        self.flushing_since: float | None = None  # loop time its transport was closed with bytes unsent

    # -- the connection --

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._enter(IDLE)
        if self._over_cap():
            self._make_room()
            # counted again: the one evicted may have held no place of its own (closing already)
            self.over_capacity = self._over_cap()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._cancel_send_deadline()
        super().connection_lost(exc)

    # A client that takes nothing: the kernel's buffer and then the transport's fill, and the
    # transport pauses our writes (uvicorn writes nothing more until it resumes them). If the
    # client has taken none of what is buffered within send_timeout_s it is cut off (abort:
    # close() would wait for the buffer to drain, which it never does), so a listener that never
    # reads, or a response nobody reads, cannot hold its socket for ever. A client that reads,
    # however slowly, keeps its connection: each deadline that finds the buffer smaller is
    # armed again. While the daemon drains, an event stream gets DRAIN_SEND_S instead.
    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_deadline is None:
            self._arm_send_deadline()

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self.transport.is_closing() and not self.send_draining:  # a flush's deadline holds
            self._cancel_send_deadline()

    def shutdown(self) -> None:  # uvicorn's, at the drain: an idle connection is closed
        super().shutdown()
        self._watch_close()

    def _unsent(self) -> int:
        """Bytes written and not yet taken by the client: the transport's buffer and the
        kernel's send queue (Linux's TIOCOUTQ; the kernel wakes a writer only once most of its
        queue is gone, so the transport's buffer alone would not show a slow reader's progress)."""
        queued = 0
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        return self.transport.get_write_buffer_size() + queued

    def _arm_send_deadline(self) -> None:
        self.send_buffered = self._unsent()
        self.send_draining = self._only_flushing()
        wait = DRAIN_SEND_S if self.send_draining else self.limits.send_timeout_s
        self.send_deadline = self.loop.call_later(min(wait, self.limits.send_timeout_s), self._send_expired)

    def _only_flushing(self) -> bool:
        """The daemon drains and this connection has nothing more to send than what it holds:
        closing, its response complete, or an event stream (which the drain ends)."""
        return self.limits.draining and (self.long_lived or self.transport.is_closing()
                                         or self.cycle is None or self.cycle.response_complete)

    def _drain_deadline(self) -> None:
        """While draining, a connection that only flushes gets DRAIN_SEND_S (once: a deadline
        the drain armed is not moved later)."""
        if not self.send_draining and self._only_flushing() and self._unsent():
            self._cancel_send_deadline()
            self._arm_send_deadline()

    def _watch_close(self) -> None:
        """Its transport was just closed: with bytes unsent it stays open until the client takes
        them, so it gets the send deadline (DRAIN_SEND_S while draining) and keeps its place
        under max_connections until it is gone."""
        if self.transport.is_closing() and self.flushing_since is None and self._unsent():
            self.flushing_since = self.loop.time()
            if self.send_deadline is None:
                self._arm_send_deadline()
            else:
                self._drain_deadline()

    def _cancel_send_deadline(self) -> None:
        if self.send_deadline is not None:
            self.send_deadline.cancel()
            self.send_deadline = None
        self.send_draining = False

    def _send_expired(self) -> None:
        draining = self.send_draining
        self.send_deadline, self.send_draining = None, False
        unsent = self._unsent()
        if unsent == 0:
            return  # it took everything meanwhile
        if not draining and unsent < self.send_buffered:
            self._arm_send_deadline()  # it took some: a slow reader, not a dead one
            return
        self._abort("send_timeout")

    def _abort(self, reason: str) -> None:
        """Closed at once, whatever its buffers hold (close() would wait for them to drain)."""
        self._cancel_deadline()
        self._cancel_send_deadline()
        self.limits.on_limit(reason)
        self.refused, self.flushing_since = True, None  # gone now: it holds no place
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.refused or self.refusal_after:
            return
        if self.phase == IDLE:
            self._enter(HEAD)
        if not self.reading_body:
            self.head_bytes += len(data)
        super().data_received(data)
        # still no complete head, and already more than a head may be: refused before
        # httptools buffers more (it keeps a header line whole until its end arrives)
        if not self.reading_body and self.head_bytes > self.limits.max_header_bytes:
            self._refuse_unparsed(431, self._too_large(), "header_too_large")

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.long_lived = False  # an event stream that ended: the connection counts again for what comes next
        self._drain_deadline()  # while draining, what it has not taken yet gets DRAIN_SEND_S
        if self.timeout_keep_alive_task is not None:  # no pipelined request waits: the connection is idle
            self._unset_keepalive_if_required()  # our own idle timer instead of uvicorn's
            if self.refusal_after:  # the malformed request that followed them: answered last, in order
                self._refuse_unparsed(*self.refusal_after)
                return
            self._enter(IDLE)

    def timeout_keep_alive_handler(self) -> None:  # not armed (see above); kept for uvicorn's sake
        self._idle_expired()

    # -- parser callbacks: the size of a head, and its end --

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_size = 0
        self.scope[LONG_LIVED] = self._mark_long_lived  # type: ignore[literal-required]
        self.scope[EVICT_BODY] = self._evict_slowest_body  # type: ignore[literal-required]

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self.head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self.head_size += len(name) + len(value) + 4  # ": " and CRLF

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        super().on_body(body)

    def on_headers_complete(self) -> None:
        self._cancel_deadline()
        self.phase, self.since = BUSY, self.loop.time()
        self.reading_body, self.head_bytes, self.body_bytes = True, 0, 0
        refusal = None
        if self.head_size > self.limits.max_header_bytes:
            refusal = self._refusal(431, self._too_large(), "header_too_large")
        elif self.over_capacity and not self._room_now():
            refusal = self._refusal(503, f"server busy: {self.limits.max_connections} connections have requests "
                                    f"in progress (server.max_connections); retry in {self.limits.retry_after_s} s",
                                    "over_capacity")
        app, self.app = self.app, refusal or self.app  # as uvicorn answers its own limit: this request only
        try:
            super().on_headers_complete()
        finally:
            self.app = app
        if self.cycle is not None:
            self.cycle.transport = _LingerOnClose(self, self.transport)  # type: ignore[assignment]

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.reading_body = False

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what httptools cannot parse (bad chunk sizes, Content-Length with
        Transfer-Encoding or twice, NUL or bare LF in headers, HTTP/2's preface, a huge
        method), in OpenAI's shape instead of plain text; called inside its except clause.
        A request line over max_header_bytes lands here too (httptools' URL parser takes at
        most 64 KiB): that is a 431."""
        if self.head_size > self.limits.max_header_bytes or self.head_bytes > self.limits.max_header_bytes:
            refusal = (431, self._too_large(), "header_too_large")
        else:
            error = sys.exc_info()[1]
            detail = str(error).strip().rstrip(".") if error is not None else ""
            if detail == "Pause on PRI/Upgrade":  # llhttp's words for HTTP/2's connection preface
                detail = "HTTP/2 is not served here (HTTP/1.1 only)"
            refusal = (400, f"malformed HTTP request{': ' + detail if detail else ''}", "malformed")
        if not self.reading_body and self.cycle is not None and not self.cycle.response_complete:
            # requests pipelined before this head are still being answered: answering now would
            # shut the writing side under them (their answers lost, and write() after
            # write_eof() raising in their cycles), so the refusal follows their answers
            # (on_response_complete). The parser is dead: what else arrives is dropped.
            self.refusal_after = refusal
            self._cancel_deadline()
            return
        self._refuse_unparsed(*refusal)

    # -- the limits --

    def _too_large(self) -> str:
        return f"request line and headers are larger than {self.limits.max_header_bytes} bytes (server.max_header_bytes)"

    def _mark_long_lived(self) -> None:
        self.long_lived = True

    def _holding(self) -> int:
        """Connections that hold a place under max_connections: open (neither closing nor
        refused and lingering to close) or closed with bytes unsent (its socket held until
        they are taken, or its send deadline passes), and not long-lived (a stream's
        listeners are bounded on their own)."""
        return sum(not getattr(c, "long_lived", False)
                   and (getattr(c, "flushing_since", None) is not None
                        or not c.transport.is_closing() and not getattr(c, "refused", False))
                   for c in self.connections)

    def _over_cap(self) -> bool:
        return self._holding() > self.limits.max_connections

    def _enter(self, phase: str) -> None:
        self._cancel_deadline()
        self.phase, self.since = phase, self.loop.time()
        if phase == IDLE:
            self.head_bytes = 0
            self.deadline = self.loop.call_later(self.limits.idle_timeout_s, self._idle_expired)
        else:
            self.deadline = self.loop.call_later(self.limits.header_timeout_s, self._head_expired)

    def _cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _idle_expired(self) -> None:
        self._close("idle_timeout")

    def _head_expired(self) -> None:
        if self.phase == HEAD:
            self._refuse_unparsed(408, f"the request line and headers did not arrive within "
                                  f"{self.limits.header_timeout_s:g} s (server.header_timeout_s)", "header_timeout")

    def _close(self, reason: str) -> None:
        self._cancel_deadline()
        if not self.transport.is_closing():
            if not self.refused:  # a refused connection lingering was counted when it was refused
                self.limits.on_limit(reason)
            self.refused = True
            self._close_now()

    def _close_now(self) -> None:
        self.transport.close()
        self._watch_close()

    def _refuse_unparsed(self, status: int, message: str, reason: str, headers: dict[str, str] | None = None) -> None:
        """Answer a connection whose request head is incomplete, and close it.

        The client may still be sending: closing a socket with unread data resets the
        connection, and the client would lose the answer. So the writing side is shut, what
        still arrives is dropped unread by the parser for up to LINGER_S, and the connection
        holds no place under max_connections meanwhile."""
        if self.transport.is_closing():
            return
        kind = {408: "timeout", 503: "overloaded"}.get(status, "invalid_request_error")
        self.transport.write(response_bytes(status, error_body(message, kind, code=reason), headers or {}))
        self.refused = True
        self.limits.on_limit(reason)
        self._cancel_deadline()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.phase, self.since = IDLE, 0.0
        self.deadline = self.loop.call_later(LINGER_S, self._close_now)

    def _refusal(self, status: int, message: str, reason: str) -> JSONResponse:
        """The app for a request refused once its head is complete (uvicorn runs it and closes)."""
        self.limits.on_limit(reason)
        headers = {"Connection": "close"}
        if status == 503:
            headers["Retry-After"] = str(self.limits.retry_after_s)
        kind = "overloaded" if status == 503 else "invalid_request_error"
        return JSONResponse(error_body(message, kind, code=reason), status, headers)

    def _make_room(self) -> None:
        """Over the cap: make room by evicting the connection idle or sending its head the
        longest, else the busy one whose body arrives the slowest. False if every other
        connection is busy otherwise (this one's request is then refused, 503, once its head
        is in, unless room has come free by then). Long-lived connections hold no place, so
        evicting one frees none."""
        connections = [c for c in self.connections if c is not self and isinstance(c, LimitedHttpProtocol)]
        flushing = [c for c in connections if c.flushing_since is not None and not c.long_lived]
        if flushing:  # closed already, its client slow to take the rest: it goes first, at once
            min(flushing, key=lambda c: c.flushing_since)._abort("evicted")
            return
        others = [c for c in connections if not c.transport.is_closing() and not c.long_lived and not c.refused]
        waiting = [c for c in others if c.phase in (IDLE, HEAD)]
        if waiting:
            min(waiting, key=lambda c: c.since)._evict()
            return
        now = self.loop.time()
        slow = [c for c in others if c._body_evictable(now)]
        if slow:
            min(slow, key=lambda c: c.body_bytes / (now - c.since))._evict_body(now)

    def _evict_slowest_body(self) -> bool:
        """For the body-byte pool (edgemm.server.bodies), full: close the upload, of another
        connection, that has been arriving for BODY_GRACE_S at the lowest rate (408
        body_evicted); its reader then releases its bytes. False if there is none."""
        now = self.loop.time()
        slow = [c for c in self.connections if c is not self and isinstance(c, LimitedHttpProtocol)
                and not c.transport.is_closing() and not c.refused and c.body_bytes and c._body_evictable(now)]
        if not slow:
            return False
        min(slow, key=lambda c: c.body_bytes / (now - c.since))._evict_body(
            now, "request bodies filled the server's body-byte pool (server.queue_size x server.max_body_bytes)")
        return True

    def _room_now(self) -> bool:
        """For a connection that opened over the cap, at the end of its head: is there room
        now? Requests may have ended, and connections gone, since it opened."""
        if self._over_cap():
            self._make_room()
        self.over_capacity = self._over_cap()
        return not self.over_capacity

    def _evict(self) -> None:
        """Closed to make room. A client halfway through its head is owed an answer, not a
        reset: the overload is answered, as a refused newcomer's is. An idle one has asked
        nothing, so it is simply closed (as its idle timeout would), at once if it has not
        taken all of its last answer yet (a flush would keep its place)."""
        if self.phase == HEAD and not self.refused:
            self._refuse_unparsed(503, f"server busy: more than {self.limits.max_connections} connections "
                                  "(server.max_connections), and this one's headers were the slowest; "
                                  f"retry in {self.limits.retry_after_s} s",
                                  "evicted", {"Retry-After": str(self.limits.retry_after_s)})
        elif self._unsent() and not self.refused:
            self._abort("evicted")
        else:
            self._close("evicted")

    def _body_evictable(self, now: float) -> bool:
        """Busy receiving its body for BODY_GRACE_S, no answer begun: its app waits on the body."""
        return (self.phase == BUSY and self.reading_body and not self.long_lived and now - self.since >= BODY_GRACE_S
                and self.cycle is not None and not self.cycle.response_started)

    def _evict_body(self, now: float, taken: str = "") -> None:
        """Closed to make room (`taken`: of what): 408, and its app told the client is gone
        (it answers no more)."""
        rate = self.body_bytes / (now - self.since)
        taken = taken or f"all {self.limits.max_connections} connections were taken (server.max_connections)"
        self._refuse_unparsed(408, f"the request body arrived too slowly ({rate:.0f} bytes/s) while {taken}: "
                              "closed to make room", "body_evicted")
        cycle = self.cycle
        cycle.disconnected = True  # the app's receive() gets http.disconnect; its answer is not sent
        cycle.message_event.set()


class _LingerOnClose:
    """The transport as a request's cycle sees it. An answer that closes the connection
    while the body is still arriving (408, 413, 503) would reset it, and the client would
    lose the answer (as with _refuse_unparsed): so the writing side is shut and the rest
    is dropped unread for up to LINGER_S instead."""

    def __init__(self, protocol: LimitedHttpProtocol, transport: asyncio.Transport):
        self._protocol, self._transport = protocol, transport

    def close(self) -> None:
        protocol, transport = self._protocol, self._transport
        if not protocol.reading_body or transport.is_closing() or not transport.can_write_eof():
            protocol._close_now()
            return
        protocol.refused = True  # what still arrives is ignored
        protocol._cancel_deadline()
        transport.write_eof()
        protocol.phase, protocol.since = IDLE, 0.0  # refused: it holds no place under the cap meanwhile
        protocol.deadline = protocol.loop.call_later(LINGER_S, protocol._close_now)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
