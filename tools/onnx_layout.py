"""The Hugging Face ONNX layout (transformers.js / Optimum) for a transformers VLM.

Shared by tools/make_gemma3_fixture.py, make_llava_fixture.py and make_fastvlm_fixture.py:
their vision encoders, a [B,3,H,W] image each; the text side is tools/hf_fixture.py's, as
for every family. Needs the `fixture` extra. Three graphs under onnx/:

    vision_encoder.onnx        pixel_values [B,3,H,W] → image_features [B,N,D]
    embed_tokens.onnx          input_ids [B,S] → inputs_embeds [B,S,D]
    decoder_model_merged.onnx  inputs_embeds, attention_mask, position_ids,
                               past_key_values.N.key/value → logits, present.N.key/value

The decoder keeps every position in its cache, sliding-window layers too (hf_fixture.MergedDecoder).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from hf_fixture import OPSET, EmbedTokens, MergedDecoder, export_text_graphs  # (tools/, beside this file)


class VisionEncoder(torch.nn.Module):
    """pixel_values [B,3,H,W] → image_features [B,N,D]: `features(model, pixel_values)`, the
    model's own function (the model is a submodule, so its weights export as weights)."""

    def __init__(self, model: torch.nn.Module, features: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model, self.features = model, features

    def forward(self, pixel_values):
        return self.features(self.model, pixel_values)


def export_graphs(out: Path, encoder: VisionEncoder, image_size: tuple[int, int], embed: EmbedTokens,
                  decoder: MergedDecoder, hidden: int, kv_heads: int, head_dim: int) -> None:
    """The three graphs under out/onnx/, the encoder traced at the model's own image size."""
    onnx_dir = out / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python values
        torch.onnx.export(
            encoder, (torch.randn(2, 3, *image_size),), onnx_dir / "vision_encoder.onnx",
            input_names=["pixel_values"], output_names=["image_features"],
            dynamic_axes={"pixel_values": {0: "batch_size"}, "image_features": {0: "batch_size"}},
            opset_version=OPSET, dynamo=False)
    export_text_graphs(onnx_dir, embed, decoder, hidden, kv_heads, head_dim)
