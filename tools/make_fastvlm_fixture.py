#!/usr/bin/env python3
"""Build the FastVLM conformance fixture: a tiny random transformers FastVLM and what it answers.

    OMP_NUM_THREADS=1 python tools/make_fastvlm_fixture.py [--out tests/fixtures/fastvlm-tiny]

Needs the `fixture` extra plus timm (FastVLM's vision tower is timm's FastViT-HD, `fastvit_mci3`,
through transformers' TimmWrapper); timm imports torchvision; nothing is downloaded.

1. A small byte-level BPE tokenizer with Qwen2's chat tokens (no BOS) and `<image>`.
2. A random `FastVlmForConditionalGeneration` (model_type `fast_vlm`; fixed seed): the real
   vision tower type, `fastvit_mci3` reparameterised (`inference_mode`), with tiny widths and one
   block a stage; its last feature map (stride 64, channels 2 x the last stage's) flattened
   to tokens, the two-layer GELU projector, a Qwen2 text model.
3. `LlavaProcessor` with the PIL CLIP image processor (shortest edge, centre crop, bicubic,
   FastVLM's mean 0 / std 1), patch_size 64, strategy "full", no extra token: N = (crop/64)^2;
   the Qwen2 chat template FastVLM's converted checkpoint renders (transformers' FastVLM docs).
4. The three graphs in the Hugging Face ONNX layout (tools/onnx_layout.py).
5. reference.json + reference_pixels.npz: the processor's input_ids and pixel_values and the
   greedy tokens of transformers' own `generate` for a few images and prompts.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # other jobs share this machine
os.environ.setdefault("TIMM_FUSED_ATTN", "0")  # plain attention: exports without SDPA

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import (CLIPImageProcessorPil, FastVlmConfig, FastVlmForConditionalGeneration,  # noqa: E402
                          LlavaProcessor, PreTrainedTokenizerFast)
from hf_fixture import (QUESTIONS, SHARED_SENTENCES, WIDE_AND_TALL, EmbedTokens, MergedDecoder,  # noqa: E402
                        chat_inputs, greedy_reference, output_folder, summary, train_bpe, write_fixture)
from onnx_layout import VisionEncoder, export_graphs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "fastvlm-tiny"
SEED = 0

IMAGE = 256  # shortest edge and centre crop (1024 in FastVLM)
PATCH = 64  # FastViT-HD's stride → 4x4 = 16 image tokens (FastVLM: 16x16 = 256)
EMBED_DIMS = (8, 16, 16, 32, 32)  # fastvit_mci3: 96, 192, 384, 768, 1536; attention stages a multiple of 32
VISION_HIDDEN = 2 * EMBED_DIMS[-1]  # the final conv doubles the last stage (3072 in FastVLM)
STOP_LIKE = "u"  # a token the random model often says: the stop token takes its place

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]
CORPUS = [
    "system You are a helpful assistant. user What is in the image? assistant A red square next to a blue circle.",
    *SHARED_SENTENCES,
] * 4

# as transformers' FastVLM docs show KamilaMila/FastVLM-0.5B's template rendering: Qwen2's
# default system turn, then each message's images, a newline, its text
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>' }}{% endfor %}{{ '\n' }}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ content['text'] }}{% endgeneration %}{% else %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

IMAGES = WIDE_AND_TALL
# two aspects (centre crops of different sides, one upscaled), and a second question about
# the first image (the cached-prefix case)
CASES = QUESTIONS
MAX_NEW_TOKENS = 12


def build_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=train_bpe(SPECIAL, CORPUS), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<image>"],
                                   extra_special_tokens={"image_token": "<image>"})


def build_model(tokenizer) -> FastVlmForConditionalGeneration:
    ids = tokenizer.convert_tokens_to_ids
    config = FastVlmConfig(
        vision_config=dict(model_type="timm_wrapper", architecture="fastvit_mci3", hidden_size=VISION_HIDDEN,
                           do_pooling=True, global_pool="avg", initializer_range=0.02,
                           model_args={"inference_mode": True, "layers": (1, 1, 1, 1, 1),
                                       "embed_dims": EMBED_DIMS}),
        text_config=dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        image_token_index=ids("<image>"), image_seq_length=(IMAGE // PATCH) ** 2, projector_hidden_act="gelu",
        tie_word_embeddings=False)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = FastVlmForConditionalGeneration(config).eval()
    with torch.no_grad():
        head = model.lm_head.weight
        head[tokenizer.eos_token_id] = 1.05 * head[ids(STOP_LIKE)]
        # timm's init leaves the reparameterised convs' biases at zero and LayerNorms at 1/0:
        # random ones, so every parameter the export carries is exercised
        for name, p in model.model.vision_tower.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_processor(tokenizer) -> LlavaProcessor:
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE},
                                            resample=3, image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0])
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                          vision_feature_select_strategy="full", num_additional_image_tokens=0,
                          chat_template=CHAT_TEMPLATE)


def fastvlm_features(model, pixel_values):
    """FastVlmModel.get_image_features' projected tokens [B, N, D]."""
    return model.model.get_image_features(pixel_values).pooler_output


def export(model, out: Path) -> None:
    text = model.config.text_config
    export_graphs(out, VisionEncoder(model, fastvlm_features), (IMAGE, IMAGE),
                  EmbedTokens(model.get_input_embeddings()),
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
