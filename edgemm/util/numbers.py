"""What the readers of YAML and JSON files (the config, model.yaml, a Hugging Face folder's
JSON) accept as a number."""
from __future__ import annotations

import math


def finite_number(value: object) -> bool:
    """An int or float (not a bool) that is finite: not NaN or ±inf (YAML's .nan, .inf), and
    not an int too big for a float (a JSON or YAML integer of a thousand digits)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
