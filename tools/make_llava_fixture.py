#!/usr/bin/env python3
"""Build the llava conformance fixture: a tiny random LLaVA-1.5 and what transformers says it answers.

    OMP_NUM_THREADS=1 python tools/make_llava_fixture.py [--out tests/fixtures/llava-tiny]

Needs the `fixture` extra (torch, transformers, pillow); nothing is downloaded.

1. A small byte-level BPE tokenizer with LLaVA's special tokens, built here; like
   Llama's own it puts <s> in front of what it encodes.
2. A random `LlavaForConditionalGeneration` (fixed seed, tiny widths): a CLIP vision
   tower read at its second-to-last layer without the CLS token ("default"), the
   two-layer GELU projector, and a Llama text model, as LLaVA-1.5 is.
3. Its processor (`LlavaProcessor` with the PIL CLIP image processor: shortest edge,
   centre crop, bicubic) and LLaVA-1.5's chat template, saved as a Hugging Face folder.
4. The three graphs in the Hugging Face ONNX layout (tools/onnx_layout.py).
5. reference.json + reference_pixels.npz: for a few images and prompts, the processor's
   input_ids and pixel_values and the greedy tokens of transformers' own `generate`;
   plus the pixels of LlavaImageProcessor with do_pad (pad to a square in the mean
   colour first) for each image. tests/test_family_conformance.py and tests/test_llava.py
   check edgemm against these.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # other jobs share this machine

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import (CLIPImageProcessorPil, LlavaConfig, LlavaForConditionalGeneration,  # noqa: E402
                          LlavaImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast)
from hf_fixture import (QUESTIONS, SHARED_SENTENCES, WIDE_AND_TALL, EmbedTokens, MergedDecoder,  # noqa: E402
                        chat_inputs, greedy_reference, output_folder, summary, train_bpe, write_fixture)
from onnx_layout import VisionEncoder, export_graphs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "llava-tiny"
SEED = 0

IMAGE = 32  # shortest edge and centre crop (336 in LLaVA-1.5)
PATCH = 8  # → 4x4 patches + CLS; "default" drops the CLS → 16 image tokens (LLaVA-1.5: 576)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
STOP_LIKE = "gl"  # a token the random model often says: the stop token takes its place

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
CORPUS = [
    "USER: What is in the image? ASSISTANT: A red square next to a blue circle.",
    *SHARED_SENTENCES,
] * 4

# LLaVA-1.5's chat template (llava-hf/llava-1.5-*-hf), with transformers' generation tags
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != "
    "'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")

IMAGES = WIDE_AND_TALL
# (image file, prompt): two aspects (centre crops of different sides), and a second
# question about the first image (the cached-prefix case)
CASES = QUESTIONS
MAX_NEW_TOKENS = 12


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = train_bpe(SPECIAL, CORPUS, bos="<s>")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<image>"],
                                   extra_special_tokens={"image_token": "<image>"})


def build_model(tokenizer) -> LlavaForConditionalGeneration:
    ids = tokenizer.convert_tokens_to_ids
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=2, image_size=IMAGE, patch_size=PATCH,
                           projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.2,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        image_token_index=ids("<image>"), vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", tie_word_embeddings=False)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        head = model.lm_head.weight
        head[tokenizer.eos_token_id] = 1.05 * head[ids(STOP_LIKE)]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def image_processor_kwargs() -> dict:
    return dict(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE}, resample=3,
                image_mean=CLIP_MEAN, image_std=CLIP_STD)


def build_processor(tokenizer) -> LlavaProcessor:
    return LlavaProcessor(image_processor=CLIPImageProcessorPil(**image_processor_kwargs()), tokenizer=tokenizer,
                          patch_size=PATCH, vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=CHAT_TEMPLATE)


def llava_features(model, pixel_values):
    """LlavaModel.get_image_features as one tensor [B, N, D]: the chosen layer, CLS dropped, projected."""
    config = model.config
    hidden = model.model.vision_tower(pixel_values, output_hidden_states=True, return_dict=True).hidden_states
    selected = hidden[config.vision_feature_layer]
    if config.vision_feature_select_strategy == "default":
        selected = selected[:, 1:]
    return model.model.multi_modal_projector(selected)


def export(model, out: Path) -> None:
    text = model.config.text_config
    export_graphs(out, VisionEncoder(model, llava_features), (IMAGE, IMAGE), EmbedTokens(model.get_input_embeddings()),
                  MergedDecoder(model.model.language_model, model.lm_head, text.num_hidden_layers),
                  text.hidden_size, text.num_key_value_heads, text.hidden_size // text.num_attention_heads)


def reference_cases(model, processor, out: Path) -> tuple[list[dict], dict[str, np.ndarray]]:
    cases, pixels = [], {}
    for i, (image_name, prompt) in enumerate(CASES):
        text, inputs = chat_inputs(processor, out / image_name, prompt)
        pixels[f"case{i}"] = inputs["pixel_values"].numpy()
        cases.append({"image": image_name, "prompt": prompt, "text": text,
                      "input_ids": inputs["input_ids"][0].tolist(),
                      **greedy_reference(model, inputs, processor.tokenizer, MAX_NEW_TOKENS)})
    padded = LlavaImageProcessorPil(**image_processor_kwargs(), do_pad=True)
    for name in IMAGES:
        image = Image.open(out / name).convert("RGB")
        pixels[f"pad-{name}"] = padded(images=[image], return_tensors="np")["pixel_values"]
    return cases, pixels


def main() -> None:
    out = output_folder(__doc__, OUT)
    processor = build_processor(build_tokenizer())
    model = build_model(processor.tokenizer)
    for case in write_fixture(out, model, processor, seed=SEED, images=IMAGES, export=export,
                              reference_cases=reference_cases, max_new_tokens=MAX_NEW_TOKENS):
        print(summary(case))


if __name__ == "__main__":
    sys.exit(main())
