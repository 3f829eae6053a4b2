#!/usr/bin/env python3
"""Train the built-in tiny VLM from generated scenes (CPU, seeded, one command).

    python tools/train_tiny_vlm.py                 # full recipe → build/tiny-vlm/
    python tools/train_tiny_vlm.py --steps 50      # smoke run

Every batch is generated on the fly from (seed, step), so a run is reproducible
and no data set is stored. Writes build/tiny-vlm/{checkpoint.pt,tokenizer.json,
train_log.json}; `tools/export_tiny_vlm.py` turns that into models/tiny-vlm/.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from edgemm.model.preprocess import to_pixel_values  # noqa: E402
from edgemm.scenes import COLOURS, SHAPES, TASKS, make_scene, sample_question, vocabulary  # noqa: E402
from tiny_vlm_model import AuxHeads, TinyVLM, TinyVLMConfig, count_parameters  # noqa: E402

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<image>", "<answer>"]
TIERS = {"low": 128, "mid": 192, "high": 256}
TIER_WEIGHTS = {"low": 0.25, "mid": 0.30, "high": 0.45}
TASK_WEIGHTS = {"describe": 0.30, "count": 0.15, "colour": 0.20, "read": 0.35}
MEAN = STD = (0.5, 0.5, 0.5)
TRAIN_SEED_BASE = 1_000_000  # training scenes use seeds ≥ this; eval uses small seeds


def build_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # "colour" → "color": the vocabulary has one spelling, users type both
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(),
                                           normalizers.Replace("colour", "color")])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def prompt_ids(tok: Tokenizer, prompt: str) -> list[int]:
    return tok.encode(prompt.replace("colour", "color"), add_special_tokens=False).ids


def aux_targets(scene, grid: int) -> np.ndarray:
    """Per image token: [colour+1, kind+1, digit1+1, digit2+1, digit3+1] of what is centred
    in its cell (0 = nothing). Dense supervision that teaches the encoder to see."""
    t = np.zeros((grid, grid, 5), np.int64)
    cell = scene.image.shape[0] / grid
    for shape in scene.shapes:
        r, c = int(shape.cy // cell), int(shape.cx // cell)
        t[r, c, 0] = list(COLOURS).index(shape.colour) + 1
        t[r, c, 1] = SHAPES.index(shape.kind) + 1
    if scene.text:
        x, y, w, h = scene.text_box
        r, c = int((y + h / 2) // cell), int((x + w / 2) // cell)
        t[r, c, 2:] = [int(d) + 1 for d in scene.text]
    return t.reshape(grid * grid, 5)


def make_batch(tok: Tokenizer, rng: np.random.Generator, batch: int, side: int,
               cfg: TinyVLMConfig, task: str | None = None):
    """pixel_values, input ids, target ids (-100 outside the answer), aux targets, tasks."""
    n_image = (side // cfg.patch) ** 2
    bos, eos, image, answer = (tok.token_to_id(t) for t in ("<bos>", "<eos>", "<image>", "<answer>"))
    pixels, seqs, starts, tasks, aux = [], [], [], [], []
    for _ in range(batch):
        scene = make_scene(int(rng.integers(TRAIN_SEED_BASE, 2**31)))
        t = task or str(rng.choice(list(TASK_WEIGHTS), p=list(TASK_WEIGHTS.values())))
        q = sample_question(scene, rng, t)
        pixels.append(to_pixel_values(scene.image, side, side, MEAN, STD)[0])
        ids = [bos] + [image] * n_image + prompt_ids(tok, q.prompt) + [answer]
        starts.append(len(ids))
        seqs.append(ids + prompt_ids(tok, q.answer) + [eos])
        tasks.append(q.task)
        aux.append(aux_targets(scene, side // cfg.patch))
    length = max(map(len, seqs))
    inp = torch.zeros(batch, length - 1, dtype=torch.long)
    tgt = torch.full((batch, length - 1), -100, dtype=torch.long)
    for i, (ids, start) in enumerate(zip(seqs, starts)):
        ids_t = torch.tensor(ids)
        inp[i, : len(ids) - 1] = ids_t[:-1]
        tgt[i, start - 1: len(ids) - 1] = ids_t[start:]
    return torch.from_numpy(np.stack(pixels)), inp, tgt, torch.from_numpy(np.stack(aux)), tasks


@torch.no_grad()
def exact_match(model: TinyVLM, tok, cfg, side: int, n: int, seed: int) -> dict[str, float]:
    """Teacher-forced exact match per task: all answer tokens are the argmax,
    which is exactly when greedy decoding reproduces the answer."""
    model.eval()
    out = {}
    for task in TASKS:
        rng = np.random.default_rng(seed)
        px, inp, tgt, _, _ = make_batch(tok, rng, n, side, cfg, task)
        pred = model(px, inp).argmax(-1)
        ok = ((pred == tgt) | (tgt == -100)).all(dim=1)
        out[task] = round(ok.float().mean().item(), 3)
    model.train()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "tiny-vlm")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--aux-weight", type=float, default=0.5, help="weight of the encoder's dense auxiliary loss")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(args.out / "tokenizer.json"))
    cfg = TinyVLMConfig(vocab_size=tok.get_vocab_size())
    model = TinyVLM(cfg)
    aux_heads = AuxHeads(cfg.dim, len(COLOURS) + 1, len(SHAPES) + 1)  # training only, not exported
    print(f"parameters: {count_parameters(model):,}", file=sys.stderr)

    named = list(model.named_parameters()) + list(aux_heads.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in named if p.ndim < 2 or "pos" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))
    warmup = min(200, args.steps // 10 + 1)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.03 + 0.97 * 0.5 * (1 + math.cos(math.pi * progress)))

    log = {"command": " ".join(sys.argv), "config": cfg.to_dict(), "seed": args.seed,
           "steps": args.steps, "batch": args.batch, "evals": []}
    tier_names, tier_p = list(TIER_WEIGHTS), list(TIER_WEIGHTS.values())
    t0 = time.time()
    bar = tqdm(range(args.steps), desc="train", unit="step", file=sys.stderr)
    ema = None
    for step in bar:
        rng = np.random.default_rng([args.seed, step])
        side = TIERS[str(rng.choice(tier_names, p=tier_p))]
        px, inp, tgt, aux, _ = make_batch(tok, rng, args.batch, side, cfg)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits, feats = model(px, inp, return_features=True)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
        loss = loss + args.aux_weight * aux_heads.loss(feats, aux)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", side=side)
        last = step == args.steps - 1
        if (step + 1) % args.eval_every == 0 or last:
            evals = {name: exact_match(model, tok, cfg, s, 64, seed=7) for name, s in TIERS.items()}
            entry = {"step": step + 1, "loss": round(ema, 4), "minutes": round((time.time() - t0) / 60, 1),
                     "exact_match": evals}
            log["evals"].append(entry)
            tqdm.write(json.dumps(entry), file=sys.stderr)
            torch.save({"config": cfg.to_dict(), "state_dict": model.state_dict(), "step": step + 1},
                       args.out / "checkpoint.pt")
    log["wall_minutes"] = round((time.time() - t0) / 60, 1)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"done in {log['wall_minutes']} min → {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
