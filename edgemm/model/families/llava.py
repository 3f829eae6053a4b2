"""The llava family (LLaVA-1.5, and FastVLM as `llava_qwen2` or `fast_vlm`): one image, one `<image>` expanded to N.

The image goes through the CLIP image processor's steps as the folder's
preprocessor_config.json sets them, each as transformers' PIL backend does it: pad to a
square in the mean colour (`do_pad`, LlavaImageProcessor only), resize (shortest edge,
or height and width) with Pillow's filter of `resample`, centre crop, rescale,
normalise. One resolution tier: the crop (336x336 for LLaVA-1.5, 1024x1024 for FastVLM).

The prompt is the folder's chat template around one image and the user's text; its
one `<image>` expands to N copies, as LlavaProcessor (and transformers.js's) expands it:

    N = (crop height // patch_size) * (crop width // patch_size) + num_additional_image_tokens
        - 1 if vision_feature_select_strategy is "default" (the CLS token dropped)

read from processor_config.json (LLaVA-1.5: 24 * 24 + 1 - 1 = 576; FastVLM: patch_size
64, 16 * 16 = 256). The encoder's N output tokens fill the `<image>` positions in order.

LLaVA-OneVision / LLaVA-NeXT (anyres: a grid of crops chosen per image, then unpadding
and newline tokens per row) are out: their model types are not registered here.
The decoder is causal, so the image prefix is reused for a second question
(`reuses_image_prefix`).

Registered for the model types `llava`, `llava_qwen2` (FastVLM's config.json, as
transformers.js keys it: LlavaQwen2ForCausalLM is its LlavaForConditionalGeneration) and
`fast_vlm` (transformers' FastVlmForConditionalGeneration, whose timm FastViT-HD tower's last
feature map, stride 64, is the N tokens, strategy "full"); its folders are Hugging Face folders.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from edgemm.errors import InputError, ModelError
from edgemm.model.chat_template import ChatTemplate
from edgemm.model.family import FamilyFields, GraphInputs, Prompt, TokenizedFamily, one_tier, register
from edgemm.model.hf_folder import (JsonObject, eos_token_ids, optional_json, pixel_normalisation, read_json,
                                    special_token)
from edgemm.model.image import DEFAULT_MAX_PIXELS
from edgemm.model.manifest_types import ModelManifest, ResolutionTier
from edgemm.model.preprocess import rescale_normalize
from edgemm.model.resample import FILTER_NAMES, resize_pil

IMAGE_TOKEN = "<image>"
MAX_PADDED_PIXELS = DEFAULT_MAX_PIXELS  # do_pad's square: no bigger than the largest image accepted
PIL_BICUBIC = 3  # the CLIP image processor's default filter
# transformers' {% generation %} marks the assistant's text for training masks; it renders nothing
GENERATION_TAG = re.compile(r"{%-?\s*(end)?generation\s*-?%}")


def family_config(path: Path, config: JsonObject, preprocessor: JsonObject, processor: JsonObject,
                  tokenizer_config: JsonObject, generation: JsonObject) -> dict:
    """What the adapter needs from the folder's JSON files, checked, in one flat dict."""
    where = path / "preprocessor_config.json"
    size = preprocessor.object("size")
    if "shortest_edge" in size:
        resize = {"shortest_edge": size.side("shortest_edge")}
    elif "height" in size or "width" in size:
        resize = {"height": size.side("height"), "width": size.side("width")}
    else:
        raise ModelError(f"{where}: needs size.shortest_edge, or size.height and size.width (positive integers)")
    crop = preprocessor.object("crop_size")
    do_center_crop = preprocessor.flag("do_center_crop", True)
    if do_center_crop:
        out_h, out_w = crop.side("height"), crop.side("width")
    elif "height" in resize:
        out_h, out_w = resize["height"], resize["width"]
    else:
        raise ModelError(f"{where}: do_center_crop false with size.shortest_edge gives images of "
                         "varying size, which this family does not feed")
    if not preprocessor.flag("do_resize", True):
        raise ModelError(f"{where}: do_resize false is not supported")
    resample = preprocessor.integer("resample", PIL_BICUBIC, least=0)
    if resample not in FILTER_NAMES:
        raise ModelError(f"{where}: resample {resample} is not supported "
                         f"({', '.join(f'{k} {v}' for k, v in FILTER_NAMES.items())})")

    # the image token count, as LlavaProcessor computes it (processor_config.json; config.json's
    # vision tower and strategy where the processor leaves them out)
    vision = config.object("vision_config")
    if "patch_size" not in processor and "patch_size" not in vision:
        raise ModelError(f"{path / 'processor_config.json'}: needs patch_size, a positive integer "
                         "(the image tokens per side are the crop over it)")
    patch = (processor if "patch_size" in processor else vision).integer("patch_size")
    strategy_from = "processor_config.json" if "vision_feature_select_strategy" in processor else "config.json"
    strategy = processor.get("vision_feature_select_strategy", config.get("vision_feature_select_strategy"))
    extra = processor.integer("num_additional_image_tokens", 0, least=0)
    tokens = (out_h // patch) * (out_w // patch) + extra
    tokens -= 1 if strategy == "default" else 0
    extra_from = "processor_config.json" if "num_additional_image_tokens" in processor else \
        "absent from processor_config.json"
    tokens_from = (f"({out_h}/{patch})x({out_w}/{patch}) patches (crop_size / patch_size) + "
                   f"num_additional_image_tokens {extra} ({extra_from}) " +
                   (f"- 1 for vision_feature_select_strategy 'default' ({strategy_from})" if strategy == "default"
                    else f"with vision_feature_select_strategy {strategy!r} ({strategy_from})"))
    if tokens <= 0:
        raise ModelError(f"{path}: the image gives {tokens} image tokens (crop {out_h}x{out_w}, patch {patch})")
    do_rescale = preprocessor.flag("do_rescale", True)
    image_token = processor.string("image_token", special_token(tokenizer_config, "image_token", IMAGE_TOKEN))
    return {
        "resize": resize, "do_center_crop": do_center_crop,
        "height": out_h, "width": out_w, "resample": resample, "image_tokens": tokens,
        "image_tokens_from": tokens_from,
        "do_pad": preprocessor.flag("do_pad", False),
        "do_rescale": do_rescale,
        "do_normalize": preprocessor.flag("do_normalize", True),
        **pixel_normalisation(preprocessor, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711],
                              rescaled=do_rescale),
        "image_token": image_token, "bos_token": special_token(tokenizer_config, "bos_token", ""),
        "eos_token": special_token(tokenizer_config, "eos_token", ""),
        "eos_token_ids": eos_token_ids(generation, config, config.object("text_config")),
    }


def read_hf_folder(path: Path, config: dict) -> FamilyFields:
    """This family's part of a Hugging Face folder's manifest (edgemm.model.hf_folder)."""
    cfg = family_config(path, config, read_json(path / "preprocessor_config.json"),
                        *optional_json(path, "processor_config.json", "tokenizer_config.json",
                                       "generation_config.json"))
    stop = [cfg["eos_token"]] if cfg["eos_token"] else []
    return FamilyFields.normalised(cfg, "crop", one_tier(cfg["height"], cfg["width"], cfg["image_tokens"]),
                                   cfg["image_token"], stop)


def resized_size(height: int, width: int, resize: dict) -> tuple[int, int]:
    """The (h, w) transformers resizes to: get_resize_output_image_size for a shortest edge
    (the long side truncated, as int() does), else the size itself."""
    if "shortest_edge" not in resize:
        return resize["height"], resize["width"]
    short, long = sorted((height, width))
    new_short, new_long = resize["shortest_edge"], int(resize["shortest_edge"] * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def pad_to_square(rgb: np.ndarray, mean) -> np.ndarray:
    """LlavaImageProcessor's pad_to_square: centred on a square of the mean colour (as uint8)."""
    height, width = rgb.shape[:2]
    if height == width:
        return rgb
    side = max(height, width)
    out = np.empty((side, side, 3), np.uint8)
    out[:] = [int(m * 255) for m in mean]
    if width > height:
        start = (side - height) // 2
        out[start:start + height] = rgb
    else:
        start = (side - width) // 2
        out[:, start:start + width] = rgb
    return out


def crop_window(size: int, crop: int) -> tuple[int, int]:
    """The part of an axis of `size` a centre crop of `crop` keeps (all of it if shorter)."""
    if size < crop:
        return 0, size
    start = (size - crop) // 2
    return start, start + crop


def center_crop(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop: the centre, zero-padded first where the image is smaller."""
    h, w = image.shape[:2]
    if h < height or w < width:
        big_h, big_w = max(h, height), max(w, width)
        padded = np.zeros((big_h, big_w, image.shape[2]), image.dtype)
        top, left = math.ceil((big_h - h) / 2), math.ceil((big_w - w) / 2)
        padded[top:top + h, left:left + w] = image
        image, h, w = padded, big_h, big_w
    top, left = (h - height) // 2, (w - width) // 2
    return image[top:top + height, left:left + width]


@register("llava", "llava_qwen2", "fast_vlm", hf_folder=read_hf_folder)
class LlavaAdapter(TokenizedFamily):
    """Prompt building and pixels for LLaVA-1.5 and FastVLM folders (see the module docstring)."""

    known_prompts: tuple[str, ...] = ()  # an open vocabulary: any text reads
    reuses_image_prefix = True  # a causal decoder: the image prefix never sees the question

    def __init__(self, manifest: ModelManifest):
        super().__init__(manifest)
        self.image_id = self.id_of(self.cfg["image_token"])
        self.stop_ids = {*(self.id_of(t) for t in manifest.stop_tokens), *self.cfg["eos_token_ids"]}
        if not self.stop_ids:
            raise ModelError(f"{manifest.path}: no stop token (generation_config.json eos_token_id, or "
                             "tokenizer_config.json eos_token)")
        source = GENERATION_TAG.sub("", manifest.chat_template or "")
        self.template = ChatTemplate.compile(source, manifest.chat_template_file or manifest.path)
        # one image at preprocessor_config.json's crop (or size): an encoder sized otherwise is refused at load
        self.graph_inputs = GraphInputs(pixel_values=(None, 3, self.cfg["height"], self.cfg["width"]),
                                        pixel_values_from="preprocessor_config.json: 3 channels x crop_size")

    def pixels(self, rgb: np.ndarray, tier: ResolutionTier) -> np.ndarray:
        """RGB8 → float32 [1, 3, crop h, crop w]. Of the resize only the crop is computed: a
        shortest-edge resize of a long strip would be gigapixels, its centre crop is not."""
        cfg = self.cfg
        if cfg["do_pad"]:
            side = max(rgb.shape[:2])
            if side * side > MAX_PADDED_PIXELS:
                raise InputError(f"the image ({rgb.shape[0]}x{rgb.shape[1]}) padded to a square ({side}x{side}) "
                                 f"has more than {MAX_PADDED_PIXELS} pixels; this model pads before it resizes: "
                                 "send an image closer to square")
            rgb = pad_to_square(rgb, cfg["image_mean"])
        height, width = resized_size(*rgb.shape[:2], cfg["resize"])
        if cfg["do_center_crop"]:
            rows, cols = crop_window(height, tier.height), crop_window(width, tier.width)
            image = center_crop(resize_pil(rgb, height, width, cfg["resample"], rows, cols), tier.height, tier.width)
        else:
            image = resize_pil(rgb, height, width, cfg["resample"])
        rescale = cfg["rescale_factor"] if cfg["do_rescale"] else 1.0
        mean, std = (cfg["image_mean"], cfg["image_std"]) if cfg["do_normalize"] else ([0.0] * 3, [1.0] * 3)
        return rescale_normalize(image, rescale, mean, std)

    def chat_text(self, prompt: str) -> str:
        """The chat template around one image and the user's text, ready for the answer."""
        image_token = self.cfg["image_token"]
        return self.template.one_image(prompt, image_token, reserved=(image_token,), bos_token=self.cfg["bos_token"],
                                       eos_token=self.cfg["eos_token"])

    def build_prompt(self, prompt: str, tier: ResolutionTier, image_size: tuple[int, int] | None = None) -> Prompt:
        """Input ids with the `<image>` expanded; `image_size` is unused (one crop per image)."""
        text = self.chat_text(prompt).replace(self.cfg["image_token"], self.cfg["image_token"] * tier.image_tokens)
        # as the processor's apply_chat_template: the tokenizer's own <s> only when the template wrote none
        bos = self.cfg["bos_token"]
        special = not (bos and text.startswith(bos))
        ids = np.asarray([self.tokenizer.encode(text, add_special_tokens=special).ids], np.int64)
        positions = np.flatnonzero(ids[0] == self.image_id)
        return Prompt(ids, int(positions[0]), len(positions), (), positions)
