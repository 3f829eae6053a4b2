"""The errors of edgemm.power: the offload endpoint failed, or nothing was sent to it."""
from __future__ import annotations

from edgemm.errors import EdgemmError


class OffloadError(EdgemmError):
    """The endpoint failed: unreachable, an error status, or a reply that is no chat completion."""
    exit_code = 1
    http_status = 502
    kind = "offload_error"


class OffloadTimeout(OffloadError):
    http_status = 504
    kind = "timeout"


class OffloadUnavailable(OffloadError):
    """Offload is off, or the circuit breaker is open: nothing was sent."""
    http_status = 503
    kind = "offload_unavailable"
