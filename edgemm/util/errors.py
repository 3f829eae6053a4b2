"""The errors of edgemm.util: a secret (an API key, a webhook's token) that cannot be read safely."""
from __future__ import annotations

from edgemm.errors import EdgemmError


class CredentialsError(EdgemmError):
    """The API key's environment variable or file is missing or unsafe."""
    exit_code = 2
    kind = "config_error"
