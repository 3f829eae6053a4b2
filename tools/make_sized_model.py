#!/usr/bin/env python3
"""Build a random-weight model of a real model's shape, as a folder edgemm loads.

    python tools/make_sized_model.py smolvlm-256m            # → ~/.cache/edgemm/sized/smolvlm-256m
    python tools/make_sized_model.py smolvlm-500m --out DIR
    python tools/make_sized_model.py smolvlm-256m --layers 2 --hidden 72 --vocab 1152   # reduced, for tests

Needs the `fixture` extra (torch, transformers, pillow); nothing is downloaded. What a
benchmark needs from a real model is its shape, not its knowledge: the same matrices cost
the same time. So this builds, with transformers and a fixed seed:

1. A tokenizer of the real vocabulary size. No package ships SmolVLM's tokenizer, so a
   byte-level BPE is trained here on Python's own standard library sources (whatever
   Python runs this; a few tens of MB of them) to the size of SmolLM2's base vocabulary,
   with SmolLM2's 17 special tokens at ids 0-16, and SmolVLM's added tokens appended at
   their published ids (`<global-img>` 49152, `<row_1_col_1>` … `<row_6_col_6>`,
   `<fake_token_around_image>` 49189, `<image>` 49190, 88 reserved tokens,
   `<end_of_utterance>` 49279). The ordinary tokens are not SmolVLM's: the same text gives
   other ids (and other counts) than the real tokenizer.
2. The model with the published config (see SHAPES), weights drawn at the published
   `initializer_range` 0.02 (a larger one makes 30 layers chaotic, so float noise would
   flip greedy tokens between runtimes).
3. The Hugging Face model folder (config, processor, tokenizer, chat template,
   model.safetensors for transformers) and the three graphs in the Hugging Face ONNX
   layout under onnx/ (tools/export_hf_vlm.py, shared with the test fixture).
4. reference.json: transformers' own greedy `generate` on probe.png (one 512×512 tile),
   so edgemm and the benchmarks can be checked token for token.

The folder is complete once build.json is written; a complete folder is not rebuilt
(--force rebuilds). `--layers`, `--hidden` and `--vocab` reduce a shape (for tests);
a reduced build goes to a folder of its own name.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

try:
    import torch
    from PIL import Image
    from tqdm import tqdm
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor, PreTrainedTokenizerFast)

    from export_hf_vlm import SMOLVLM_CHAT_TEMPLATE, export_graphs, save_folder  # (tools/, beside this file)
except ImportError as missing:
    from extras import missing_extra
    missing_extra(__file__, "fixture", missing)

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgemm" / "sized"
SEED = 0
PROBE_PROMPT = "Can you describe this image?"
MAX_NEW_TOKENS = 32
CORPUS_BYTES_PER_TOKEN = 800  # training text per vocabulary entry: ~40 MB for SmolLM2's 49152

# SmolLM2's special tokens, ids 0-16, as its tokenizer (and so SmolVLM's) has them
SMOLLM2_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
                   "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
                   "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>", "<jupyter_script>",
                   "<empty_output>"]
# SmolVLM's added tokens, in id order from the end of the base vocabulary (49152 … 49279)
SMOLVLM_ADDED = ["<global-img>", *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
                 "<fake_token_around_image>", "<image>",
                 *[f"<|reserved_special_token_{i}|>" for i in range(88)], "<end_of_utterance>"]


@dataclass(frozen=True)
class TextShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int  # with the added tokens
    rope_theta: float
    max_positions: int


@dataclass(frozen=True)
class VisionShape:
    hidden: int
    layers: int
    heads: int
    mlp: int
    image_size: int  # one tile's side in pixels
    patch: int


@dataclass(frozen=True)
class SizedShape:
    """A real model's published shape. `family` picks the builder (BUILDERS): a new family
    (qwen2-vl-2b, when edgemm has that family) adds its shapes and one builder function."""
    family: str
    text: TextShape
    vision: VisionShape
    scale_factor: int  # pixel shuffle: image tokens per tile = (image_size / patch / scale_factor)²
    longest_edge: int  # the processor's size.longest_edge: the top tier
    initializer_range: float = 0.02

    def reduced(self, layers: int | None = None, hidden: int | None = None, vocab: int | None = None) -> "SizedShape":
        """Fewer layers (text and vision), a narrower text model (same heads; the MLP keeps its
        ratio to the hidden size) or a smaller vocabulary (the added tokens kept at its end)."""
        text, vision = self.text, self.vision
        if layers:
            text = dataclasses.replace(text, layers=min(layers, text.layers))
            vision = dataclasses.replace(vision, layers=min(layers, vision.layers))
        if hidden:
            if hidden % text.heads or (hidden // text.heads) % 2:
                raise SystemExit(f"--hidden {hidden}: must be {text.heads} heads × an even head size")
            text = dataclasses.replace(text, hidden=hidden, mlp=round(hidden * text.mlp / text.hidden / 8) * 8)
        if vocab:
            if vocab <= len(SMOLLM2_SPECIAL) + len(SMOLVLM_ADDED) + 256:
                raise SystemExit(f"--vocab {vocab}: too small for the special tokens and the bytes")
            text = dataclasses.replace(text, vocab=vocab)
        return dataclasses.replace(self, text=text, vision=vision)


# HuggingFaceTB/SmolVLM-256M-Instruct and -500M-Instruct (config.json): SmolLM2-135M / -360M's
# text shapes with the vocabulary grown by SmolVLM's added tokens, untied embeddings (256.5 M
# parameters for 256m), a SigLIP-base/16 vision tower at 512 px, pixel shuffle by 4 → 64 tokens a tile
SIGLIP_BASE_512 = VisionShape(hidden=768, layers=12, heads=12, mlp=3072, image_size=512, patch=16)
SHAPES: dict[str, SizedShape] = {
    "smolvlm-256m": SizedShape("idefics3", TextShape(hidden=576, layers=30, heads=9, kv_heads=3, mlp=1536,
                                                     vocab=49280, rope_theta=100_000, max_positions=8192),
                               SIGLIP_BASE_512, scale_factor=4, longest_edge=2048),
    "smolvlm-500m": SizedShape("idefics3", TextShape(hidden=960, layers=32, heads=15, kv_heads=5, mlp=2560,
                                                     vocab=49280, rope_theta=100_000, max_positions=8192),
                               SIGLIP_BASE_512, scale_factor=4, longest_edge=2048),
}


# ---- tokenizer ------------------------------------------------------------------------------

def added_token_ids(vocab: int) -> dict[str, int]:
    """SmolVLM's added tokens at the end of a vocabulary of `vocab` (49190 for <image> at 49280)."""
    first = vocab - len(SMOLVLM_ADDED)
    return {token: first + i for i, token in enumerate(SMOLVLM_ADDED)}


def local_corpus(max_bytes: int):
    """Python's standard library sources, in a fixed order, up to `max_bytes` of text."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def build_tokenizer(vocab: int, progress: bool) -> PreTrainedTokenizerFast:
    base = vocab - len(SMOLVLM_ADDED)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=base, special_tokens=SMOLLM2_SPECIAL, show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(local_corpus(base * CORPUS_BYTES_PER_TOKEN), trainer)
    if tok.get_vocab_size() != base:  # too little text for that many merges: the ids would shift
        raise SystemExit(f"the BPE reached {tok.get_vocab_size()} tokens, not {base}: not enough local text")
    tok.add_special_tokens(SMOLVLM_ADDED)  # in order, before the wrapper could reorder them
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>",
                                   additional_special_tokens=SMOLVLM_ADDED)
    wrong = {t: fast.convert_tokens_to_ids(t) for t, i in added_token_ids(vocab).items()
             if fast.convert_tokens_to_ids(t) != i}
    if wrong or len(fast) != vocab:
        raise SystemExit(f"tokenizer layout: {len(fast)} tokens, misplaced {wrong}")
    return fast


# ---- idefics3 (SmolVLM) ---------------------------------------------------------------------

def idefics3_model(shape: SizedShape, tokenizer) -> Idefics3ForConditionalGeneration:
    t, v = shape.text, shape.vision
    config = Idefics3Config(
        vision_config=dict(hidden_size=v.hidden, intermediate_size=v.mlp, num_hidden_layers=v.layers,
                           num_attention_heads=v.heads, image_size=v.image_size, patch_size=v.patch,
                           initializer_range=shape.initializer_range),
        text_config=dict(model_type="llama", vocab_size=t.vocab, hidden_size=t.hidden, intermediate_size=t.mlp,
                         num_hidden_layers=t.layers, num_attention_heads=t.heads, num_key_value_heads=t.kv_heads,
                         head_dim=t.hidden // t.heads, max_position_embeddings=t.max_positions,
                         rope_theta=t.rope_theta, rms_norm_eps=1e-5, initializer_range=shape.initializer_range,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        scale_factor=shape.scale_factor, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False, initializer_range=shape.initializer_range)
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def idefics3_processor(shape: SizedShape, tokenizer) -> Idefics3Processor:
    v = shape.vision
    images = Idefics3ImageProcessorPil(size={"longest_edge": shape.longest_edge},
                                       max_image_size={"longest_edge": v.image_size},
                                       image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    seq_len = (v.image_size // v.patch) ** 2 // shape.scale_factor ** 2
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=seq_len,
                             chat_template=SMOLVLM_CHAT_TEMPLATE)


def make_probe(path: Path, side: int) -> None:
    """One seeded procedural picture, one tile big: gradients and a few discs."""
    rng = np.random.default_rng(SEED)
    yy, xx = np.mgrid[0:side, 0:side]
    img = np.stack([xx * 255 // side, yy * 255 // side, (xx + yy) * 127 // (2 * side)], -1).astype(np.uint8)
    for _ in range(8):
        cy, cx, r = rng.integers(0, side), rng.integers(0, side), rng.integers(side // 20, side // 5)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.integers(0, 256, 3)
    cv2.imwrite(str(path), img[:, :, ::-1])


def idefics3_reference(model, processor, shape: SizedShape, out: Path) -> dict:
    """transformers' greedy answer about probe.png at one tile (the `global` tier)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROBE_PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    image = Image.open(out / "probe.png").convert("RGB")
    inputs = processor(text=[text], images=[[image]], return_tensors="pt",
                       size={"longest_edge": shape.vision.image_size})
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True)
    tokens = generated.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    stopped = bool(tokens) and tokens[-1] == processor.tokenizer.eos_token_id
    # how decisive each greedy step was: a tiny top-2 gap could flip under float noise
    margins = [float(torch.topk(s[0], 2).values.diff().abs()) for s in generated.scores]
    return {"image": "probe.png", "prompt": PROBE_PROMPT, "tier": "global", "max_new_tokens": MAX_NEW_TOKENS,
            "input_ids": inputs["input_ids"][0].tolist(), "tiles": int(inputs["pixel_values"].shape[1]),
            "tokens": tokens[:-1] if stopped else tokens, "finish_reason": "stop" if stopped else "length",
            "min_top2_margin": round(min(margins), 5)}


def build_idefics3(shape: SizedShape, out: Path, progress: bool) -> dict:
    steps = tqdm(total=5, desc="tokenizer", unit="step", disable=not progress)

    def step(name: str) -> None:
        steps.update()
        steps.set_description(name)
    tokenizer = build_tokenizer(shape.text.vocab, progress)
    step("model")
    processor = idefics3_processor(shape, tokenizer)
    model = idefics3_model(shape, processor.tokenizer)
    step("folder")
    save_folder(model, processor, out)
    model.save_pretrained(out)  # model.safetensors: the same weights for transformers (bench/bench_realsize.py)
    make_probe(out / "probe.png", shape.vision.image_size)
    step("onnx export")
    export_graphs(model, out)
    step("reference")
    reference = idefics3_reference(model, processor, shape, out)
    step("done")
    steps.close()
    return {"parameters": sum(p.numel() for p in model.parameters()), "reference": reference}


BUILDERS = {"idefics3": build_idefics3}


# ---- the cache folder -----------------------------------------------------------------------

def folder_name(name: str, layers: int | None, hidden: int | None, vocab: int | None) -> str:
    reductions = [f"{k}{v}" for k, v in (("L", layers), ("H", hidden), ("V", vocab)) if v]
    return "-".join([name, *reductions])


def ensure_model(name: str, out: Path | None = None, layers: int | None = None, hidden: int | None = None,
                 vocab: int | None = None, force: bool = False, progress: bool = True) -> Path:
    """The folder of shape `name` (reduced as asked), built first unless already complete."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    shape = SHAPES[name].reduced(layers, hidden, vocab)
    out = out or CACHE / folder_name(name, layers, hidden, vocab)
    done = out / "build.json"
    if done.is_file() and not force and json.loads(done.read_text()).get("shape") == dataclasses.asdict(shape):
        return out
    done.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    built = BUILDERS[shape.family](shape, out, progress)
    (out / "reference.json").write_text(json.dumps(built.pop("reference"), indent=1) + "\n")
    # written last: its presence means the folder is complete
    done.write_text(json.dumps({"name": name, "shape": dataclasses.asdict(shape), "seed": SEED, **built,
                                "seconds": round(time.perf_counter() - started, 1)}, indent=1) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, help=f"the folder (default {CACHE}/<shape>)")
    ap.add_argument("--layers", type=int, help="reduce: this many text (and at most vision) layers")
    ap.add_argument("--hidden", type=int, help="reduce: this text hidden size (same heads)")
    ap.add_argument("--vocab", type=int, help="reduce: this vocabulary size (added tokens at its end)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the machine may be shared)")
    ap.add_argument("--force", action="store_true", help="rebuild a complete folder")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = ensure_model(args.shape, args.out, args.layers, args.hidden, args.vocab, args.force, not args.quiet)
    info = json.loads((out / "build.json").read_text())
    ref = json.loads((out / "reference.json").read_text())
    print(f"{out}: {info['parameters'] / 1e6:.1f} M parameters; transformers' answer to the probe: "
          f"{len(ref['tokens'])} tokens ({ref['finish_reason']}, min top-2 margin {ref['min_top2_margin']})")


if __name__ == "__main__":
    sys.exit(main())
