"""The gemma3 family (Gemma 3 with vision): one square image, chat template, image-token expansion.

The image is stretched to the processor's one size (896x896 in the released models: one
resolution tier, no pan-and-scan) with Pillow's filter of the folder's `resample`
(bilinear), rescaled and normalised as Gemma3ImageProcessor does. The prompt is the
folder's chat template with one `<start_of_image>` before the user's text, which expands
as Gemma3Processor expands it:

    \\n\\n<start_of_image><image_soft_token>*N<end_of_image>\\n\\n    (N = image_seq_length, 256)

The encoder's N output tokens fill the `<image_soft_token>` positions in order.

Two choices, both checked by tests/test_gemma3.py against transformers:

* Attention is causal everywhere. transformers lets one image's soft tokens attend to
  each other both ways when it is given `token_type_ids`; a decoder graph whose only mask
  is the 2-D attention_mask cannot express that, so edgemm (like transformers.js) is exact
  against transformers run without token_type_ids, and approximate against it with them.
* Positions are 0-based (cumsum(mask) - 1, the model contract), as transformers' own
  generate feeds them. transformers.js feeds Gemma 3 1-based positions; rotary embeddings
  only see differences of positions, so the two differ by rounding, not by meaning.

Prefix reuse (`reuses_image_prefix`, see edgemm/model/family.py) stays on: the prefix edgemm
keeps ends after the last soft token, and no position in it sees the question. The graph is
causal; and even transformers' bidirectional block (with token_type_ids) covers only the
soft tokens of the one image, all of which lie inside that prefix.

Registered for the model type `gemma3`; its folders are Hugging Face folders.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edgemm.errors import ModelError
from edgemm.model.chat_template import ChatTemplate
from edgemm.model.family import FamilyFields, GraphInputs, Prompt, TokenizedFamily, one_tier, register
from edgemm.model.hf_folder import (JsonObject, eos_token_ids, optional_json, pixel_normalisation, read_json,
                                    special_token)
from edgemm.model.manifest_types import ModelManifest, ResolutionTier
from edgemm.model.preprocess import rescale_normalize
from edgemm.model.resample import FILTER_NAMES, resize_pil

# the names Gemma 3's tokenizer_config.json gives them, and their usual values
TOKEN_DEFAULTS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                  "image_token": "<image_soft_token>", "bos_token": "<bos>"}
END_OF_TURN = "<end_of_turn>"
PIL_BILINEAR = 2  # Gemma3ImageProcessor's default filter


def family_config(path: Path, config: JsonObject, preprocessor: JsonObject, processor: JsonObject,
                  tokenizer_config: JsonObject, generation: JsonObject) -> dict:
    """What the adapter needs from the folder's JSON files, checked, in one flat dict."""
    where = path / "preprocessor_config.json"
    size = preprocessor.object("size")
    height, width = size.side("height"), size.side("width")
    if preprocessor.flag("do_pan_and_scan", False):
        raise ModelError(f"{where}: do_pan_and_scan true is not supported (edgemm feeds the one square image)")
    for key in ("do_resize", "do_rescale", "do_normalize"):
        if not preprocessor.flag(key, True):
            raise ModelError(f"{where}: {key} false is not supported")
    resample = preprocessor.integer("resample", PIL_BILINEAR, least=0)
    if resample not in FILTER_NAMES:
        raise ModelError(f"{where}: resample {resample} is not supported "
                         f"({', '.join(f'{k} {v}' for k, v in FILTER_NAMES.items())})")
    # processor_config.json's image_seq_length, else config.json's mm_tokens_per_image
    seq_len = processor.integer("image_seq_length") if "image_seq_length" in processor \
        else config.integer("mm_tokens_per_image", 256)
    return {
        "height": height, "width": width, "resample": resample, "image_seq_len": seq_len,
        "image_tokens_from": ("processor_config.json: image_seq_length" if "image_seq_length" in processor
                              else "config.json: mm_tokens_per_image (256 if absent)"),
        **pixel_normalisation(preprocessor, [0.5] * 3, [0.5] * 3),
        **{key: special_token(tokenizer_config, key, value) for key, value in TOKEN_DEFAULTS.items()},
        "eos_token_ids": eos_token_ids(generation, config, config.object("text_config")),
    }


def read_hf_folder(path: Path, config: dict) -> FamilyFields:
    """This family's part of a Hugging Face folder's manifest (edgemm.model.hf_folder)."""
    cfg = family_config(path, config, read_json(path / "preprocessor_config.json"),
                        *optional_json(path, "processor_config.json", "tokenizer_config.json",
                                       "generation_config.json"))
    return FamilyFields.normalised(cfg, "stretch", one_tier(cfg["height"], cfg["width"], cfg["image_seq_len"]),
                                   cfg["image_token"], [END_OF_TURN])


def expand_image(cfg: dict) -> str:
    """The text that replaces one `<start_of_image>`, exactly as Gemma3Processor writes it."""
    return f"\n\n{cfg['boi_token']}{cfg['image_token'] * cfg['image_seq_len']}{cfg['eoi_token']}\n\n"


@register("gemma3", hf_folder=read_hf_folder)
class Gemma3Adapter(TokenizedFamily):
    """Prompt building and pixels for Gemma 3 folders (see the module docstring)."""

    known_prompts: tuple[str, ...] = ()  # an open vocabulary: any text reads
    # the prefix up to the last soft token never sees the question (the module docstring)
    reuses_image_prefix = True

    def __init__(self, manifest: ModelManifest):
        super().__init__(manifest)
        self.image_id = self.id_of(self.cfg["image_token"])
        for key in ("boi_token", "eoi_token"):
            self.id_of(self.cfg[key])
        self.stop_ids = {self.id_of(END_OF_TURN), *self.cfg["eos_token_ids"]}
        self.template = ChatTemplate.compile(manifest.chat_template or "", manifest.chat_template_file or manifest.path)
        # one square image at preprocessor_config.json's size: an encoder sized otherwise is refused at load
        self.graph_inputs = GraphInputs(pixel_values=(None, 3, self.cfg["height"], self.cfg["width"]),
                                        pixel_values_from="preprocessor_config.json: 3 channels x size")

    def pixels(self, rgb: np.ndarray, tier: ResolutionTier) -> np.ndarray:
        """RGB8 → float32 [1, 3, H, W]: the whole image stretched to the tier's size."""
        image = resize_pil(rgb, tier.height, tier.width, self.cfg["resample"])
        return rescale_normalize(image, self.cfg["rescale_factor"], self.cfg["image_mean"], self.cfg["image_std"])

    def chat_text(self, prompt: str) -> str:
        """The chat template around one image and the user's text, ready for the answer."""
        boi = self.cfg["boi_token"]
        return self.template.one_image(prompt, boi, reserved=(boi, self.cfg["image_token"], self.cfg["eoi_token"]),
                                       bos_token=self.cfg["bos_token"])

    def build_prompt(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int] | None = None) -> Prompt:
        """Input ids with the image expanded; `image_size` is unused (one square image)."""
        text = self.chat_text(prompt).replace(self.cfg["boi_token"], expand_image(self.cfg))
        # as the processor's apply_chat_template: no second <bos> when the template wrote one
        special = not text.startswith(self.cfg["bos_token"])
        ids = np.asarray([self.tokenizer.encode(text, add_special_tokens=special).ids], np.int64)
        positions = np.flatnonzero(ids[0] == self.image_id)
        return Prompt(ids, int(positions[0]), len(positions), (), positions)
