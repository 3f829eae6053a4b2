"""The idefics3 family (SmolVLM): tiled images, chat template, image-token expansion.

One image becomes rows x cols tiles plus a global image (edgemm.model.tiling);
each tile is `image_seq_len` encoder tokens. The prompt is the folder's chat
template with the user's text after one `<image>`, and that `<image>` expands as
Idefics3Processor expands it:

    <fake_token_around_image><row_1_col_1><image>*n ... <fake_token_around_image><row_1_col_C><image>*n \\n
    ...                                                                  (one line per tile row)
    \\n<fake_token_around_image><global-img><image>*n<fake_token_around_image>

(a single tile is just the last line, without the newline). The encoder's output,
tile by tile, fills the `<image>` positions in order.

Resolution tiers turn the longest edge the image is resized to: `global` (one
tile), `2x2`, up to the model's `size.longest_edge` (e.g. `4x4` for SmolVLM).

Registered for the model types `idefics3` and `smolvlm` (SmolVLM2's config.json says
"smolvlm"); its folders are Hugging Face folders, read by `read_hf_folder`.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from edgemm.errors import ModelError
from edgemm.model.chat_template import ChatTemplate
from edgemm.model.family import FamilyFields, GraphInputs, Prompt, TokenizedFamily, register
from edgemm.model.hf_folder import JsonObject, eos_token_ids, optional_json, pixel_normalisation, read_json
from edgemm.model.manifest_types import ModelManifest, ResolutionTier
from edgemm.model.tiling import tile_layout, tile_pixels

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
PIL_LANCZOS = 1  # preprocessor_config.json "resample": the only filter implemented (as SmolVLM uses)


def family_config(path: Path, config: JsonObject, preprocessor: JsonObject, processor: JsonObject,
                  generation: JsonObject) -> dict:
    """What the adapter needs from the folder's JSON files, checked, in one flat dict."""
    where = path / "preprocessor_config.json"
    if not preprocessor.flag("do_image_splitting", True):
        raise ModelError(f"{where}: do_image_splitting false is not supported (edgemm tiles as SmolVLM does)")
    if preprocessor.get("resample", PIL_LANCZOS) != PIL_LANCZOS:
        raise ModelError(f"{where}: resample {preprocessor['resample']} is not supported (only 1, Lanczos)")
    if "image_seq_len" in processor:
        seq_len = processor.integer("image_seq_len")
    else:  # as the processor computes it: patches per tile over the pixel shuffle
        vision = config.object("vision_config")
        patches = vision.side("image_size", 512) // vision.side("patch_size", 16)
        seq_len = patches ** 2 // config.integer("scale_factor", 2) ** 2
    return {
        "tile": preprocessor.object("max_image_size").side("longest_edge"),
        "longest_edge": preprocessor.object("size").side("longest_edge"), "image_seq_len": seq_len,
        "image_tokens_from": f"image_seq_len {seq_len} per tile: " + (
            "processor_config.json" if "image_seq_len" in processor
            else "config.json: (vision_config.image_size / patch_size)² / scale_factor²"),
        **pixel_normalisation(preprocessor, [0.5] * 3, [0.5] * 3),
        "eos_token_ids": eos_token_ids(generation),
    }


def tiers(cfg: dict) -> dict[str, ResolutionTier]:
    """Cheapest first: the global image only, 2x2 tiles, then the configured maximum."""
    tile, top, seq_len = cfg["tile"], cfg["longest_edge"], cfg["image_seq_len"]
    most = math.ceil(top / tile)
    out = {"global": ResolutionTier("global", tile, tile, seq_len)}
    for n in sorted({min(2, most), most} - {1}):
        edge = top if n == most else n * tile
        out[f"{n}x{n}"] = ResolutionTier(f"{n}x{n}", edge, edge, (n * n + 1) * seq_len)
    return out


def read_hf_folder(path: Path, config: dict) -> FamilyFields:
    """This family's part of a Hugging Face folder's manifest (edgemm.model.hf_folder)."""
    cfg = family_config(path, config, read_json(path / "preprocessor_config.json"),
                        *optional_json(path, "processor_config.json", "generation_config.json"))
    return FamilyFields.normalised(cfg, "tiles", tiers(cfg), IMAGE_TOKEN, [END_OF_UTTERANCE])


def expand_image(rows: int, cols: int, seq_len: int) -> str:
    """The text that replaces one `<image>`, exactly as Idefics3Processor writes it."""
    tokens = IMAGE_TOKEN * seq_len
    global_image = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{tokens}{FAKE_TOKEN}"
    if rows == 0:
        return global_image
    lines = "".join("".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
                    for r in range(rows))
    return f"{lines}\n{global_image}"


@register("idefics3", "smolvlm", hf_folder=read_hf_folder)
class Idefics3Adapter(TokenizedFamily):
    """Prompt building and pixels for Idefics3 / SmolVLM folders (see the module docstring)."""

    known_prompts: tuple[str, ...] = ()  # an open vocabulary (byte-level BPE): any text reads

    def __init__(self, manifest: ModelManifest):
        super().__init__(manifest)
        self.image_id = self.id_of(IMAGE_TOKEN)
        for token in (FAKE_TOKEN, GLOBAL_TOKEN, END_OF_UTTERANCE):
            self.id_of(token)
        self.stop_ids = {self.id_of(END_OF_UTTERANCE), *self.cfg["eos_token_ids"]}
        self.template = ChatTemplate.compile(manifest.chat_template or "", manifest.chat_template_file or manifest.path)
        tile = self.cfg["tile"]  # [batch, tiles, 3, tile, tile]: the tile's side is the encoder's
        self.graph_inputs = GraphInputs(pixel_values=(None, None, 3, tile, tile),
                                        pixel_values_from="preprocessor_config.json: 3 channels x max_image_size")

    def pixels(self, rgb: np.ndarray, tier: ResolutionTier) -> np.ndarray:
        """RGB8 → float32 [1, tiles, 3, tile, tile] at this tier's longest edge."""
        x, _ = tile_pixels(rgb, tier.height, self.cfg["tile"], self.cfg["rescale_factor"],
                           self.cfg["image_mean"], self.cfg["image_std"])
        return x[None]

    def chat_text(self, prompt: str) -> str:
        """The chat template around one image and the user's text, ready for the answer."""
        return self.template.one_image(prompt, IMAGE_TOKEN, reserved=(IMAGE_TOKEN,))

    def build_prompt(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int] | None = None) -> Prompt:
        """Input ids with the image expanded for an image of `image_size` (h, w) at `tier`."""
        height, width = image_size or (tier.height, tier.width)
        layout = tile_layout(height, width, tier.height, self.cfg["tile"])
        expanded = expand_image(layout.rows, layout.cols, self.cfg["image_seq_len"])
        text = self.chat_text(prompt).replace(IMAGE_TOKEN, expanded)
        ids = np.asarray([self.tokenizer.encode(text).ids], np.int64)
        positions = np.flatnonzero(ids[0] == self.image_id)
        return Prompt(ids, int(positions[0]), len(positions), (), positions)
