"""The errors of the HTTP side, and how any error becomes a response's status.

Each carries what edgemm.errors.EdgemmError does (exit code, kind); an ApiError also its
HTTP status and OpenAI's `param` and `code`. edgemm.server.app turns every error a route
raises into OpenAI's error shape with `describe`'s status.
"""
from __future__ import annotations

from starlette.exceptions import HTTPException

from edgemm.errors import EdgemmError, internal_message


class ApiError(EdgemmError):
    """A request the API refuses; str(e) is the message clients see."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.http_status, self.kind, self.param, self.code = status, kind, param, code
        self.exit_code = 2 if status < 500 else 1


class ListenError(EdgemmError):
    """The socket cannot be created (path in use, no permission, unknown group)."""
    exit_code = 2
    kind = "listen_error"


def describe(error: BaseException) -> tuple[int, str, str]:
    """(HTTP status, OpenAI error type, message) for any error."""
    if isinstance(error, HTTPException):
        return error.status_code, "invalid_request_error" if error.status_code < 500 else "server_error", \
            str(error.detail)
    if isinstance(error, EdgemmError):
        return error.http_status, error.kind, str(error)
    return 500, "server_error", internal_message(error)
