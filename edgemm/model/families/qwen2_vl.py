"""The Qwen2-VL / Qwen2.5-VL family: native resolution under a pixel budget, 3-D rotary positions.

An image is taken at its own aspect ratio: resized to multiples of 28 (patch 14, merged
2x2) with its pixel count between `min_pixels` and the tier's budget, exactly as
transformers' Qwen2VLImageProcessor's smart_resize (Pillow bicubic, edgemm.model.resample).
Its patches are flattened as the processor flattens them (3 channels x 2 temporal copies
x 14 x 14 = 1176 values per patch); Family.pixels returns them as

    [1, grid_h / 2, grid_w / 2, 4, 1176]   (merge units row-major, the 2x2 patches of each)

so the grid is in the shape: images of one shape batch together (the pipeline batches by
pixel shape), and `encoder_feeds` hands the encoder the flat [N, 1176] and its grid
(`grid_thw` for Qwen2-VL, `image_grid_thw` for Qwen2.5-VL, as transformers.js feeds
onnx-community's exports). The encoder returns [N / 4, D]: one token per merge unit.

The prompt is the folder's chat template with `<|vision_start|><|image_pad|><|vision_end|>`,
the pad expanded to one per image token. Positions are M-RoPE (transformers'
`get_rope_index`): text counts up on all three axes; the image's tokens share the
temporal position and count rows and columns from where the text stopped; the text after
resumes at that start plus max(rows, cols). Decode steps then use (tokens so far + delta)
on every axis, the delta being the prompt's last position + 1 - its length.

Tiers are pixel budgets, named `{tokens}x28x28`: the top is the folder's max_pixels, at
most TOP_TOKENS image tokens, and two cheaper ones at a half and a quarter of it (not
below min_pixels). The scheduler picks one per frame; the number of image tokens then
depends on the image's aspect ratio. It is at most the tier's, except for elongated images:
smart_resize keeps at least one unit (28 px) on the short side, so a 200:1 image at a
64-token budget gets 1x113 tokens, and rounds up when it grows a small one to min_pixels
(1x199 px at 16 gets 29). `most_image_tokens` bounds it over every aspect ratio taken
(up to MAX_ASPECT), and the GPU engine profile is sized by it (`encoder_patches`).

Qwen2.5-VL's vision tower differs (RMSNorm, SwiGLU, windowed attention in most blocks),
but all of that is inside the vision_encoder graph: what the runtime feeds and reads is
the same, but for the grid input's name.
"""
from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
from edgemm.errors import InputError, ModelError
from edgemm.model.chat_template import ChatTemplate
from edgemm.model.family import EncoderPatches, FamilyFields, GraphInputs, Prompt, TokenizedFamily, register
from edgemm.model.hf_folder import (MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE, JsonObject, eos_token_ids, optional_json,
                                    pixel_normalisation, read_json)
from edgemm.model.manifest_types import ModelManifest, ResolutionTier
from edgemm.model.resample import resize_bicubic

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IM_END = "<|im_end|>"
VISION_TOKENS = (IMAGE_PAD, VISION_START, VISION_END, "<|video_pad|>", "<|vision_pad|>")
PIL_BICUBIC = 3  # preprocessor_config.json "resample": the filter Qwen2-VL's processor uses
TOP_TOKENS = 1024  # the richest tier's image tokens at most: a 2B model on an Orin at ~1 s per frame
GRID_INPUT = {"qwen2_vl": "grid_thw", "qwen2_5_vl": "image_grid_thw"}  # as transformers.js names them
MAX_ASPECT = 200  # transformers' smart_resize refuses images more elongated than this
MOST_TEMPORAL = 16  # temporal_patch_size at most: each copy multiplies the patch values
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w): multiples of `factor`, min_pixels ≤ h·w ≤ max_pixels, the aspect ratio kept as
    closely as that allows; transformers' qwen2_vl smart_resize, operation for operation."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InputError(f"image is {width}x{height}: Qwen2-VL takes aspect ratios up to {MAX_ASPECT}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _ceil_sqrt(x: Fraction) -> int:
    """⌈√x⌉ of a positive rational, exactly."""
    return math.isqrt(math.ceil(x) - 1) + 1


def most_image_tokens(cfg: dict, tokens: int) -> int:
    """The most image tokens smart_resize gives any image of aspect ratio up to MAX_ASPECT at a
    budget of `tokens` (Qwen2VLAdapter.resized's min and max pixels), in exact arithmetic.

    The result depends only on the aspect ratio r ≥ 1, in units of (patch · merge) pixels:
    rounded to the nearest units, it is within the budget; shrunk under the budget T it is
    max(1, ⌊√(T/r)⌋) · ⌊√(T·r)⌋, at most T, or ⌊√(T·r)⌋ once the short side is held at one
    unit; grown to min_pixels (m units) it is ⌈√(m/r)⌉ · ⌈√(m·r)⌉, the most of which, for
    each value j of the first factor, is at the largest r that keeps it."""
    unit = cfg["patch_size"] * cfg["merge_size"]
    most = max(tokens, math.isqrt(MAX_ASPECT * tokens))
    m = Fraction(min(cfg["min_pixels"], tokens * unit * unit), unit * unit)
    for j in range(1, _ceil_sqrt(m) + 1):  # ⌈√(m/r)⌉ = j for r in [m/j², m/(j-1)²)
        low = max(Fraction(1), m / (j * j))
        high = Fraction(MAX_ASPECT) if j == 1 else min(Fraction(MAX_ASPECT), m / (j - 1) ** 2)
        if low <= high:
            most = max(most, j * _ceil_sqrt(m * high))
    return most


def family_config(path: Path, config: JsonObject, preprocessor: JsonObject, generation: JsonObject) -> dict:
    """What the adapter needs from the folder's JSON files, checked, in one flat dict."""
    where = path / "preprocessor_config.json"
    size = preprocessor.object("size")
    patch = preprocessor.integer("patch_size", 14, most=MAX_IMAGE_SIDE)
    merge = preprocessor.integer("merge_size", 2, most=MAX_IMAGE_SIDE // patch)
    # a still image is copied temporal_patch_size times into every patch: 2 in Qwen2-VL and 2.5
    temporal = preprocessor.integer("temporal_patch_size", 2, most=MOST_TEMPORAL)
    # the budgets the resize works within: at most the pixels of a 4096 px square (hf_folder)
    min_pixels = preprocessor.integer("min_pixels", size.integer("shortest_edge", 56 * 56, most=MAX_IMAGE_PIXELS),
                                      most=MAX_IMAGE_PIXELS)
    max_pixels = preprocessor.integer("max_pixels", size.integer("longest_edge", 28 * 28 * 1280,
                                                                 most=MAX_IMAGE_PIXELS), most=MAX_IMAGE_PIXELS)
    if min_pixels > max_pixels:
        raise ModelError(f"{where}: min_pixels {min_pixels} is above max_pixels {max_pixels}")
    if max_pixels < (patch * merge) ** 2:
        raise ModelError(f"{where}: max_pixels {max_pixels} is less than one image token "
                         f"({patch * merge}x{patch * merge} px)")
    if preprocessor.get("resample", PIL_BICUBIC) != PIL_BICUBIC:
        raise ModelError(f"{where}: resample {preprocessor['resample']} is not supported (only 3, bicubic)")
    vision = config.object("vision_config")
    if vision.integer("spatial_merge_size", merge) != merge:
        raise ModelError(f"{path / 'config.json'}: vision_config.spatial_merge_size "
                         f"{vision['spatial_merge_size']} differs from the processor's merge_size {merge}")
    return {
        "model_type": config["model_type"], "grid_input": GRID_INPUT[config["model_type"]],
        "patch_size": patch, "merge_size": merge, "temporal_patch_size": temporal,
        "image_tokens_from": f"one per {merge}x{merge} patches of {patch} px (preprocessor_config.json: "
                             "merge_size, patch_size), the image resized within the tier's budget",
        "min_pixels": min_pixels, "max_pixels": max_pixels,
        **pixel_normalisation(preprocessor, list(OPENAI_CLIP_MEAN), list(OPENAI_CLIP_STD)),
        "eos_token_ids": eos_token_ids(generation, config),
    }


def tiers(cfg: dict) -> dict[str, ResolutionTier]:
    """Pixel budgets, cheapest first: a quarter, a half and all of the top budget (see the module
    docstring). A tier's height and width are those a large square image gets at its budget."""
    unit = cfg["patch_size"] * cfg["merge_size"]
    top = min(cfg["max_pixels"] // (unit * unit), TOP_TOKENS)
    least = math.ceil(cfg["min_pixels"] / (unit * unit))
    budgets = sorted({max(top // 4, least), max(top // 2, least), top})
    out = {}
    for tokens in budgets:
        side, _ = smart_resize(1 << 16, 1 << 16, unit, cfg["min_pixels"], tokens * unit * unit)
        out[f"{tokens}x{unit}x{unit}"] = ResolutionTier(f"{tokens}x{unit}x{unit}", side, side, tokens)
    return out


def read_hf_folder(path: Path, config: dict) -> FamilyFields:
    """This family's part of a Hugging Face folder's manifest (edgemm.model.hf_folder)."""
    cfg = family_config(path, config, read_json(path / "preprocessor_config.json"),
                        *optional_json(path, "generation_config.json"))
    return FamilyFields.normalised(cfg, "smart_resize", tiers(cfg), IMAGE_PAD, [IM_END])


def rope_positions(input_ids: np.ndarray, image_id: int, grid_h: int, grid_w: int) -> tuple[np.ndarray, int]:
    """M-RoPE position ids [3, 1, S] of a prompt with one image of (grid_h, grid_w) merged
    tokens, and its rope delta: transformers' get_rope_index for one image and text."""
    ids = input_ids[0]
    start = int(np.argmax(ids == image_id))  # the image's first token: the text before it counts 0 … start-1
    count = grid_h * grid_w
    after = len(ids) - start - count
    resume = start + max(grid_h, grid_w)  # where the text after the image goes on
    rows, cols = np.divmod(np.arange(count), grid_w)
    positions = np.empty((3, len(ids)), np.int64)
    positions[:, :start] = np.arange(start)
    positions[0, start:start + count] = start
    positions[1, start:start + count] = start + rows
    positions[2, start:start + count] = start + cols
    positions[:, start + count:] = resume + np.arange(after)
    last = resume + after - 1 if after else start + max(grid_h, grid_w) - 1
    return positions[:, None, :], int(last + 1 - len(ids))


@register("qwen2_vl", "qwen2_5_vl", hf_folder=read_hf_folder)
class Qwen2VLAdapter(TokenizedFamily):
    """Prompt building, pixels and positions for Qwen2-VL / Qwen2.5-VL folders (see the module docstring)."""

    known_prompts: tuple[str, ...] = ()  # an open vocabulary (byte-level BPE): any text reads
    static_shapes = False  # every image at its tier's square grid (use_static_shapes), not its own

    def __init__(self, manifest: ModelManifest):
        super().__init__(manifest)
        self.image_id = self.id_of(IMAGE_PAD)
        for token in (VISION_START, VISION_END):
            self.id_of(token)
        self.stop_ids = {self.id_of(IM_END), *self.cfg["eos_token_ids"]}
        self.template = ChatTemplate.compile(manifest.chat_template or "", manifest.chat_template_file or manifest.path)
        self.unit = self.cfg["patch_size"] * self.cfg["merge_size"]
        patch, temporal = self.cfg["patch_size"], self.cfg["temporal_patch_size"]
        self.graph_inputs = GraphInputs(encoder=(self.cfg["grid_input"],), position_axes=3,
                                        encoder_feeds=self.encoder_feeds,
                                        split_encoder_feeds=self.split_encoder_feeds,
                                        # a flat row per patch: what the encoder's first layer is sized for
                                        pixel_values=(None, 3 * temporal * patch * patch),
                                        pixel_values_from=f"preprocessor_config.json: 3 channels x temporal_patch_size "
                                                          f"{temporal} x patch_size {patch}²")

    def use_static_shapes(self) -> None:
        """From now on every image is resized to its tier's square (tier.height x tier.width), the
        one grid a static (DLA) encoder plan takes, instead of keeping its aspect ratio."""
        self.static_shapes = True

    @staticmethod
    def encoder_patches(manifest: ModelManifest, tier: ResolutionTier) -> EncoderPatches:
        """The patch rows one image makes at `tier`, what the engine builder sizes the encoder's
        profiles by: merge² per image token, up to most_image_tokens' for an elongated image,
        and the tier's square grid for a static plan (use_static_shapes)."""
        cfg = manifest.family_config
        patch, per_token = cfg["patch_size"], cfg["merge_size"] * cfg["merge_size"]
        return EncoderPatches(least=per_token, budget=tier.image_tokens * per_token,
                              most=most_image_tokens(cfg, tier.image_tokens) * per_token,
                              square=(tier.height // patch) * (tier.width // patch))

    def resized(self, height: int, width: int, tier: ResolutionTier) -> tuple[int, int]:
        """The size an image of (height, width) is resized to at `tier`'s pixel budget."""
        if self.static_shapes:
            return tier.height, tier.width
        return smart_resize(height, width, self.unit, min(self.cfg["min_pixels"], tier.image_tokens * self.unit ** 2),
                            tier.image_tokens * self.unit ** 2)

    def pixels(self, rgb: np.ndarray, tier: ResolutionTier) -> np.ndarray:
        """RGB8 → float32 [1, grid_h/2, grid_w/2, 4, 1176]: the processor's patches, grid in the shape."""
        height, width = self.resized(rgb.shape[0], rgb.shape[1], tier)
        image = resize_bicubic(rgb, height, width).transpose(2, 0, 1)  # [3, H, W]
        # as transformers: rescale in float64, store float32, normalise in float32
        x = (image.astype(np.float64) * self.cfg["rescale_factor"]).astype(np.float32)
        x = (x - np.asarray(self.cfg["image_mean"], np.float32)[:, None, None]) / \
            np.asarray(self.cfg["image_std"], np.float32)[:, None, None]
        patch, merge, temporal = self.cfg["patch_size"], self.cfg["merge_size"], self.cfg["temporal_patch_size"]
        rows, cols = height // patch // merge, width // patch // merge
        x = x.reshape(3, rows, merge, patch, cols, merge, patch).transpose(1, 4, 2, 5, 0, 3, 6)
        # (rows, cols, merge, merge, C, patch, patch) → the temporal copies next to C, as the processor lays them
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))
        return np.ascontiguousarray(x.reshape(1, rows, cols, merge * merge, -1))

    def encoder_feeds(self, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
        """Images of one shape [B, rows, cols, merge², patch values] → the encoder's flat
        pixel_values [B·N, patch values] and its grid [B, 3] (t, h, w in patches)."""
        batch, rows, cols = pixel_values.shape[:3]
        merge = self.cfg["merge_size"]
        grid = np.tile(np.array([[1, rows * merge, cols * merge]], np.int64), (batch, 1))
        return {"pixel_values": pixel_values.reshape(-1, pixel_values.shape[-1]), self.cfg["grid_input"]: grid}

    def split_encoder_feeds(self, feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The feeds of several images (encoder_feeds) → each image's own: one row of the grid,
        and its t·h·w patches of the flat pixel_values, in order."""
        grid_name = self.cfg["grid_input"]
        grid, patches = feeds[grid_name], feeds["pixel_values"]
        ends = np.cumsum(np.prod(grid, axis=1))
        if len(ends) and ends[-1] != len(patches):
            raise ValueError(f"{len(patches)} patches for a grid of {int(ends[-1])}")
        starts = np.concatenate([[0], ends[:-1]])
        return [{"pixel_values": patches[a:b], grid_name: grid[i:i + 1]}
                for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist()))]

    def chat_text(self, prompt: str) -> str:
        """The chat template around one image and the user's text, ready for the answer."""
        return self.template.one_image(prompt, IMAGE_PAD, reserved=VISION_TOKENS, reserved_name="vision token")

    def build_prompt(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int] | None = None) -> Prompt:
        """Input ids with the image pad expanded, and the M-RoPE positions, for an image of `image_size` (h, w)."""
        height, width = self.resized(*(image_size or (tier.height, tier.width)), tier)
        rows, cols = height // self.unit, width // self.unit
        text = self.chat_text(prompt).replace(IMAGE_PAD, IMAGE_PAD * (rows * cols))
        ids = np.asarray([self.tokenizer.encode(text).ids], np.int64)
        image = np.flatnonzero(ids[0] == self.image_id)
        if len(image) != rows * cols or image[-1] - image[0] + 1 != len(image):
            raise ModelError(f"{self.manifest.path}: the tokenizer split the image pads ({len(image)} for "
                             f"{rows * cols} image tokens)")
        positions, delta = rope_positions(ids, self.image_id, rows, cols)
        return Prompt(ids, int(image[0]), len(image), (), image, positions, delta)
