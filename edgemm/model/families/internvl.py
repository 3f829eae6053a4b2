"""The InternVL family (InternVL3 in transformers' `-hf` layout): dynamic tiles, chat template.

One image becomes a grid of tile x tile crops (448 x 448 for InternVL3) plus a
thumbnail, as transformers' InternVL processor cuts it (`GotOcr2ImageProcessor` with
`crop_to_patches`, which `InternVLProcessor` always passes):

    the grid (cols, rows) whose aspect ratio is closest to the image's, among those of
    min_patches..max_patches tiles (a tie goes to more tiles while the image's area is
    above half the grid's) → the image resized to cols*tile x rows*tile and cut row by
    row → then the whole image resized to one tile (the thumbnail), unless the grid is 1x1

Every resize is bicubic with antialiasing as torch computes it on uint8
(edgemm.model.resample_torch): that is the torchvision backend, which transformers picks
by default whenever torchvision is installed. (Its PIL backend, GotOcr2ImageProcessorPil,
rounds differently and is a grey level off here and there.) Then (x - 255 mean) / (255 std)
in float32, as that backend fuses rescale and normalise.

The prompt is the folder's chat template with `<IMG_CONTEXT>\\n` for the image, and that
`<IMG_CONTEXT>` expands as InternVLProcessor expands it:

    <img> <IMG_CONTEXT> x (image_seq_length * tiles) </img>

The encoder's output, tile by tile (the thumbnail last), fills those positions in order.

Resolution tiers are tile budgets, the processor's max_patches: `tiles1` (one tile, no
thumbnail), `tiles4`, `tiles6`, ... up to the folder's max_patches, each of N > 1 giving at
most N tiles + the thumbnail. The scheduler picks the budget; the image's aspect ratio
picks the grid within it.

Prefix reuse stays on: InternVL's decoder (Qwen2) attends causally over the image tokens
too, so an image prefix's KV cache does not depend on the question after it.

Registered for the model type `internvl` (config.json of OpenGVLab/InternVL3-*-hf).
There is no published ONNX export; tools/export_hf_vlm.py makes the folder from a
checkpoint.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
from edgemm.errors import ModelError
from edgemm.model.chat_template import ChatTemplate
from edgemm.model.family import FamilyFields, GraphInputs, Prompt, TokenizedFamily, register
from edgemm.model.hf_folder import (MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, JsonObject, eos_token_ids, optional_json,
                                    pixel_normalisation, read_json)
from edgemm.model.manifest_types import ModelManifest, ResolutionTier
from edgemm.model.resample_torch import resize_rows_of_planes

IMAGE_TOKEN = "<IMG_CONTEXT>"
START_IMAGE = "<img>"
END_IMAGE = "</img>"
END_OF_TURN = "<|im_end|>"
PIL_BICUBIC = 3  # preprocessor_config.json "resample": the filter InternVL3 uses, the only one here
TIER_BUDGETS = (1, 4, 6)  # tile budgets offered below the folder's max_patches (itself always a tier)
MOST_PATCHES = 64  # InternVL3 uses 12; the grid search is quadratic in max_patches, so a bound


def family_config(path: Path, config: JsonObject, preprocessor: JsonObject, processor: JsonObject,
                  generation: JsonObject) -> dict:
    """What the adapter needs from the folder's JSON files, checked, in one flat dict."""
    where = path / "preprocessor_config.json"
    size = preprocessor.object("size")
    tile = size.side("height")
    if size.get("width") != tile:
        raise ModelError(f"{where}: needs size.height and size.width, one positive integer (square tiles)")
    if preprocessor.get("resample", PIL_BICUBIC) != PIL_BICUBIC:
        raise ModelError(f"{where}: resample {preprocessor['resample']} is not supported (only 3, bicubic)")
    if not all(preprocessor.flag(key, True) for key in ("do_resize", "do_rescale", "do_normalize")):
        raise ModelError(f"{where}: do_resize, do_rescale and do_normalize must be on (as InternVL3 has them)")
    low, high = preprocessor.integer("min_patches", 1), preprocessor.integer("max_patches", 12)
    if not low <= high <= MOST_PATCHES:
        raise ModelError(f"{where}: min_patches and max_patches must be integers, "
                         f"1 <= min <= max <= {MOST_PATCHES}")
    if high * tile * tile > MAX_IMAGE_PIXELS:  # the canvas a grid of max_patches tiles is resized to
        raise ModelError(f"{where}: max_patches {high} tiles of {tile}x{tile} are more pixels than a "
                         f"{MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE} image")
    vision = config.object("vision_config")
    side, patch = (first_of_pair(vision, key, default) for key, default in (("image_size", 448), ("patch_size", 14)))
    expected = int((side // patch) ** 2 * config.number("downsample_ratio", 0.5, positive=True, most=1) ** 2)
    seq_len = processor.get("image_seq_length", config.get("image_seq_length", expected))
    if seq_len != expected:
        raise ModelError(f"{path}: image_seq_length {seq_len} does not match the vision config "
                         f"({side}/{patch} patches, downsample_ratio: {expected} tokens per tile)")
    return {
        "tile": tile, "min_patches": low, "max_patches": high, "image_seq_len": int(seq_len),
        "image_tokens_from": f"image_seq_length {seq_len} per tile: (vision_config.image_size / patch_size)² "
                             "x downsample_ratio² (config.json)",
        **pixel_normalisation(preprocessor, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        "eos_token_ids": eos_token_ids(generation, config.object("text_config")),
    }


def first_of_pair(vision: JsonObject, key: str, default: int) -> int:
    """vision_config's `key`: one integer, or a [height, width] pair of which InternVL uses the first."""
    value = vision.get(key)
    if isinstance(value, list) and value:
        return JsonObject({key: value[0]}, vision.file, vision.prefix).integer(key)
    return vision.integer(key, default)


def tile_count(budget: int) -> int:
    """Encoder images for a grid of `budget` tiles: the thumbnail joins any grid above one."""
    return budget + 1 if budget > 1 else 1


def tiers(cfg: dict) -> dict[str, ResolutionTier]:
    """Cheapest first: budgets 1, 4, 6 (those within min..max_patches), then max_patches."""
    low, high, tile = cfg["min_patches"], cfg["max_patches"], cfg["tile"]
    out = {}
    for budget in sorted({b for b in TIER_BUDGETS if low <= b < high} | {high}):
        side = max(1, math.isqrt(budget))  # a square image of this side uses the budget's square grid
        out[f"tiles{budget}"] = ResolutionTier(f"tiles{budget}", side * tile, side * tile,
                                               tile_count(budget) * cfg["image_seq_len"])
    return out


def read_hf_folder(path: Path, config: dict) -> FamilyFields:
    """This family's part of a Hugging Face folder's manifest (edgemm.model.hf_folder)."""
    cfg = family_config(path, config, read_json(path / "preprocessor_config.json"),
                        *optional_json(path, "processor_config.json", "generation_config.json"))
    return FamilyFields.normalised(cfg, "tiles", tiers(cfg), IMAGE_TOKEN, [END_OF_TURN])


@lru_cache(maxsize=16)
def _arrangements(low: int, high: int) -> tuple[tuple[int, int], ...]:
    """(cols, rows) of low..high tiles, fewest tiles first (get_all_supported_aspect_ratios)."""
    grids = [(w, h) for w in range(1, high + 1) for h in range(1, high + 1) if low <= w * h <= high]
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def tile_grid(height: int, width: int, tile: tuple[int, int], low: int, high: int) -> tuple[int, int]:
    """(cols, rows) for an image of height x width, as transformers' get_optimal_tiled_canvas."""
    aspect, area = width / height, width * height
    best_diff, best = float("inf"), (1, 1)
    for grid in _arrangements(low, high):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile[0] * tile[1] * grid[0] * grid[1]:
            best = grid  # a tie: more tiles, while they cover no more than twice the image
    return best


def normalisation(mean, std, rescale: float) -> tuple[np.ndarray, np.ndarray]:
    """torchvision's fused rescale + normalise: float32 mean and std, each times 1/rescale."""
    scale = np.float32(1 / rescale)
    return ((np.asarray(mean, np.float32) * scale)[None, :, None, None],
            (np.asarray(std, np.float32) * scale)[None, :, None, None])


def tile_pixels(rgb: np.ndarray, grid: tuple[int, int], tile: int, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """RGB8 → float32 [1, tiles, 3, tile, tile] for a (cols, rows) grid, as GotOcr2ImageProcessor
    crops: the image resized to the grid and cut row by row, then the thumbnail (if more than one).

    One resize makes every tile of the grid; the tiles are normalised straight from its
    (rows, channels, columns) layout into the encoder's array, (x - mean) / std in float32
    as torchvision computes it, with no stacked uint8 or float32 copy in between."""
    cols, rows = grid
    count = tile_count(cols * rows)
    out = np.empty((1, count, 3, tile, tile), np.float32)
    canvas = resize_rows_of_planes(rgb, rows * tile, cols * tile)  # (rows*tile, 3, cols*tile)
    crops = [canvas[r * tile:(r + 1) * tile, :, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
    if count > 1:
        crops.append(resize_rows_of_planes(rgb, tile, tile))
    for into, crop in zip(out[0], crops):
        np.subtract(crop.transpose(1, 0, 2), mean[0], out=into)  # uint8 - float32 computes in float32
    np.divide(out, std, out=out)
    return out


def expand_image(tiles: int, seq_len: int) -> str:
    """The text that replaces one `<IMG_CONTEXT>`, exactly as InternVLProcessor writes it."""
    return f"{START_IMAGE}{IMAGE_TOKEN * (seq_len * tiles)}{END_IMAGE}"


@register("internvl", hf_folder=read_hf_folder)
class InternVLAdapter(TokenizedFamily):
    """Prompt building and pixels for InternVL3 -hf folders (see the module docstring)."""

    known_prompts: tuple[str, ...] = ()  # an open vocabulary (byte-level BPE): any text reads

    def __init__(self, manifest: ModelManifest):
        super().__init__(manifest)
        self.image_id = self.id_of(IMAGE_TOKEN)
        for token in (START_IMAGE, END_IMAGE):
            self.id_of(token)
        self.stop_ids = {self.id_of(END_OF_TURN), *self.cfg["eos_token_ids"]}
        self.template = ChatTemplate.compile(manifest.chat_template or "", manifest.chat_template_file or manifest.path)
        self._normalise = normalisation(self.cfg["image_mean"], self.cfg["image_std"], self.cfg["rescale_factor"])
        tile = self.cfg["tile"]  # [batch, tiles, 3, tile, tile]: the tile's side is the encoder's
        self.graph_inputs = GraphInputs(pixel_values=(None, None, 3, tile, tile),
                                        pixel_values_from="preprocessor_config.json: 3 channels x size")

    def budget(self, tier: ResolutionTier) -> int:
        """The tier's max_patches (tier names are `tiles<N>`)."""
        return int(tier.name.removeprefix("tiles"))

    def grid(self, height: int, width: int, tier: ResolutionTier) -> tuple[int, int]:
        budget = self.budget(tier)
        tile = self.cfg["tile"]
        return tile_grid(height, width, (tile, tile), min(self.cfg["min_patches"], budget), budget)

    def pixels(self, rgb: np.ndarray, tier: ResolutionTier) -> np.ndarray:
        """RGB8 → float32 [1, tiles, 3, tile, tile]: the grid's tiles row by row, then the thumbnail."""
        grid = self.grid(rgb.shape[0], rgb.shape[1], tier)
        return tile_pixels(rgb, grid, self.cfg["tile"], *self._normalise)

    def chat_text(self, prompt: str) -> str:
        """The chat template around one image and the user's text, ready for the answer."""
        return self.template.one_image(prompt, IMAGE_TOKEN, reserved=(IMAGE_TOKEN, START_IMAGE, END_IMAGE))

    def build_prompt(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int] | None = None) -> Prompt:
        """Input ids with the image expanded for an image of `image_size` (h, w) at `tier`."""
        height, width = image_size or (tier.height, tier.width)
        cols, rows = self.grid(height, width, tier)
        expanded = expand_image(tile_count(cols * rows), self.cfg["image_seq_len"])
        text = self.chat_text(prompt).replace(IMAGE_TOKEN, expanded)
        ids = np.asarray([self.tokenizer.encode(text).ids], np.int64)
        positions = np.flatnonzero(ids[0] == self.image_id)
        return Prompt(ids, int(positions[0]), len(positions), (), positions)
