"""Streaming text: the new text each generated token adds, in O(1) per token.

Decoding the whole answer again after every token costs O(n²) over an answer (and
runs on the decode thread, where it holds up every row of the batch). tokenizers'
DecodeStream keeps a small window instead and holds back a token that ends inside a
multi-byte character until the character is complete. What it has streamed is
always a prefix of the full decode; `finish` hands over the rest (at most the
replacement characters of an unfinished character at the very end).
"""
from __future__ import annotations

from collections.abc import Callable

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

TextCallback = Callable[[int, str], None]  # (token id, the text it adds; "" while a character is incomplete)

END_OF_TEXT = -1  # the token id `finish` reports: no new token, only the rest of the text


class TextStream:
    """Token ids in, `on_text(token_id, new_text)` out: for one answer."""

    def __init__(self, tokenizer: Tokenizer, on_text: TextCallback):
        self.tokenizer, self.on_text = tokenizer, on_text
        self._stream = DecodeStream(skip_special_tokens=True)
        self.sent = 0  # characters handed over so far

    def __call__(self, token: int) -> None:
        piece = self._stream.step(self.tokenizer, token) or ""
        self.sent += len(piece)
        self.on_text(token, piece)

    def finish(self, text: str) -> None:
        """The answer is `text` (the full decode): hand over what the stream held back."""
        rest = text[self.sent:]
        if rest:
            self.sent = len(text)
            self.on_text(END_OF_TEXT, rest)
