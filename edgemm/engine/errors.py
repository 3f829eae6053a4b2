"""The errors of edgemm.engine that stay inside it (Overloaded, which the server and the
streams raise too, is in edgemm/errors.py)."""
from __future__ import annotations


class DecodeFailure(RuntimeError):
    """One answer's decoding went wrong (non-finite logits, a token the embedding refuses)."""
