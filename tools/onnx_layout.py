"""The Hugging Face ONNX layout (transformers.js / Optimum) for a transformers VLM.

Shared by tools/make_gemma3_fixture.py and tools/make_llava_fixture.py. Needs the
`fixture` extra. Three graphs under onnx/:

    vision_encoder.onnx        pixel_values [B,3,H,W] → image_features [B,N,D]
    embed_tokens.onnx          input_ids [B,S] → inputs_embeds [B,S,D]
    decoder_model_merged.onnx  inputs_embeds, attention_mask, position_ids,
                               past_key_values.N.key/value → logits, present.N.key/value

The decoder keeps every position in its cache, sliding-window layers too: the window
is the attention mask the text model builds from the positions, not a shorter cache,
so every present.N has past + S positions (the model contract).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

OPSET = 17


class VisionEncoder(torch.nn.Module):
    """pixel_values [B,3,H,W] → image_features [B,N,D]: `features(model, pixel_values)`, the
    model's own function (the model is a submodule, so its weights export as weights)."""

    def __init__(self, model: torch.nn.Module, features: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model, self.features = model, features

    def forward(self, pixel_values):
        return self.features(self.model, pixel_values)


class EmbedTokens(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Module):
        super().__init__()
        self.embed = embedding

    def forward(self, input_ids):
        return self.embed(input_ids)


class MergedDecoder(torch.nn.Module):
    """A transformers text model + its head, with the cache as flat past/present tensors."""

    def __init__(self, text_model: torch.nn.Module, head: torch.nn.Module, layers: int,
                 logits: Callable[[torch.Tensor], torch.Tensor] = lambda x: x):
        super().__init__()
        self.text, self.head, self.layers, self.logits = text_model, head, layers, logits

    def forward(self, inputs_embeds, attention_mask, position_ids, *past):
        cache = DynamicCache()  # full layers only: no sliding-window cache that drops positions
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.text(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=cache, use_cache=True)
        presents = []
        for i in range(self.layers):
            presents += [cache.layers[i].keys, cache.layers[i].values]
        return (self.logits(self.head(out.last_hidden_state)), *presents)


def export_graphs(out: Path, encoder: VisionEncoder, image_size: tuple[int, int], embed: EmbedTokens,
                  decoder: MergedDecoder, hidden: int, kv_heads: int, head_dim: int) -> None:
    """The three graphs under out/onnx/, the encoder traced at the model's own image size."""
    onnx_dir = out / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    layers = decoder.layers
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python values
        torch.onnx.export(
            encoder, (torch.randn(2, 3, *image_size),), onnx_dir / "vision_encoder.onnx",
            input_names=["pixel_values"], output_names=["image_features"],
            dynamic_axes={"pixel_values": {0: "batch_size"}, "image_features": {0: "batch_size"}},
            opset_version=OPSET, dynamo=False)
        torch.onnx.export(
            embed, (torch.zeros(1, 5, dtype=torch.long),), onnx_dir / "embed_tokens.onnx",
            input_names=["input_ids"], output_names=["inputs_embeds"],
            dynamic_axes={"input_ids": {0: "batch_size", 1: "sequence_length"},
                          "inputs_embeds": {0: "batch_size", 1: "sequence_length"}},
            opset_version=OPSET, dynamo=False)
        # trace with a non-empty past so nothing specialises on past length 0
        b, s, p = 2, 3, 4
        past = [torch.randn(b, kv_heads, p, head_dim) for _ in range(2 * layers)]
        names_in = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
        names_out = [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
        axes = {"inputs_embeds": {0: "batch_size", 1: "sequence_length"},
                "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
                "position_ids": {0: "batch_size", 1: "sequence_length"},
                "logits": {0: "batch_size", 1: "sequence_length"},
                **{n: {0: "batch_size", 2: "past_sequence_length"} for n in names_in},
                **{n: {0: "batch_size", 2: "total_sequence_length"} for n in names_out}}
        torch.onnx.export(
            decoder, (torch.randn(b, s, hidden), torch.ones(b, p + s, dtype=torch.long),
                      torch.arange(p, p + s).repeat(b, 1), *past),
            onnx_dir / "decoder_model_merged.onnx",
            input_names=["inputs_embeds", "attention_mask", "position_ids", *names_in],
            output_names=["logits", *names_out], dynamic_axes=axes, opset_version=OPSET, dynamo=False)


def make_images(out: Path, seed: int, sizes: dict[str, tuple[int, int]]) -> None:
    """Small procedural pictures (seeded), one per name and (h, w): gradients and discs."""
    import cv2
    import numpy as np
    rng = np.random.default_rng(seed)
    for name, (h, w) in sizes.items():
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 127 // (h + w)], -1).astype(np.uint8)
        for _ in range(5):
            cy, cx, r = rng.integers(0, h), rng.integers(0, w), rng.integers(6, 24)
            img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.integers(0, 256, 3)
        cv2.imwrite(str(out / name), img[:, :, ::-1])
