"""Family adapters: how a model family turns a user prompt into input ids.

The adapter fills the manifest's prompt format, tokenizes it with the model's
Hugging Face tokenizer and expands the single image token into one placeholder
per image feature of the chosen tier. Families that tile images or use chat
templates plug in here behind the same two methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from edgemm.errors import InputError, ModelError
from edgemm.model.manifest import ModelManifest, ResolutionTier


@dataclass
class Prompt:
    input_ids: np.ndarray  # int64 [1, S], image placeholders expanded
    image_start: int  # index of the first image placeholder
    image_tokens: int  # how many placeholders (= encoder output tokens)
    unknown_words: int  # words the vocabulary does not have


class TinyVLMAdapter:
    """Prompt format with one `<image>` token, expanded to N for the tier."""

    def __init__(self, manifest: ModelManifest):
        self.manifest = manifest
        path = manifest.path / manifest.files["tokenizer"]
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:
            raise ModelError(f"cannot read tokenizer {path}: {str(e).splitlines()[0] if str(e) else e}") from None
        self.image_id = self._id(manifest.image_token)
        self.stop_ids = {self._id(t) for t in manifest.stop_tokens}
        self.unk_id = self.tokenizer.token_to_id(manifest.special_tokens.get("unk", "<unk>"))

    def _id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ModelError(f"{self.manifest.path}: token {token!r} from model.yaml is not in the tokenizer")
        return token_id

    def build_prompt(self, prompt: str, tier: ResolutionTier) -> Prompt:
        text = self.manifest.prompt_format.replace("{prompt}", " ".join(prompt.split()))
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if ids.count(self.image_id) != 1:
            raise InputError(f"the prompt must not contain the image token {self.manifest.image_token}")
        start = ids.index(self.image_id)
        ids[start:start + 1] = [self.image_id] * tier.image_tokens
        unknown = sum(1 for i in ids if i == self.unk_id) if self.unk_id is not None else 0
        return Prompt(np.asarray([ids], np.int64), start, tier.image_tokens, unknown)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=True)


FAMILIES = {"tiny-vlm": TinyVLMAdapter}


def adapter_for(manifest: ModelManifest) -> TinyVLMAdapter:
    try:
        return FAMILIES[manifest.family](manifest)
    except KeyError:
        raise ModelError(f"{Path(manifest.path) / 'model.yaml'}: unknown family {manifest.family!r} "
                         f"(known: {', '.join(FAMILIES)})") from None
