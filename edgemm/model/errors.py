"""The errors of edgemm.model: an image refused, or no room to decode it now."""
from __future__ import annotations

from edgemm.errors import EdgemmError, InputError


class ImageError(InputError):
    """Bad image input; str(e) is a clear one-line message for the user."""


class DecodeBusy(EdgemmError):
    """The decode budget shared by the prepare threads has no room for this image now:
    HTTP 503 with Retry-After (the client tries again), not 400 (the image is fine)."""
    exit_code = 1
    http_status = 503
    kind = "overloaded"
