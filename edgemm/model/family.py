"""Family adapters: how a model family turns an image into pixel values and a user
prompt into input ids.

Every adapter has the same methods: `pixels(rgb, tier)`, `build_prompt(prompt, tier,
image_size)`, `decode(ids)` and `stop_ids`. The built-in family fills the manifest's
prompt format and expands its single image token into one placeholder per image
feature of the tier; idefics3 (edgemm/model/idefics3.py) tiles the image and
expands the chat template's image into tiles of placeholders.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from edgemm.errors import InputError, ModelError
from edgemm.model.manifest import ModelManifest, ResolutionTier
from edgemm.model.preprocess import to_pixel_values


def token_id(tokenizer: Tokenizer, token: str, what: str) -> int:
    """The id of a token the family needs, or a ModelError naming it (`what`)."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ModelError(f"{what} is not in the tokenizer")
    return found


@dataclass
class Prompt:
    input_ids: np.ndarray  # int64 [1, S], image placeholders expanded
    image_start: int  # index of the first image placeholder
    image_tokens: int  # how many placeholders (= encoder output tokens)
    unknown_words: int  # words the vocabulary does not have
    # where the encoder's output tokens go, in order; one contiguous run unless given
    image_positions: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.image_positions is None:
            self.image_positions = np.arange(self.image_start, self.image_start + self.image_tokens)


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
        return token_id(self.tokenizer, token, f"{self.manifest.path}: token {token!r} from model.yaml")

    def pixels(self, rgb: np.ndarray, tier: ResolutionTier) -> np.ndarray:
        """RGB8 → float32 [1, 3, H, W] at the tier's size."""
        pre = self.manifest.preprocessing
        return to_pixel_values(rgb, tier.height, tier.width, pre.mean, pre.std)

    def build_prompt(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int] | None = None) -> Prompt:
        """`image_size` is unused: every image gives the tier's number of placeholders."""
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


def families() -> dict[str, type]:
    from edgemm.model.idefics3 import Idefics3Adapter  # it builds on Prompt, above
    return {"tiny-vlm": TinyVLMAdapter, "idefics3": Idefics3Adapter}


def adapter_for(manifest: ModelManifest):
    known = families()
    if manifest.family not in known:
        raise ModelError(f"{Path(manifest.path) / 'model.yaml'}: unknown family {manifest.family!r} "
                         f"(known: {', '.join(known)})")
    return known[manifest.family](manifest)
