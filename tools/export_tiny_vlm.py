#!/usr/bin/env python3
"""Export the trained tiny VLM to models/tiny-vlm/ in the standard three-graph ONNX layout.

    python tools/export_tiny_vlm.py [--checkpoint build/tiny-vlm] [--out models/tiny-vlm]

Writes vision_encoder.onnx, embed_tokens.onnx, decoder_model_merged.onnx (tensor
names of the model contract in docs/ARCHITECTURE.md), tokenizer.json, model.yaml and
sample images with their ground truth; checks every graph with onnx.checker.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import cv2
import onnx
import yaml

ROOT = Path(__file__).resolve().parent.parent

try:
    import torch
except ImportError as missing:  # the runtime's install has no torch: name the extra, not a traceback
    from extras import missing_extra
    missing_extra(__file__, "train", missing)


from edgemm.model.scenes import make_scene, questions_for  # noqa: E402
from tiny_vlm_model import (EmbedTokens, MergedDecoder, TinyVLM, TinyVLMConfig,  # noqa: E402
                            calibrate_tier_norms, load_checkpoint_state)
from train_tiny_vlm import MEAN, STD, TIERS, build_tokenizer, tier_norm_batches  # noqa: E402

OPSET = 17
SAMPLE_SEEDS = (11, 12, 15, 21)  # eval seeds (< 1e6): never seen in training


def load_trained(checkpoint_dir: Path) -> TinyVLM:
    ckpt = torch.load(checkpoint_dir / "checkpoint.pt", map_location="cpu")
    config = dict(ckpt["config"])
    config.setdefault("learned_positions", "decoder.pos.weight" in ckpt["state_dict"])  # older checkpoints
    model = TinyVLM(TinyVLMConfig(**config))
    load_checkpoint_state(model, ckpt["state_dict"])
    # the encoder's per-tier normalisation statistics, measured on fixed scenes (see TierBatchNorm)
    calibrate_tier_norms(model.encoder, tier_norm_batches())
    return model.eval()


def export_graphs(model: TinyVLM, out: Path) -> None:
    cfg = model.cfg
    head_dim = cfg.dim // cfg.heads
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about shape-dependent Python ints
        torch.onnx.export(
            model.encoder, (torch.randn(1, 3, 192, 192),), out / "vision_encoder.onnx",
            input_names=["pixel_values"], output_names=["image_features"],
            dynamic_axes={"pixel_values": {0: "batch_size", 2: "height", 3: "width"},
                          "image_features": {0: "batch_size", 1: "num_image_tokens"}},
            opset_version=OPSET, dynamo=False)
        torch.onnx.export(
            EmbedTokens(model), (torch.zeros(1, 5, dtype=torch.long),), out / "embed_tokens.onnx",
            input_names=["input_ids"], output_names=["inputs_embeds"],
            dynamic_axes={"input_ids": {0: "batch_size", 1: "sequence_length"},
                          "inputs_embeds": {0: "batch_size", 1: "sequence_length"}},
            opset_version=OPSET, dynamo=False)
        # trace with a non-empty past so nothing specialises on past length 0 or 1
        b, s, past = 2, 3, 4
        past_kv, names_in, names_out = [], [], []
        axes = {"inputs_embeds": {0: "batch_size", 1: "sequence_length"},
                "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
                "position_ids": {0: "batch_size", 1: "sequence_length"},
                "logits": {0: "batch_size", 1: "sequence_length"}}
        for i in range(cfg.layers):
            for kind in ("key", "value"):
                past_kv.append(torch.randn(b, cfg.heads, past, head_dim))
                names_in.append(f"past_key_values.{i}.{kind}")
                names_out.append(f"present.{i}.{kind}")
                axes[names_in[-1]] = {0: "batch_size", 2: "past_sequence_length"}
                axes[names_out[-1]] = {0: "batch_size", 2: "total_sequence_length"}
        inputs = (torch.randn(b, s, cfg.dim), torch.ones(b, past + s, dtype=torch.long),
                  torch.arange(past, past + s)[None].repeat(b, 1), *past_kv)
        torch.onnx.export(
            MergedDecoder(model), inputs, out / "decoder_model_merged.onnx",
            input_names=["inputs_embeds", "attention_mask", "position_ids", *names_in],
            output_names=["logits", *names_out], dynamic_axes=axes,
            opset_version=OPSET, dynamo=False)
    for name in ("vision_encoder", "embed_tokens", "decoder_model_merged"):
        onnx.checker.check_model(str(out / f"{name}.onnx"), full_check=True)


def model_yaml(cfg: TinyVLMConfig) -> dict:
    return {
        "name": "tiny-vlm",
        "family": "tiny-vlm",
        "description": "edgemm's built-in tiny vision-language model for generated shape scenes",
        "files": {"vision_encoder": "vision_encoder.onnx", "embed_tokens": "embed_tokens.onnx",
                  "decoder": "decoder_model_merged.onnx", "tokenizer": "tokenizer.json"},
        "precisions": ["fp32", "int8"],
        # tools/quantize.py leaves these in float: int8 on their inputs (ReLU outputs with a
        # long tail) cost 1-1.6 points on describe at the low and mid tiers (model card, "INT8")
        "quantization": {"keep_float": ["/body.4/conv/Conv", "/body.5/conv/Conv", "/body.6/conv/Conv"]},
        "tiers": {name: {"height": side, "width": side, "image_tokens": (side // cfg.patch) ** 2}
                  for name, side in TIERS.items()},
        "default_tier": "high",
        "preprocessing": {"color": "rgb", "resize": "stretch", "mean": list(MEAN), "std": list(STD)},
        "special_tokens": {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>"},
        "image_token": "<image>",
        "prompt_format": "<bos> <image> {prompt} <answer>",
        "stop_tokens": ["<eos>"],
        "max_context": cfg.max_positions,
        "decoder": {"layers": cfg.layers, "heads": cfg.heads, "head_dim": cfg.dim // cfg.heads,
                    "hidden_size": cfg.dim, "vocab_size": cfg.vocab_size},
    }


def write_samples(out: Path) -> None:
    samples = out / "samples"
    samples.mkdir(exist_ok=True)
    truth = {}
    for seed in SAMPLE_SEEDS:
        scene = make_scene(seed, text_probability=1.0 if seed % 2 else 0.5)
        name = f"scene_{seed}.png"
        cv2.imwrite(str(samples / name), cv2.cvtColor(scene.image, cv2.COLOR_RGB2BGR))
        truth[name] = {"seed": seed, "questions": [{"task": q.task, "prompt": q.prompt, "answer": q.answer}
                                                   for q in questions_for(scene)]}
    (samples / "ground_truth.json").write_text(json.dumps(truth, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "build" / "tiny-vlm")
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "tiny-vlm")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = load_trained(args.checkpoint)
    export_graphs(model, args.out)
    tokenizer = build_tokenizer()
    if tokenizer.get_vocab() != json.loads((args.checkpoint / "tokenizer.json").read_text())["model"]["vocab"]:
        sys.exit("the vocabulary changed since this checkpoint was trained; retrain it")
    tokenizer.save(str(args.out / "tokenizer.json"))
    (args.out / "model.yaml").write_text(
        "# edgemm model manifest (see the repository's docs/models.md, 'Using your own model')\n"
        + yaml.safe_dump(model_yaml(model.cfg), sort_keys=False))
    write_samples(args.out)
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.glob("*.onnx"))}
    print(json.dumps({"out": str(args.out), "onnx_bytes": sizes}, indent=1))


if __name__ == "__main__":
    main()
