"""The errors of edgemm.streams: sources that cannot be opened or read, and the API's refusals
of a stream (POST /v1/streams, PATCH, DELETE), each with its exit code and HTTP status."""
from __future__ import annotations

from edgemm.errors import EdgemmError, InputError


class SourceError(InputError):
    """A source that cannot be opened or read; str(e) is one line for the user."""


class SourceUnusable(SourceError):
    """A source that no retry can fix (the daemon's stream goes to `failed`, not `retrying`)."""


class StreamConflict(EdgemmError):
    exit_code = 2
    http_status = 409
    kind = "invalid_request_error"


class StreamForbidden(EdgemmError):
    exit_code = 2
    http_status = 403
    kind = "permission_error"


class StreamNotFound(EdgemmError):
    exit_code = 2
    http_status = 404
    kind = "invalid_request_error"


class StreamSpecError(InputError):
    """A 400 for a POST /v1/streams body; `param` names the field (OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
