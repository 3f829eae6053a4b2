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
   `generate`. tests/test_family_conformance.py checks edgemm against these, token for token.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # a training job shares this machine

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import (Idefics3Config, Idefics3ForConditionalGeneration,  # noqa: E402
                          Idefics3ImageProcessorPil, Idefics3Processor, PreTrainedTokenizerFast)
from hf_fixture import (SHARED_SENTENCES, WIDE_AND_TALL, greedy_reference, output_folder, summary,  # noqa: E402
                        train_bpe, write_fixture)
from idefics3_export import CHAT_TEMPLATE, export_graphs  # noqa: E402  (tools/, beside this file)

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
    *SHARED_SENTENCES,
] * 4

IMAGES = WIDE_AND_TALL
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
    return PreTrainedTokenizerFast(tokenizer_object=train_bpe(SPECIAL, CORPUS), bos_token="<|im_start|>",
                                   eos_token="<end_of_utterance>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", additional_special_tokens=SPECIAL[2:])


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


# ---- reference ------------------------------------------------------------------------------

def reference_cases(model, processor, out: Path) -> tuple[list[dict], dict[str, np.ndarray]]:
    cases, pixels = [], {}
    for i, (image_name, prompt, longest_edge) in enumerate(CASES):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        image = Image.open(out / image_name).convert("RGB")
        inputs = processor(text=[text], images=[[image]], return_tensors="pt",
                           size={"longest_edge": longest_edge})
        pixels[f"case{i}"] = inputs["pixel_values"].numpy()
        cases.append({"image": image_name, "prompt": prompt, "longest_edge": longest_edge, "text": text,
                      "input_ids": inputs["input_ids"][0].tolist(), "tiles": int(inputs["pixel_values"].shape[1]),
                      **greedy_reference(model, inputs, processor.tokenizer, MAX_NEW_TOKENS)})
    return cases, pixels


def main() -> None:
    out = output_folder(__doc__, OUT)
    processor = build_processor(build_tokenizer())
    model = build_model(processor.tokenizer)
    for case in write_fixture(out, model, processor, seed=SEED, images=IMAGES, export=export_graphs,
                              reference_cases=reference_cases, max_new_tokens=MAX_NEW_TOKENS):
        print(f"L={case['longest_edge']} tiles={case['tiles']} {summary(case)}")


if __name__ == "__main__":
    sys.exit(main())
