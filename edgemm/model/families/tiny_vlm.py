"""The built-in family (models/tiny-vlm): a model.yaml prompt format with one image token.

The prompt format's `{prompt}` gets the user's text; its single image token expands to
one placeholder per image feature of the tier; the image is stretched to the tier's size.
The tokenizer is word-level over a closed world (edgemm/model/scenes.py): a word outside it
reads as <unk>, so build_prompt reports such words and the family knows the questions
the model was trained on.
"""
from __future__ import annotations

import numpy as np

from edgemm.errors import InputError, ModelError
from edgemm.model.family import Prompt, TokenizedFamily, register
from edgemm.model.manifest_types import ModelManifest, ResolutionTier
from edgemm.model.preprocess import to_pixel_values
from edgemm.model.tokenizer import token_id
from edgemm.model.scenes import PROMPTS, SHAPES

# the first phrasing of each task it was trained on (edgemm/model/scenes.py), for the hint
# given with a prompt that has unknown words
KNOWN_PROMPTS = tuple(phrasings[0].replace("{shape}", "|".join(SHAPES)) for phrasings in PROMPTS.values())


@register("tiny-vlm")
class TinyVLMAdapter(TokenizedFamily):
    """Prompt format with one `<image>` token, expanded to N for the tier."""

    known_prompts = KNOWN_PROMPTS

    def __init__(self, manifest: ModelManifest):
        super().__init__(manifest)
        for key, token in manifest.special_tokens.items():  # each must be a token, as the stop tokens must
            token_id(self.tokenizer, token, f"{manifest.path / 'model.yaml'}: special_tokens.{key} {token!r}")
        self.image_id = self.id_of(manifest.image_token)
        self.stop_ids = {self.id_of(t) for t in manifest.stop_tokens}
        # the prompt format must give the image token once whatever the prompt: else every
        # request would be refused, as if its prompt held the image token
        format_ids = self.tokenizer.encode(manifest.prompt_format.replace("{prompt}", ""), add_special_tokens=False).ids
        if format_ids.count(self.image_id) != 1:
            raise ModelError(f"{manifest.path / 'model.yaml'}: prompt_format gives the image token "
                             f"{manifest.image_token} {format_ids.count(self.image_id)} times, not once")
        self.unk_id = self.tokenizer.token_to_id(manifest.special_tokens.get("unk", "<unk>"))

    def id_of(self, token: str) -> int:
        """The token's id; a ModelError that names model.yaml, where its tokens are written."""
        return token_id(self.tokenizer, token, f"{self.manifest.path}: token {token!r} from model.yaml")

    def pixels(self, rgb: np.ndarray, tier: ResolutionTier) -> np.ndarray:
        """RGB8 → float32 [1, 3, H, W] at the tier's size."""
        pre = self.manifest.preprocessing
        return to_pixel_values(rgb, tier.height, tier.width, pre.mean, pre.std)

    def build_prompt(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int] | None = None) -> Prompt:
        """`image_size` is unused: every image gives the tier's number of placeholders."""
        text = self.manifest.prompt_format.replace("{prompt}", " ".join(prompt.split()))
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids = encoding.ids
        if ids.count(self.image_id) != 1:
            raise InputError(f"the prompt must not contain the image token {self.manifest.image_token}")
        # the words that read as <unk>, as the user wrote them (the offsets point into `text`)
        unknown = tuple(dict.fromkeys(text[a:b] for i, (a, b) in zip(ids, encoding.offsets) if i == self.unk_id))
        start = ids.index(self.image_id)
        ids[start:start + 1] = [self.image_id] * tier.image_tokens
        return Prompt(np.asarray([ids], np.int64), start, tier.image_tokens, unknown)
