#!/usr/bin/env python3
"""Build the idefics3 conformance fixture: a tiny random SmolVLM and what transformers says it answers.

    OMP_NUM_THREADS=1 python tools/make_idefics3_fixture.py [--out tests/fixtures/idefics3-tiny]

Needs the `fixture` extra (torch, transformers, pillow); nothing is downloaded.

1. A small byte-level BPE tokenizer with Idefics3's special tokens, built here.
2. A random `Idefics3ForConditionalGeneration` (fixed seed, a few layers, tiny widths).
3. Its processor (`Idefics3Processor` with the PIL image processor) and chat template,
   saved as a Hugging Face model folder: config.json, preprocessor_config.json,
   tokenizer.json, chat template.
4. The three graphs in the Hugging Face ONNX layout under onnx/ (as transformers.js and
   Optimum publish SmolVLM): vision_encoder (pixel_values [B,T,3,H,W] and
   pixel_attention_mask [B,T,H,W] → image_features [B*T,n,D]), embed_tokens, and
   decoder_model_merged with past_key_values.N.key/value → present.N.key/value.
5. reference.json + reference_pixels.npz: for a few images, prompts and tiers, the
   processor's input_ids and pixel_values and the greedy tokens of transformers' own
   `generate`. tests/test_idefics3.py checks edgemm against these, token for token.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a training job shares this machine

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (Idefics3Config, Idefics3ForConditionalGeneration,  # noqa: E402
                          Idefics3ImageProcessorPil, Idefics3Processor, PreTrainedTokenizerFast)
from idefics3_export import CHAT_TEMPLATE, export_graphs, save_folder  # noqa: E402  (tools/, beside this file)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "idefics3-tiny"
SEED = 0

TILE = 32  # max_image_size.longest_edge: the encoder's input side
PATCH = 4  # → 8x8 patches per tile; pixel shuffle by 2 → 16 image tokens per tile
SCALE = 2
LONGEST_EDGE = 3 * TILE  # size.longest_edge: at most 3x3 tiles + the global image
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE ** 2

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>",
           "<image>", "<global-img>", *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]]
CORPUS = [
    "User: What is in the image? Assistant: A red square next to a blue circle.",
    "Describe the picture in one sentence. There are shapes, lines and colours.",
    "How many objects are there? Three objects: two circles and a triangle.",
    "Read the text in the image. The sign says hello world.",
] * 4

# (image file, prompt, tier longest edge): one case per tier, and aspect ratios that
# give square, wide and tall tile grids
CASES = [
    ("wide.png", "What is in the image?", LONGEST_EDGE),
    ("tall.png", "Describe the picture.", LONGEST_EDGE),
    ("wide.png", "How many objects are there?", TILE),
    ("tall.png", "Read the text.", 2 * TILE),
]
MAX_NEW_TOKENS = 12


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[2:])


def build_model(tokenizer) -> Idefics3ForConditionalGeneration:
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=TILE, patch_size=PATCH, initializer_range=0.2),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        scale_factor=SCALE, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_processor(tokenizer) -> Idefics3Processor:
    images = Idefics3ImageProcessorPil(size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE},
                                       image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN,
                             chat_template=CHAT_TEMPLATE)


def make_images(out: Path) -> None:
    """Two small procedural pictures (seeded): wide 4:3 and tall 2:5, with edges and colour."""
    rng = np.random.default_rng(SEED)
    for name, (h, w) in {"wide.png": (120, 160), "tall.png": (150, 64)}.items():
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 127 // (h + w)], -1).astype(np.uint8)
        for _ in range(5):
            cy, cx, r = rng.integers(0, h), rng.integers(0, w), rng.integers(6, 24)
            img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.integers(0, 256, 3)
        cv2.imwrite(str(out / name), img[:, :, ::-1])


# ---- reference ------------------------------------------------------------------------------

def reference_cases(model, processor, out: Path) -> tuple[list[dict], dict[str, np.ndarray]]:
    cases, pixels = [], {}
    for i, (image_name, prompt, longest_edge) in enumerate(CASES):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        image = Image.open(out / image_name).convert("RGB")
        inputs = processor(text=[text], images=[[image]], return_tensors="pt",
                           size={"longest_edge": longest_edge})
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                       output_scores=True, return_dict_in_generate=True)
        prompt_len = inputs["input_ids"].shape[1]
        tokens = generated.sequences[0, prompt_len:].tolist()
        stopped = bool(tokens) and tokens[-1] == processor.tokenizer.eos_token_id
        # how decisive each greedy step was: a tiny top-2 gap could flip under float noise
        margins = [float(torch.topk(s[0], 2).values.diff().abs()) for s in generated.scores]
        pixels[f"case{i}"] = inputs["pixel_values"].numpy()
        cases.append({"image": image_name, "prompt": prompt, "longest_edge": longest_edge, "text": text,
                      "input_ids": inputs["input_ids"][0].tolist(), "tiles": int(inputs["pixel_values"].shape[1]),
                      "tokens": tokens[:-1] if stopped else tokens, "finish_reason": "stop" if stopped else "length",
                      "answer": processor.tokenizer.decode(tokens, skip_special_tokens=True),
                      "min_top2_margin": round(min(margins), 4)})
    return cases, pixels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    model = build_model(processor.tokenizer)
    save_folder(model, processor, out)
    make_images(out)
    export_graphs(model, out)
    cases, pixels = reference_cases(model, processor, out)
    np.savez_compressed(out / "reference_pixels.npz", **pixels)
    (out / "reference.json").write_text(json.dumps(
        {"max_new_tokens": MAX_NEW_TOKENS, "cases": cases}, indent=1) + "\n")
    for case in cases:
        print(f"{case['image']} L={case['longest_edge']} tiles={case['tiles']} prompt={len(case['input_ids'])} "
              f"tokens={case['tokens']} ({case['finish_reason']}, min margin {case['min_top2_margin']})")


if __name__ == "__main__":
    sys.exit(main())
