"""The errors edgemm reports to people, each with its exit code and HTTP status.

Anything else that escapes is an internal error: exit code 1, HTTP 500.
"""
from __future__ import annotations

import os


class EdgemmError(Exception):
    """Base for errors with a clear one-line message meant for the user."""
    exit_code = 1
    http_status = 500
    kind = "internal_error"


class InputError(EdgemmError, ValueError):
    """The request is wrong: bad image, prompt too long, unknown tier, bad option."""
    exit_code = 2
    http_status = 400
    kind = "invalid_request_error"


class ModelError(EdgemmError):
    """The model folder (or engine) is missing, incomplete or breaks the model contract."""
    exit_code = 2
    http_status = 500
    kind = "model_error"


class BackendError(EdgemmError):
    """The backend could not load or run a graph (provider missing, engine mismatch)."""
    exit_code = 1
    http_status = 500
    kind = "backend_error"


class EngineError(ModelError):
    """A TensorRT engine is missing, stale or was built for another TensorRT or device.

    The message ends with the command that rebuilds it. Exit code 2 like a broken model folder:
    the user fixes it by rebuilding, not by filing a bug.
    """
    kind = "engine_error"


class Cancelled(EdgemmError):
    """The request was cancelled (its client went away, it timed out, or the service stops
    before its grace period let it finish): its answer stops at the next decoder step."""
    exit_code = 1
    http_status = 499
    kind = "client_closed"


class Overloaded(EdgemmError):
    """The pipeline's admission queue is full; try again shortly."""
    http_status = 503
    kind = "overloaded"


class ConfigError(EdgemmError, ValueError):
    """A configuration problem; the message is one line starting with 'config'."""
    exit_code = 2
    kind = "config_error"

    def __init__(self, detail: str, file: str | os.PathLike | None = None):
        self.detail = detail
        self.file = None if file is None else os.fspath(file)
        super().__init__(f"config: {self.file}: {detail}" if file is not None else f"config: {detail}")


def one_line(text: str, limit: int = 500) -> str:
    """`text` as one line of at most `limit` characters: backends (onnxruntime, TensorRT)
    raise messages that span lines, and a client or a log line gets one."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 1] + "…"


def internal_message(error: BaseException) -> str:
    """The one-line message of an error that is not edgemm's own (a bug, a backend failure)."""
    text = one_line(str(error))
    return f"internal error: {type(error).__name__}: {text}" if text else f"internal error: {type(error).__name__}"
