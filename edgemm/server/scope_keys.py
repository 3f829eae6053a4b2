"""The ASGI scope keys through which a route reaches its connection's limits
(edgemm.server.connections sets them on each request; the routes call them).

A module of their own: edgemm.server.connections needs httptools, which the h11 fallback
runs without; the keys are then absent from the scope, and a route calling them does nothing.
"""
from __future__ import annotations

from collections.abc import MutableMapping

# call it to take the connection out of server.max_connections: a stream's SSE listener
# stays for as long as the stream runs (the listeners have server.max_stream_listeners)
LONG_LIVED = "edgemm.long_lived"
# call it to close the slowest body upload of another connection (True if one was closed),
# for edgemm.server.bodies' body-byte pool, which stalled uploads could otherwise fill
EVICT_BODY = "edgemm.evict_body"


def mark_long_lived(scope: MutableMapping) -> None:
    """This request's connection stays open for long: out of server.max_connections."""
    if callable(mark := scope.get(LONG_LIVED)):
        mark()
