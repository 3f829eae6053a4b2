"""The limits of the generation options, checked in one place for every way in.

The config file (generation.*, streams[i].max_new_tokens), the API (max_tokens,
temperature, top_p, seed), the command line (--max-new-tokens, --beams, …) and
GenerationOptions itself all call `check_generation`. Each passes the names it spells
the options with, so the one-line message names the field the user wrote:

    'max_completion_tokens' must be in 1..4096, got 0
    '--temperature' must be a finite number, got nan
    'generation.seed' must be at most 2**64 - 1, got 18446744073709551616

Values that cannot work are refused before anything runs: NaN and infinities (an
integer too large for a float among them), a temperature so small that the logits over
it overflow into NaN probabilities, a seed numpy's generators do not take. `check_text`
refuses prompts (and other text) holding a NUL or an unpaired surrogate, which the
tokenizer cannot encode.
"""
from __future__ import annotations

import math
import numbers
import re
from collections.abc import Collection, Mapping
from typing import Any

from edgemm.util.errors import LimitError

MAX_NEW_TOKENS = 4096  # most tokens one answer may ask for
MAX_BEAMS = 16  # widest beam search (also the most decoder rows an engine is built for)
# Sampling divides the logits by the temperature: below this, logits of ordinary size
# (tens) overflow float64 (5e-324 gives inf - inf = NaN probabilities). 0 means greedy.
MIN_TEMPERATURE = 1e-3
MAX_SEED = 2**64 - 1  # numpy's SeedSequence words are uint64; OpenAI's seed is an int64
FIELDS = ("max_new_tokens", "temperature", "top_p", "seed", "num_beams", "beam_gate")


def check_generation(*, max_new_tokens: Any = None, temperature: Any = None, top_p: Any = None,
                     seed: Any = None, num_beams: Any = None, beam_gate: Any = None,
                     names: Mapping[str, str] | None = None, nullable: Collection[str] = ()) -> None:
    """Raise LimitError for the first option out of its limits; None means "not given".

    `names` maps an option (one of FIELDS) to the caller's name for it (default: the
    option's own name); `nullable` are options whose messages say null is allowed too.
    Beam search and sampling exclude each other only when both are given."""
    def fail(option: str, rule: str, value: Any) -> None:
        raise LimitError((names or {}).get(option, option), rule + (" or null" if option in nullable else ""),
                         value)

    # `type(…) is` first: every request passes here, and the ABC checks cost microseconds
    def integer(option: str, value: Any, low: int, high: int, rule: str) -> None:
        if type(value) is not int and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
            fail(option, "be an integer", value)
        if not low <= value <= high:
            fail(option, rule, value)

    def number(option: str, value: Any) -> float:
        if type(value) is not float and (not isinstance(value, numbers.Real) or isinstance(value, bool)):
            fail(option, "be a number", value)
        try:
            as_float = float(value)
        except OverflowError:  # an integer beyond float's range (10**400)
            as_float = math.inf
        if not math.isfinite(as_float):
            fail(option, "be a finite number", value)
        return as_float

    if max_new_tokens is not None:
        integer("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS, f"be in 1..{MAX_NEW_TOKENS}")
    if temperature is not None:
        t = number("temperature", temperature)
        if t < 0:
            fail("temperature", "be >= 0", temperature)
        if 0 < t < MIN_TEMPERATURE:
            fail("temperature", f"be 0 (greedy) or at least {MIN_TEMPERATURE:g}", temperature)
    if top_p is not None and not 0 < number("top_p", top_p) <= 1:
        fail("top_p", "be in (0, 1]", top_p)
    if seed is not None:
        integer("seed", seed, 0, MAX_SEED, "be >= 0" if isinstance(seed, numbers.Integral) and seed < 0
                else "be at most 2**64 - 1")
    if num_beams is not None:
        integer("num_beams", num_beams, 1, MAX_BEAMS, f"be in 1..{MAX_BEAMS}")
    if beam_gate is not None and not 0 <= number("beam_gate", beam_gate) <= 1:
        fail("beam_gate", "be in [0, 1]", beam_gate)
    if num_beams is not None and temperature is not None and num_beams > 1 and temperature > 0:
        fail("num_beams", "be 1 when sampling (beam search is greedy: temperature 0)", num_beams)


# NUL and any surrogate code point (a Python str holds a valid pair as one code point, so a
# surrogate in one is unpaired: JSON's "\ud800", or command-line bytes that are not UTF-8)
_NOT_TEXT = re.compile("[\x00\ud800-\udfff]")


def check_text(text: str, name: str) -> None:
    """Raise LimitError naming `name` if `text` holds a NUL character or an unpaired surrogate:
    the tokenizer cannot encode either, and no path or prompt means one."""
    found = _NOT_TEXT.search(text)
    if found is not None:
        raise LimitError(name, "be text without NUL characters or unpaired surrogates", found.group())
