"""Idefics3 (SmolVLM) → a model folder edgemm loads: the Hugging Face ONNX layout.

Shared by tools/make_idefics3_fixture.py (the tiny conformance fixture) and
tools/make_sized_model.py (random models of real sizes). Needs the `fixture` extra.

The three graphs are those transformers.js and Optimum publish for SmolVLM:
vision_encoder (pixel_values [B,T,3,H,W] and pixel_attention_mask [B,T,H,W] →
image_features [B*T,n,D]), embed_tokens, and decoder_model_merged with
past_key_values.N.key/value → present.N.key/value.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

OPSET = 17

# SmolVLM's chat template (HuggingFaceTB/SmolVLM-*-Instruct)
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def save_folder(model, processor, out: Path) -> None:
    """config.json, generation_config.json, the processor's files and tokenizer.json."""
    processor.save_pretrained(out)
    # transformers 5 nests the image processor's settings in processor_config.json; published
    # SmolVLM folders (and edgemm) have them in preprocessor_config.json
    processor.image_processor.save_pretrained(out)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)


class VisionEncoder(torch.nn.Module):
    """pixel_values [B,T,3,H,W] + pixel_attention_mask [B,T,H,W] → image_features [B*T, n, D].

    As transformers.js's vision_encoder: tiles are flattened into the batch. edgemm feeds
    whole tiles only, so every patch is valid: the patch positions are 0..n-1 (what the
    model's bucketize gives for a full tile, and which the ONNX exporter mistypes) and the
    encoder needs no attention mask. Masked-out pixels are zeroed, as padding is.
    The reference tokens come from the unmodified model, so the test proves this equal."""

    def __init__(self, model):
        super().__init__()
        self.vision, self.connector = model.model.vision_model, model.model.connector

    def forward(self, pixel_values, pixel_attention_mask):
        pixels = pixel_values.flatten(0, 1) * pixel_attention_mask.flatten(0, 1)[:, None].to(pixel_values.dtype)
        embeddings = self.vision.embeddings
        patches = embeddings.patch_embedding(pixels).flatten(2).transpose(1, 2)
        hidden = patches + embeddings.position_embedding.weight[None]
        hidden = self.vision.encoder(inputs_embeds=hidden).last_hidden_state
        return self.connector(self.vision.post_layernorm(hidden))


class EmbedTokens(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.embed = model.get_input_embeddings()

    def forward(self, input_ids):
        return self.embed(input_ids)


class MergedDecoder(torch.nn.Module):
    """The Llama text model + lm_head with the cache as flat past/present tensors."""

    def __init__(self, model):
        super().__init__()
        self.text, self.head = model.model.text_model, model.lm_head
        self.layers = model.config.text_config.num_hidden_layers

    def forward(self, inputs_embeds, attention_mask, position_ids, *past):
        cache = DynamicCache(config=self.text.config)
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.text(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=cache, use_cache=True)
        presents = []
        for i in range(self.layers):
            presents += [cache.layers[i].keys, cache.layers[i].values]
        return (self.head(out.last_hidden_state), *presents)


def export_graphs(model, out: Path) -> None:
    """The three graphs under out/onnx/, traced at the model's own tile size."""
    onnx_dir = out / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    text = model.config.text_config
    tile = model.config.vision_config.image_size
    heads, head_dim = text.num_key_value_heads, text.hidden_size // text.num_attention_heads
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python values
        pixels = torch.randn(1, 2, 3, tile, tile)
        torch.onnx.export(
            VisionEncoder(model), (pixels, torch.ones(1, 2, tile, tile, dtype=torch.bool)),
            onnx_dir / "vision_encoder.onnx", input_names=["pixel_values", "pixel_attention_mask"],
            output_names=["image_features"],
            dynamic_axes={"pixel_values": {0: "batch_size", 1: "num_images"},
                          "pixel_attention_mask": {0: "batch_size", 1: "num_images"},
                          "image_features": {0: "batch_num_images"}},
            opset_version=OPSET, dynamo=False)
        torch.onnx.export(
            EmbedTokens(model), (torch.zeros(1, 5, dtype=torch.long),), onnx_dir / "embed_tokens.onnx",
            input_names=["input_ids"], output_names=["inputs_embeds"],
            dynamic_axes={"input_ids": {0: "batch_size", 1: "sequence_length"},
                          "inputs_embeds": {0: "batch_size", 1: "sequence_length"}},
            opset_version=OPSET, dynamo=False)
        # trace with a non-empty past so nothing specialises on past length 0
        b, s, p = 2, 3, 4
        past = [torch.randn(b, heads, p, head_dim) for _ in range(2 * text.num_hidden_layers)]
        names_in = [f"past_key_values.{i}.{k}" for i in range(text.num_hidden_layers) for k in ("key", "value")]
        names_out = [f"present.{i}.{k}" for i in range(text.num_hidden_layers) for k in ("key", "value")]
        axes = {"inputs_embeds": {0: "batch_size", 1: "sequence_length"},
                "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
                "position_ids": {0: "batch_size", 1: "sequence_length"},
                "logits": {0: "batch_size", 1: "sequence_length"},
                **{n: {0: "batch_size", 2: "past_sequence_length"} for n in names_in},
                **{n: {0: "batch_size", 2: "total_sequence_length"} for n in names_out}}
        torch.onnx.export(
            MergedDecoder(model),
            (torch.randn(b, s, text.hidden_size), torch.ones(b, p + s, dtype=torch.long),
             torch.arange(p, p + s).repeat(b, 1), *past),
            onnx_dir / "decoder_model_merged.onnx",
            input_names=["inputs_embeds", "attention_mask", "position_ids", *names_in],
            output_names=["logits", *names_out], dynamic_axes=axes, opset_version=OPSET, dynamo=False)
