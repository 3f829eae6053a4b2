#!/usr/bin/env python3
"""Build the internvl conformance fixture: a tiny random InternVL3 and what transformers says it answers.

    OMP_NUM_THREADS=1 python tools/make_internvl_fixture.py [--out tests/fixtures/internvl-tiny]
                                                            [--checkpoint DIR]

Needs the `fixture` extra (torch, transformers, pillow) and torchvision (transformers'
default image processor for InternVL is its torchvision backend); nothing is downloaded.

1. A small byte-level BPE tokenizer with InternVL3's special tokens (<|im_start|>,
   <|im_end|>, <img>, </img>, <IMG_CONTEXT>, <video>), built here.
2. A random `InternVLForConditionalGeneration` (fixed seed): a 2-layer InternViT with
   32x32 tiles of 4x4 patches (16 tokens per tile after the pixel shuffle) and a 2-layer
   Qwen2 text model, with InternVL3-hf's chat template and `InternVLProcessor`
   (GotOcr2ImageProcessor, min_patches 1, max_patches 6).
3. That model saved as a checkpoint folder (to --checkpoint, else a temporary one) and
   exported from there by tools/export_hf_vlm.py, exactly as a user exports a real one.
4. reference.json + reference_pixels.npz: for a few images, prompts and tile budgets
   (max_patches), the processor's input_ids and pixel_values and the greedy tokens of
   transformers' own `generate`. tests/test_family_conformance.py checks edgemm against these.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # other work shares this machine

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import (GotOcr2ImageProcessor, GotOcr2ImageProcessorPil, InternVLConfig,  # noqa: E402
                          InternVLForConditionalGeneration, InternVLProcessor, InternVLVideoProcessor,
                          PreTrainedTokenizerFast)
from export_hf_vlm import export_checkpoint  # noqa: E402  (tools/, beside this file)
from hf_fixture import (SHARED_SENTENCES, WIDE_AND_TALL, greedy_reference, make_images, train_bpe,  # noqa: E402
                        write_reference)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "internvl-tiny"
SEED = 0

TILE = 32  # the processor's size: the encoder's input side (448 in InternVL3)
PATCH = 4  # → 8x8 patches per tile; pixel shuffle by 0.5 → 16 image tokens per tile (256 in InternVL3)
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // 4
MAX_PATCHES = 6
IMAGE_PROCESSOR = dict(size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1,
                       max_patches=MAX_PATCHES, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])

# InternVL3-hf's chat template (transformers' convert_internvl_weights_to_hf.py writes it)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}")
NAMED_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *NAMED_TOKENS.values()]
CORPUS = [
    "user\nWhat is in the image? assistant\nA red square next to a blue circle.",
    *SHARED_SENTENCES,
] * 4

IMAGES = WIDE_AND_TALL
# (image file, prompt, max_patches): two aspect ratios that give different grids, every
# tier, and a second question on an image already asked about (the cached prefix)
CASES = [
    ("wide.png", "What is in the image?", 6),  # 3x2 grid + thumbnail
    ("tall.png", "Describe the picture.", 6),  # 1x2 + thumbnail
    ("wide.png", "How many objects are there?", 1),  # one tile
    ("tall.png", "Read the text.", 4),
    ("wide.png", "Describe the picture.", 6),  # case 0's image again: its prefix is cached
    ("wide.png", "Read the text.", 4),  # 2x2 + thumbnail
]
MAX_NEW_TOKENS = 12


def build_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=train_bpe(SPECIAL, CORPUS), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   extra_special_tokens=NAMED_TOKENS, chat_template=CHAT_TEMPLATE)


def have_torchvision() -> bool:
    try:
        importlib.import_module("torchvision.transforms.v2.functional")
    except Exception:  # missing, or a build that does not match this torch
        return False
    return True


def build_processor(tokenizer) -> InternVLProcessor:
    """InternVLProcessor with transformers' default image processor for InternVL (its torchvision backend)."""
    images = GotOcr2ImageProcessor(**IMAGE_PROCESSOR)
    # the processor insists on a video processor too; edgemm takes no video
    return InternVLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=InternVLVideoProcessor(),
                             image_seq_length=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)


def build_model(tokenizer) -> InternVLForConditionalGeneration:
    config = InternVLConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=TILE, patch_size=PATCH, initializer_range=0.2),
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=IMAGE_SEQ_LEN,
        downsample_ratio=0.5, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    model = InternVLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_checkpoint(tokenizer, checkpoint: Path) -> None:
    """The same model as a checkpoint folder, written without InternVLProcessor (whose video
    processor needs torchvision): its tokenizer, image processor and processor_config.json."""
    model = build_model(tokenizer)
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    backend = GotOcr2ImageProcessor if have_torchvision() else GotOcr2ImageProcessorPil
    backend(**IMAGE_PROCESSOR).save_pretrained(checkpoint)
    (checkpoint / "processor_config.json").write_text(json.dumps(
        {"image_seq_length": IMAGE_SEQ_LEN, "processor_class": "InternVLProcessor"}, indent=2) + "\n")


# ---- reference ------------------------------------------------------------------------------

def reference_cases(model, processor, out: Path) -> tuple[list[dict], dict[str, np.ndarray]]:
    cases, pixels = [], {}
    pil = GotOcr2ImageProcessorPil(**IMAGE_PROCESSOR)  # to say how far the PIL backend is off
    for i, (image_name, prompt, max_patches) in enumerate(CASES):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        image = Image.open(out / image_name).convert("RGB")
        inputs = processor(text=[text], images=[image], return_tensors="pt", max_patches=max_patches)
        reference = greedy_reference(model, inputs, processor.tokenizer, MAX_NEW_TOKENS)
        pil_pixels = pil(images=[image], crop_to_patches=True, max_patches=max_patches,
                         return_tensors="pt")["pixel_values"]
        pixels[f"case{i}"] = inputs["pixel_values"].numpy()[None]  # [1, tiles, 3, H, W] as edgemm feeds it
        cases.append({"image": image_name, "prompt": prompt, "max_patches": max_patches, "text": text,
                      "input_ids": inputs["input_ids"][0].tolist(), "tiles": int(inputs["pixel_values"].shape[0]),
                      **reference,
                      "pil_backend_max_abs_diff": round(float((pil_pixels - inputs["pixel_values"]).abs().max()), 4)})
    return cases, pixels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--checkpoint", type=Path, help="keep the tiny transformers checkpoint here")
    ap.add_argument("--checkpoint-only", action="store_true",
                    help="write only --checkpoint (then without torchvision: the PIL image processor)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.checkpoint_only:  # for tests/test_internvl.py's export test, which may lack torchvision
        if args.checkpoint is None:
            sys.exit("error: --checkpoint-only needs --checkpoint DIR")
        save_checkpoint(build_tokenizer(), args.checkpoint)
        return
    if not have_torchvision():
        sys.exit("error: the reference pixels come from transformers' default (torchvision) image processor: "
                 "pip install torchvision")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    model = build_model(processor.tokenizer)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = args.checkpoint or Path(scratch) / "checkpoint"
        model.save_pretrained(checkpoint)
        processor.save_pretrained(checkpoint)
        export_checkpoint(checkpoint, out)
    make_images(out, SEED, IMAGES)
    cases, pixels = reference_cases(model, processor, out)
    write_reference(out, {"max_new_tokens": MAX_NEW_TOKENS, "cases": cases}, pixels)
    for case in cases:
        print(f"{case['image']} max_patches={case['max_patches']} tiles={case['tiles']} "
              f"prompt={len(case['input_ids'])} tokens={case['tokens']} ({case['finish_reason']}, "
              f"min margin {case['min_top2_margin']}, PIL backend off by {case['pil_backend_max_abs_diff']})")


if __name__ == "__main__":
    sys.exit(main())
