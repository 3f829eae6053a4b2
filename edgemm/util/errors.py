"""The errors of edgemm.util: an environment that lacks OpenCV, a generation option out of its
limits, a secret (an API key, a webhook's token) that cannot be read safely."""
from __future__ import annotations

from typing import Any

from edgemm.errors import EdgemmError, InputError


class OpenCVUnavailable(EdgemmError, ImportError):
    """cv2 cannot be imported. Exit code 2 like a bad config: the user fixes the install."""
    exit_code = 2
    http_status = 500
    kind = "environment_error"


class LimitError(InputError):
    """One generation option out of its limits. `field` is its name as the caller spells it;
    `rule` completes "must …"."""

    def __init__(self, field: str, rule: str, value: Any):
        self.field, self.rule, self.value = field, rule, value
        shown = repr(value)
        if len(shown) > 60:  # a number of 400 digits is not repeated back whole
            shown = shown[:57] + "..."
        super().__init__(f"{field!r} must {rule}, got {shown}")


class CredentialsError(EdgemmError):
    """The API key's environment variable or file is missing or unsafe."""
    exit_code = 2
    kind = "config_error"
