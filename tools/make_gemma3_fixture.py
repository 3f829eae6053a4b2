#!/usr/bin/env python3
"""Build the gemma3 conformance fixture: a tiny random Gemma 3 and what transformers says it answers.

    OMP_NUM_THREADS=1 python tools/make_gemma3_fixture.py [--out tests/fixtures/gemma3-tiny]

Needs the `fixture` extra (torch, transformers, pillow); nothing is downloaded.

1. A small byte-level BPE tokenizer with Gemma 3's special tokens, built here; like
   Gemma's own it puts <bos> in front of what it encodes.
2. A random `Gemma3ForConditionalGeneration` (fixed seed, tiny widths): a SigLIP vision
   tower whose patches the projector average-pools to 16 image tokens, and a text model
   with two sliding-window layers (window 24, shorter than every prompt) and one global one.
3. Its processor (`Gemma3Processor`, the PIL image processor, Gemma 3's chat template),
   saved as a Hugging Face model folder.
4. The three graphs in the Hugging Face ONNX layout (tools/onnx_layout.py).
5. reference.json + reference_pixels.npz: for a few images and prompts, the processor's
   input_ids and pixel_values and the greedy tokens of transformers' own `generate`,
   run WITHOUT token_type_ids: with them transformers lets the image tokens attend to
   each other bidirectionally, which a decoder graph with a 2-D attention mask cannot
   express (transformers.js runs Gemma 3 the same way). tests/test_family_conformance.py checks
   edgemm against these, token for token.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # other jobs share this machine

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,  # noqa: E402
                          Gemma3Processor, PreTrainedTokenizerFast)
from hf_fixture import (QUESTIONS, SHARED_SENTENCES, WIDE_AND_TALL, EmbedTokens, MergedDecoder,  # noqa: E402
                        chat_inputs, greedy_reference, output_folder, summary, train_bpe, without_stop, write_fixture)
from onnx_layout import VisionEncoder, export_graphs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gemma3-tiny"
SEED = 0

IMAGE = 32  # the processor's size: the encoder's input side (896 in the real model)
PATCH = 4  # → 8x8 patches, average-pooled 2x2 → 16 image tokens (real: 64x64 → 256)
IMAGE_TOKENS = 16
SLIDING_WINDOW = 24
STOP_LIKE = "gl"  # a token the random model often says: the stop token takes its place

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
           "<end_of_image>", "<image_soft_token>"]
CORPUS = [
    "user What is in the image? model A red square next to a blue circle.",
    *SHARED_SENTENCES,
] * 4

# Gemma 3's chat template (google/gemma-3-*-it), as the published folders have it
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n")

IMAGES = WIDE_AND_TALL
# (image file, prompt): two aspects (Gemma 3 stretches both to one square), and a second
# question about the first image (the cached-prefix case)
CASES = QUESTIONS
MAX_NEW_TOKENS = 12


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = train_bpe(SPECIAL, CORPUS, bos="<bos>")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=SPECIAL[4:],
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})


def build_model(tokenizer) -> Gemma3ForConditionalGeneration:
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IMAGE, patch_size=PATCH),
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                         sliding_window=SLIDING_WINDOW, max_position_embeddings=1024, initializer_range=0.2,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False),
        mm_tokens_per_image=IMAGE_TOKENS, boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"), image_token_index=ids("<image_soft_token>"), initializer_range=0.2,
        tie_word_embeddings=False)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = Gemma3ForConditionalGeneration(config).eval()
    # the multimodal projection starts at zero in transformers; a random one makes the image matter
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
        # <end_of_turn> wherever "gl" would win: some answers end with a stop token
        head = model.lm_head.weight
        head[ids("<end_of_turn>")] = 1.05 * head[ids(STOP_LIKE)]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, ids("<end_of_turn>")]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def build_processor(tokenizer) -> Gemma3Processor:
    images = Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}, resample=2,
                                     image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                           image_seq_length=IMAGE_TOKENS)


def export(model, out: Path) -> None:
    text = model.config.text_config
    cap = text.final_logit_softcapping

    def logits(x):  # Gemma3ForConditionalGeneration.forward's soft cap, if the config has one
        return x if cap is None else torch.tanh(x / cap) * cap

    export_graphs(out, VisionEncoder(model, lambda m, px: m.model.get_image_features(px, return_dict=True).pooler_output),
                  (IMAGE, IMAGE), EmbedTokens(model.get_input_embeddings()),
                  MergedDecoder(model.model.language_model, model.lm_head, text.num_hidden_layers, logits),
                  text.hidden_size, text.num_key_value_heads, text.head_dim)


def reference_cases(model, processor, out: Path) -> tuple[list[dict], dict[str, np.ndarray]]:
    cases, pixels = [], {}
    for i, (image_name, prompt) in enumerate(CASES):
        text, inputs = chat_inputs(processor, out / image_name, prompt)
        token_type_ids = inputs.pop("token_type_ids")  # the causal reference (see the module docstring)
        reference = greedy_reference(model, inputs, processor.tokenizer, MAX_NEW_TOKENS)
        # what the approximation costs: transformers' own answer with the bidirectional image block
        with torch.no_grad():
            bidirectional = model.generate(**inputs, token_type_ids=token_type_ids, max_new_tokens=MAX_NEW_TOKENS,
                                           do_sample=False)
        pixels[f"case{i}"] = inputs["pixel_values"].numpy()
        cases.append({"image": image_name, "prompt": prompt, "text": text,
                      "input_ids": inputs["input_ids"][0].tolist(), **reference,
                      "tokens_with_token_type_ids": without_stop(
                          bidirectional[0, inputs["input_ids"].shape[1]:].tolist(), model)})
    return cases, pixels


def main() -> None:
    out = output_folder(__doc__, OUT)
    processor = build_processor(build_tokenizer())
    model = build_model(processor.tokenizer)
    for case in write_fixture(out, model, processor, seed=SEED, images=IMAGES, export=export,
                              reference_cases=reference_cases, max_new_tokens=MAX_NEW_TOKENS, token_type_ids=False):
        print(summary(case))


if __name__ == "__main__":
    sys.exit(main())
