#!/usr/bin/env python3
"""Build the Qwen2-VL / Qwen2.5-VL conformance fixtures: tiny random models and what transformers answers.

    OMP_NUM_THREADS=1 python tools/make_qwen2vl_fixture.py [--family qwen2_vl|qwen2_5_vl] [--out DIR]

Needs the `fixture` extra (torch, transformers, pillow); nothing is downloaded. Writes
tests/fixtures/qwen2-vl-tiny and tests/fixtures/qwen2.5-vl-tiny:

1. A small byte-level BPE tokenizer with Qwen2-VL's special tokens (<|im_start|>,
   <|im_end|>, <|vision_start|>, <|image_pad|>, <|vision_end|>, <|endoftext|> …) and
   the published chat template.
2. A random Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration (fixed
   seed, two layers, tiny widths) with the real patch geometry: patch 14, merge 2,
   temporal patch 2, so a patch row is 3·2·14·14 = 1176 values.
3. The processor (Qwen2VLImageProcessorPil: min_pixels / max_pixels, bicubic) saved as a
   Hugging Face folder.
4. The three graphs in the Hugging Face ONNX layout transformers.js runs
   (onnx-community/Qwen2-VL-2B-Instruct): vision_encoder (pixel_values [N, 1176] and
   grid_thw — image_grid_thw for Qwen2.5-VL — int64 [n_images, 3] → image_features
   [N/4, D]), embed_tokens, decoder_model_merged (position_ids [3, B, S]).
5. reference.json + reference_arrays.npz: per case the processor's input_ids,
   pixel_values and image_grid_thw, the features of the unmodified vision tower, and the
   greedy tokens of transformers' own `generate`.

The `_int8` variants next to the graphs come from edgemm's own tool, afterwards:
`python tools/quantize.py tests/fixtures/qwen2-vl-tiny --scenes 48` (and qwen2.5-vl-tiny).

The trap (see the README, "Qwen2-VL"): transformers' vision tower reads the grid with
`.tolist()` (rotary positions, cu_seqlens, Qwen2.5-VL's window index), so a traced export
freezes it to the traced grid. VisionEncoder below computes all of them from the grid
tensor with tensor ops (block-diagonal attention as a mask; Qwen2.5-VL's windows as a
second mask, in the patches' own order, which equals transformers' reorder-then-split),
so the grid stays a real input. The export is traced on a grid no case uses; the
reference features prove other grids right (tests/test_qwen2_vl.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # other jobs share this machine

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil  # noqa: E402
from hf_fixture import (OPSET, EmbedTokens, MergedDecoder, export_text_graphs, greedy_reference,  # noqa: E402
                        make_images, save_folder, train_bpe, write_reference)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
OUTS = {"qwen2_vl": FIXTURES / "qwen2-vl-tiny", "qwen2_5_vl": FIXTURES / "qwen2.5-vl-tiny"}
SEED = 0
PATCH, MERGE, TEMPORAL = 14, 2, 2
UNIT = PATCH * MERGE  # 28: one image token is a 28x28 square
MIN_PIXELS = 4 * UNIT * UNIT
MAX_PIXELS = 64 * UNIT * UNIT  # the top tier: 64 image tokens
TRACE_GRID = (1, 6, 10)  # the grid the vision encoder is traced on: no case has it
MAX_NEW_TOKENS = 12

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
           "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
CORPUS = [
    "system You are a helpful assistant. user What is in the image? assistant A red square.",
    "Describe the picture in one sentence. There are shapes, lines and colours.",
    "How many objects are there? Three objects: two circles and a triangle.",
    "Read the text in the image. The sign says hello world. What colour is the sky?",
] * 4

# Qwen2-VL-2B-Instruct's chat_template.json (Qwen2.5-VL's is the same)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content "
    "or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' "
    "or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")

IMAGES = {"square.png": (301, 297), "wide.png": (157, 419), "tall.png": (433, 149)}  # (h, w): odd sizes
# (image, prompt, pixel budget in image tokens): square, wide and tall at the top budget, two
# smaller budgets, and a second question on the first image (the cached-image case)
CASES = [
    ("square.png", "What is in the image?", 64),
    ("wide.png", "Describe the picture.", 64),
    ("tall.png", "How many objects are there?", 64),
    ("wide.png", "What is in the image?", 16),
    ("square.png", "Read the text.", 32),
    ("square.png", "What colour is the sky?", 64),
]


def build_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=train_bpe(SPECIAL, CORPUS, vocab_size=360),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                                   additional_special_tokens=SPECIAL[1:], chat_template=CHAT_TEMPLATE)


def build_model(family: str, tokenizer):
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in
           ("image_pad", "video_pad", "vision_start", "vision_end", "im_end", "endoftext")}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                initializer_range=0.2, tie_word_embeddings=False, eos_token_id=ids["im_end"],
                pad_token_id=ids["endoftext"], bos_token_id=ids["endoftext"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    common = dict(image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
                  vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
                  tie_word_embeddings=False)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config, Qwen2VLForConditionalGeneration as Model
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                      spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, initializer_range=0.2)
    else:
        from transformers import Qwen2_5_VLConfig as Config, Qwen2_5_VLForConditionalGeneration as Model
        # a windowed block and a full-attention block; 112-px windows are 4x4 image tokens
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=112,
                      fullatt_block_indexes=[1], initializer_range=0.2)
    config = Config(vision_config=vision, text_config=text, **common)
    for sub in (config, config.text_config, config.vision_config):
        sub._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = Model(config).eval()
    with torch.no_grad():  # random init leaves some weights at zero or one; make every part count
        for name, param in model.named_parameters():
            if "norm" not in name and "ln_q" not in name:
                param.normal_(0, 0.2 if param.ndim > 1 else 0.05)
    model.generation_config.eos_token_id = [ids["im_end"], ids["endoftext"]]
    model.generation_config.pad_token_id = ids["endoftext"]
    model.generation_config.do_sample = False
    return model


def build_processor(family: str, tokenizer):
    images = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                                      merge_size=MERGE, temporal_patch_size=TEMPORAL)
    if family == "qwen2_vl":
        from transformers import Qwen2VLProcessor as Processor
    else:
        from transformers import Qwen2_5_VLProcessor as Processor

    class ImageProcessorOnly(Processor):
        """Without a video processor (transformers' needs torchvision; images only here)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageProcessorOnly(image_processor=images, tokenizer=tokenizer, video_processor=None,
                              chat_template=CHAT_TEMPLATE)


# ---- the graphs ------------------------------------------------------------------------------

class VisionEncoder(torch.nn.Module):
    """pixel_values [N, 1176] + grid [n_images, 3] → image_features [N / 4, D], the grid a real input.

    Every image of one call has the grid of row 0 (edgemm batches images of one shape).
    Patches come in transformers' order: per image, per 2x2 merge unit, row-major."""

    def __init__(self, model, windowed: bool):
        super().__init__()
        self.visual = model.model.visual
        self.windowed = windowed
        config = self.visual.config
        self.full = set(getattr(config, "fullatt_block_indexes", ())) if windowed else None
        self.window_units = config.window_size // MERGE // PATCH if windowed else 0

    def forward(self, pixel_values, grid_thw):
        visual = self.visual
        patches = torch.arange(pixel_values.shape[0])
        t, h, w = grid_thw[0, 0], grid_thw[0, 1], grid_thw[0, 2]
        image = patches // (t * h * w)
        within_frame = patches % (h * w)
        unit, inside = within_frame // (MERGE * MERGE), within_frame % (MERGE * MERGE)
        unit_row, unit_col = unit // (w // MERGE), unit % (w // MERGE)
        rows = unit_row * MERGE + inside // MERGE
        cols = unit_col * MERGE + inside % MERGE
        hidden = visual.patch_embed(pixel_values)
        cos, sin = visual.rotary_pos_emb(hidden, torch.stack([rows, cols], -1))
        same_image = image[:, None] == image[None, :]
        lowest = torch.finfo(torch.float32).min
        masks = {"full": torch.where(same_image, 0.0, lowest)}
        if self.windowed:
            window = (unit_row // self.window_units) * 100_000 + unit_col // self.window_units
            same_window = same_image & (window[:, None] == window[None, :])
            masks["window"] = torch.where(same_window, 0.0, lowest)
        for i, block in enumerate(visual.blocks):
            mask = masks["full"] if not self.windowed or i in self.full else masks["window"]
            hidden = hidden + self._attention(block.attn, block.norm1(hidden), cos, sin, mask)
            hidden = hidden + block.mlp(block.norm2(hidden))
        return visual.merger(hidden)

    @staticmethod
    def _attention(attn, x, cos, sin, mask):
        # q, k, v are the thirds of the projection. transformers reshapes and unbinds, and reads
        # the patch count: Gathers, which a DLA cannot run, in every block; slices and static
        # reshapes it can
        dim = attn.num_heads * attn.head_dim
        q, k, v = (z.reshape(-1, attn.num_heads, attn.head_dim) for z in attn.qkv(x).split(dim, dim=-1))
        q, k = (_rotary(z, cos, sin, attn.head_dim // 2) for z in (q, k))
        q, k, v = (z.transpose(0, 1) for z in (q, k, v))  # [heads, N, head_dim]
        weights = torch.softmax(q @ k.transpose(1, 2) * attn.scaling + mask, dim=-1, dtype=torch.float32)
        return attn.proj((weights @ v).transpose(0, 1).reshape(-1, dim))


def _rotary(x, cos, sin, half: int):
    """transformers' apply_rotary_pos_emb_vision, with the half width static (it reads it from
    the tensor's shape: a Gather per block)."""
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def export_graphs(model, family: str, out: Path) -> None:
    onnx_dir = out / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    text = model.config.text_config
    heads, head_dim = text.num_key_value_heads, text.hidden_size // text.num_attention_heads
    grid_name = "grid_thw" if family == "qwen2_vl" else "image_grid_thw"  # as transformers.js feeds them
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python values
        grid = torch.tensor([TRACE_GRID])
        n = int(grid.prod())
        torch.onnx.export(
            VisionEncoder(model, windowed=family == "qwen2_5_vl"), (torch.randn(n, 3 * TEMPORAL * PATCH * PATCH), grid),
            onnx_dir / "vision_encoder.onnx", input_names=["pixel_values", grid_name],
            output_names=["image_features"],
            dynamic_axes={"pixel_values": {0: "num_patches"}, grid_name: {0: "num_images"},
                          "image_features": {0: "num_image_tokens"}},
            opset_version=OPSET, dynamo=False)
    export_text_graphs(onnx_dir, EmbedTokens(model.get_input_embeddings()),
                       MergedDecoder(model.model.language_model, model.lm_head, text.num_hidden_layers),
                       text.hidden_size, heads, head_dim, position_axes=3)


def check_vision_export(model, family: str) -> None:
    """The tensor-op vision forward equals transformers' on several grids, before export."""
    encoder = VisionEncoder(model, windowed=family == "qwen2_5_vl")
    for grid in ([1, 4, 16], [1, 16, 4], [1, 8, 8], [1, 10, 18], [1, 12, 6]):
        g = torch.tensor([grid])
        x = torch.randn(int(g.prod()), 3 * TEMPORAL * PATCH * PATCH)
        with torch.no_grad():
            ours = encoder(x, g)
            theirs = model.model.visual(x, grid_thw=g).pooler_output
        diff = float((ours - theirs).abs().max())
        assert diff < 1e-4, (family, grid, diff)


# ---- reference ------------------------------------------------------------------------------

def reference_cases(model, processor, out: Path) -> tuple[list[dict], dict[str, np.ndarray]]:
    cases, arrays = [], {}
    for i, (image_name, prompt, budget) in enumerate(CASES):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        image = Image.open(out / image_name).convert("RGB")
        inputs = processor(text=[text], images=[image], return_tensors="pt",
                           size={"shortest_edge": MIN_PIXELS, "longest_edge": budget * UNIT * UNIT})
        with torch.no_grad():
            features = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        arrays[f"case{i}_pixels"] = inputs["pixel_values"].numpy()
        arrays[f"case{i}_features"] = features.numpy()
        cases.append({"image": image_name, "prompt": prompt, "budget_tokens": budget, "text": text,
                      "input_ids": inputs["input_ids"][0].tolist(),
                      "image_grid_thw": inputs["image_grid_thw"][0].tolist(),
                      **greedy_reference(model, inputs, processor.tokenizer, MAX_NEW_TOKENS)})
    return cases, arrays


def make(family: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    processor = build_processor(family, tokenizer)
    model = build_model(family, processor.tokenizer)
    check_vision_export(model, family)
    save_folder(model, processor, out, processor_files=False)  # the processor has no video processor to save
    make_images(out, SEED, IMAGES, discs=6, radii=(10, 50))
    export_graphs(model, family, out)
    cases, arrays = reference_cases(model, processor, out)
    write_reference(out, {"max_new_tokens": MAX_NEW_TOKENS, "trace_grid": list(TRACE_GRID), "cases": cases}, arrays,
                    "reference_arrays.npz")
    for case in cases:
        print(f"{family} {case['image']} budget={case['budget_tokens']} grid={case['image_grid_thw']} "
              f"prompt={len(case['input_ids'])} tokens={case['tokens']} ({case['finish_reason']}, "
              f"min margin {case['min_top2_margin']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(OUTS), action="append", help="default: both")
    ap.add_argument("--out", type=Path, help="output folder (with one --family)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    families = args.family or sorted(OUTS)
    if args.out is not None and len(families) != 1:
        ap.error("--out needs exactly one --family")
    for family in families:
        make(family, args.out or OUTS[family])


if __name__ == "__main__":
    sys.exit(main())
