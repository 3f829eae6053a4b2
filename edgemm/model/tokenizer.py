"""The tokenizer.json of a model folder, and the ids of the tokens a family needs."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from edgemm.errors import ModelError
from edgemm.util.files import read_model_file


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer at `path`, or a one-line ModelError naming the file."""
    text = read_model_file(path)  # Tokenizer.from_file would open a FIFO and wait, or read /dev/zero
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises its own Exception types, some with multi-line text
        raise ModelError(f"cannot read tokenizer {path}: {str(e).splitlines()[0] if str(e) else e}") from None


def token_id(tokenizer: Tokenizer, token: str, what: str) -> int:
    """The id of a token the family needs, or a ModelError naming it (`what`)."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ModelError(f"{what} is not in the tokenizer")
    return found
