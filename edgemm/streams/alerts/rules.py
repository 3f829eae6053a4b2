"""How an alert's answer reads: true, false or unknown (AlertConfig's rule keys)."""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from edgemm.config import AlertConfig

STATES = ("true", "false", "unknown")


NUMBER_WORDS = {word: n for n, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty".split())} | {"no": 0, "none": 0}
_WORD = re.compile(r"[0-9]+(?:\.[0-9]+)?|[^\W\d_]+")  # a number, or a run of letters


def words(text: str) -> list[str]:
    """The answer's words, lower case, without punctuation: 'Yes, a red one.' → yes a red one."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Rule:
    """How an answer reads as true / false / unknown (AlertConfig's rule keys)."""
    match: tuple[str, ...] = ()  # these words, in order, somewhere in the answer
    above: float | None = None
    below: float | None = None

    @classmethod
    def of(cls, cfg: AlertConfig) -> "Rule":
        return cls(tuple(words(cfg.match)) if cfg.match is not None else (), cfg.above, cfg.below)

    def read(self, answer: str) -> str:
        found = words(answer)
        if not found:
            return "unknown"
        if self.match:
            n = len(self.match)
            return str(any(tuple(found[i:i + n]) == self.match for i in range(len(found) - n + 1))).lower()
        if self.above is not None or self.below is not None:
            number = first_number(found)
            if number is None:
                return "unknown"
            holds = (self.above is None or number > self.above) and (self.below is None or number < self.below)
            return str(holds).lower()
        return {"yes": "true", "no": "false"}.get(found[0], "unknown")  # a yes/no question


def first_number(found: Iterable[str]) -> float | None:
    """The first number among the words: digits ('3') or a word ('three'); 'no' counts as 0."""
    for word in found:
        if word[0].isdigit():
            return float(word)
        if word in NUMBER_WORDS:
            return float(NUMBER_WORDS[word])
    return None
