#!/usr/bin/env python3
"""A transformers VLM checkpoint → a model folder edgemm loads: the Hugging Face ONNX layout.

    python tools/export_hf_vlm.py CHECKPOINT_DIR OUT_DIR [--overwrite]

CHECKPOINT_DIR is a local folder a transformers model loads from (config.json,
*.safetensors, the processor's and tokenizer's files), e.g. a download of
OpenGVLab/InternVL3-1B-hf. Needs torch and transformers (the `fixture` extra); nothing is
downloaded. OUT_DIR gets config.json, generation_config.json, the processor's files,
tokenizer.json and the chat template, and under onnx/ the three graphs that transformers.js
and Optimum publish for decoder-only VLMs:

    vision_encoder        pixel_values [B,T,3,H,W] (+ pixel_attention_mask where the family has it)
                          → image_features [B*T, n, D], tiles flattened into the batch
    embed_tokens          input_ids [B,S] → inputs_embeds [B,S,D]
    decoder_model_merged  inputs_embeds, attention_mask, position_ids, past_key_values.N.key/value
                          → logits, present.N.key/value

The graphs are fp32; `python tools/quantize.py OUT_DIR` adds the _int8 variants.

Families, by config.json's model_type (one `VisionExport` each; a new family adds one):
idefics3 / smolvlm (SmolVLM) and internvl (InternVL3 -hf). The text model and lm_head
are exported the same way for all (`EmbedTokens`, `MergedDecoder`, `export_text_graphs`: a
transformers decoder with its cache as flat tensors). The fixture makers
(tests/fixtures/make/) and tools/make_sized_model.py build their folders with these too.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

try:
    import torch
    from transformers.cache_utils import DynamicCache
except ImportError as missing:
    if __name__ != "__main__":  # imported (the fixture makers, make_sized_model): their own message
        raise
    from extras import missing_extra  # (tools/, beside this file)
    missing_extra(__file__, "fixture", missing)

OPSET = 17

# SmolVLM's chat template (HuggingFaceTB/SmolVLM-*-Instruct)
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def save_folder(model, processor, out: Path, *, processor_files: bool = True) -> None:
    """config.json, generation_config.json, the processor's files and tokenizer.json.

    processor_files=False saves the tokenizer's files alone, for a processor built without
    the video processor its own save_pretrained wants."""
    (processor if processor_files else processor.tokenizer).save_pretrained(out)
    # transformers 5 nests the image processor's settings in processor_config.json; published
    # folders (and edgemm) have them in preprocessor_config.json
    processor.image_processor.save_pretrained(out)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)

# ---- the text side of the ONNX layout ---------------------------------------------------------

class EmbedTokens(torch.nn.Module):
    """input_ids [B,S] → inputs_embeds [B,S,D]: the model's own embedding."""

    def __init__(self, embedding: torch.nn.Module):
        super().__init__()
        self.embed = embedding

    def forward(self, input_ids):
        return self.embed(input_ids)


class MergedDecoder(torch.nn.Module):
    """A transformers text model + its head, with the cache as flat past/present tensors.

    The cache keeps every position, sliding-window layers too: the window is the attention
    mask the text model builds from the positions, not a shorter cache, so every present.N
    has past + S positions (the model contract). `logits` is applied to the head's output
    (Gemma 3's soft cap)."""

    def __init__(self, text_model: torch.nn.Module, head: torch.nn.Module, layers: int,
                 logits: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.text, self.head, self.layers, self.logits = text_model, head, layers, logits

    def forward(self, inputs_embeds, attention_mask, position_ids, *past):
        cache = DynamicCache()  # full layers only: no sliding-window cache that drops positions
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        # transformers 5 names the cache argument `cache` (past_key_values, deprecated, is mapped to it)
        out = self.text(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                        cache=cache, use_cache=True)
        presents = []
        for i in range(self.layers):
            presents += [cache.layers[i].keys, cache.layers[i].values]
        logits = self.head(out.last_hidden_state)
        return (logits if self.logits is None else self.logits(logits), *presents)


def export_text_graphs(onnx_dir: Path, embed: EmbedTokens, decoder: MergedDecoder, hidden: int, kv_heads: int,
                       head_dim: int, position_axes: int = 1) -> None:
    """embed_tokens.onnx and decoder_model_merged.onnx under onnx_dir. position_axes 3 is
    M-RoPE's position_ids [3, B, S] (Qwen2-VL); 1 is [B, S]."""
    layers = decoder.layers
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python values
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
        if position_axes == 3:  # three position streams, offset so none is another's copy
            streams = torch.stack([torch.arange(p + a, p + s + a) for a in range(3)])
            positions = streams[:, None].expand(3, b, s).contiguous()
            position_dims = {1: "batch_size", 2: "sequence_length"}
        else:
            positions = torch.arange(p, p + s).repeat(b, 1)
            position_dims = {0: "batch_size", 1: "sequence_length"}
        axes = {"inputs_embeds": {0: "batch_size", 1: "sequence_length"},
                "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
                "position_ids": position_dims,
                "logits": {0: "batch_size", 1: "sequence_length"},
                **{n: {0: "batch_size", 2: "past_sequence_length"} for n in names_in},
                **{n: {0: "batch_size", 2: "total_sequence_length"} for n in names_out}}
        torch.onnx.export(
            decoder, (torch.randn(b, s, hidden), torch.ones(b, p + s, dtype=torch.long), positions, *past),
            onnx_dir / "decoder_model_merged.onnx",
            input_names=["inputs_embeds", "attention_mask", "position_ids", *names_in],
            output_names=["logits", *names_out], dynamic_axes=axes, opset_version=OPSET, dynamo=False)



# ---- the vision encoders, one per family ------------------------------------------------------

class Idefics3Vision(torch.nn.Module):
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


class InternVLVision(torch.nn.Module):
    """pixel_values [B,T,3,H,W] → image_features [B*T, n, D], as InternVLModel.get_image_features.

    The embeddings are added without interpolate_pos_encoding: edgemm feeds tiles of the
    model's own size, where transformers adds the table as it is (but under tracing it
    would put a same-size bicubic Resize in the graph). Then the encoder layers, the
    configured feature layer, the CLS token dropped ("default" strategy), pixel shuffle
    and the projector, all transformers' own modules."""

    def __init__(self, model):
        super().__init__()
        inner, config = model.model, model.config
        self.vision, self.inner = inner.vision_tower, inner
        self.layer = config.vision_feature_layer
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.ratio = config.downsample_ratio
        if isinstance(self.layer, list):
            raise SystemExit("export_hf_vlm: a list of vision_feature_layer is not supported")
        patch = config.vision_config.patch_size
        side = config.vision_config.image_size
        self.grid = side[0] // patch[0]  # patches per side (the reshape needs it as a constant)

    def forward(self, pixel_values):
        pixels = pixel_values.flatten(0, 1)
        embeddings = self.vision.embeddings
        patches = embeddings.patch_embeddings(pixels)
        cls = embeddings.cls_token.expand(patches.shape[0], -1, -1)
        hidden = torch.cat((cls, patches), dim=1)
        if embeddings.position_embeddings is not None:
            hidden = hidden + embeddings.position_embeddings
        states = [hidden]
        for layer in self.vision.encoder.layer:
            states.append(layer(states[-1]))
        features = self.vision.layernorm(states[-1]) if self.layer == -1 else states[self.layer]
        if self.drop_cls:
            features = features[:, 1:, :]
        features = features.reshape(features.shape[0], self.grid, self.grid, features.shape[-1])
        features = self.inner.pixel_shuffle(features, scale_factor=self.ratio)
        features = features.reshape(features.shape[0], -1, features.shape[-1])
        return self.inner.multi_modal_projector(features)


@dataclass(frozen=True)
class VisionExport:
    """How one family's vision encoder and text model are found in its transformers model."""
    encoder: Callable[[torch.nn.Module], torch.nn.Module]
    tile: Callable[[object], int]  # the config → the encoder's input side
    text_model: Callable[[torch.nn.Module], torch.nn.Module]
    pixel_mask: bool  # the encoder also takes pixel_attention_mask [B,T,H,W]


def _side(value) -> int:
    return value[0] if isinstance(value, (list, tuple)) else value


IDEFICS3 = VisionExport(Idefics3Vision, lambda c: _side(c.vision_config.image_size),
                        lambda m: m.model.text_model, pixel_mask=True)
INTERNVL = VisionExport(InternVLVision, lambda c: _side(c.vision_config.image_size),
                        lambda m: m.model.language_model, pixel_mask=False)
FAMILIES = {"idefics3": IDEFICS3, "smolvlm": IDEFICS3, "internvl": INTERNVL}


def family_of(model) -> VisionExport:
    kind = model.config.model_type
    if kind not in FAMILIES:
        raise SystemExit(f"export_hf_vlm: model_type {kind!r} is not supported (known: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[kind]


def export_graphs(model, out: Path) -> None:
    """The three graphs under out/onnx/, traced at the model's own tile size."""
    family = family_of(model)
    onnx_dir = out / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    text = model.config.text_config
    tile = family.tile(model.config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    heads = text.num_key_value_heads
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python values
        pixels = torch.randn(1, 2, 3, tile, tile)
        inputs, names = (pixels,), ["pixel_values"]
        axes = {"pixel_values": {0: "batch_size", 1: "num_images"}, "image_features": {0: "batch_num_images"}}
        if family.pixel_mask:
            inputs += (torch.ones(1, 2, tile, tile, dtype=torch.bool),)
            names.append("pixel_attention_mask")
            axes["pixel_attention_mask"] = {0: "batch_size", 1: "num_images"}
        torch.onnx.export(family.encoder(model), inputs, onnx_dir / "vision_encoder.onnx", input_names=names,
                          output_names=["image_features"], dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    export_text_graphs(onnx_dir, EmbedTokens(model.get_input_embeddings()),
                       MergedDecoder(family.text_model(model), model.lm_head, text.num_hidden_layers),
                       text.hidden_size, heads, head_dim)


def copy_checkpoint_files(checkpoint: Path, out: Path) -> None:
    """The checkpoint's own JSON and template files, as they are (no processor is built:
    InternVL's wants torchvision for its video half, which an export does not need).
    tokenizer.json is written from the tokenizer if the checkpoint has only vocab/merges
    files; preprocessor_config.json from processor_config.json where transformers 5 nests
    the image processor's settings there (published folders and edgemm read them on top)."""
    for file in sorted(checkpoint.iterdir()):
        if file.is_file() and file.suffix in (".json", ".jinja") and not file.name.endswith(".index.json"):
            shutil.copyfile(file, out / file.name)
    if not (out / "tokenizer.json").is_file():
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    nested = json.loads((out / "processor_config.json").read_text()).get("image_processor") \
        if (out / "processor_config.json").is_file() else None
    if not (out / "preprocessor_config.json").is_file() and isinstance(nested, dict):
        (out / "preprocessor_config.json").write_text(json.dumps(nested, indent=2) + "\n")


def export_checkpoint(checkpoint: Path, out: Path) -> None:
    """Load a local checkpoint folder with transformers and write the edgemm folder."""
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    family_of(model)  # refuse an unknown family before any file is written
    out.mkdir(parents=True, exist_ok=True)
    copy_checkpoint_files(checkpoint, out)
    if not (out / "generation_config.json").is_file():
        model.generation_config.save_pretrained(out)
    export_graphs(model, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path, help="a local transformers checkpoint folder")
    ap.add_argument("out", type=Path, help="the edgemm model folder to write")
    ap.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = ap.parse_args()
    if not (args.checkpoint / "config.json").is_file():
        sys.exit(f"error: {args.checkpoint} is not a checkpoint folder (no config.json)")
    if args.out.exists() and any(args.out.iterdir()):
        if not args.overwrite:
            sys.exit(f"error: {args.out} exists and is not empty (--overwrite replaces it)")
        shutil.rmtree(args.out)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    export_checkpoint(args.checkpoint, args.out)
    print(f"wrote {args.out}; int8 variants: python tools/quantize.py {args.out}")


if __name__ == "__main__":
    main()
