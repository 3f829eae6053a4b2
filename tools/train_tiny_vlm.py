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
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

ROOT = Path(__file__).resolve().parent.parent

try:
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm
except ImportError as missing:  # the runtime's install has no torch: name the extra, not a traceback
    from extras import missing_extra
    missing_extra(__file__, "train", missing)


from edgemm.model.preprocess import to_pixel_values  # noqa: E402
from edgemm.model.scenes import (COLOURS, PROMPTS, SHAPES, TASKS, Question, make_scene,  # noqa: E402
                           sample_question, vocabulary)  # noqa: E402
from tiny_vlm_model import (AuxHeads, TinyVLM, TinyVLMConfig, calibrate_tier_norms,  # noqa: E402
                            count_parameters)

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<image>", "<answer>"]
TIERS = {"low": 96, "mid": 192, "high": 256}
TIER_WEIGHTS = {"low": 0.30, "mid": 0.27, "high": 0.43}
TASK_WEIGHTS = {"describe": 0.30, "count": 0.15, "colour": 0.20, "read": 0.35}  # eval batches
QUESTION_WEIGHTS = {"describe": 1.5, "count": 1.0, "colour": 1.0, "read": 1.5}  # loss per question
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


def pad_sequences(seqs: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs (each sequence minus its last id) and targets: the next id inside
    the answer (from `start` on), -100 elsewhere."""
    length = max(map(len, seqs))
    inp = torch.zeros(len(seqs), length - 1, dtype=torch.long)
    tgt = torch.full((len(seqs), length - 1), -100, dtype=torch.long)
    for i, (ids, start) in enumerate(zip(seqs, starts)):
        ids_t = torch.tensor(ids)
        inp[i, : len(ids) - 1] = ids_t[:-1]
        tgt[i, start - 1: len(ids) - 1] = ids_t[start:]
    return inp, tgt


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
    inp, tgt = pad_sequences(seqs, starts)
    return torch.from_numpy(np.stack(pixels)), inp, tgt, torch.from_numpy(np.stack(aux)), tasks


def make_multi_batch(tok: Tokenizer, rng: np.random.Generator, batch: int, side: int,
                     cfg: TinyVLMConfig, text_probability: float):
    """`batch` scenes and every question each supports (describe, count, the colour of each
    unique kind, read — `no text` when there is none), for `forward_shared_prefix`:
    pixel_values, suffix input ids, target ids, owner (question → scene row), per-question
    task weights, aux targets."""
    eos, answer = tok.token_to_id("<eos>"), tok.token_to_id("<answer>")
    pixels, seqs, starts, owner, weights, aux, grounding = [], [], [], [], [], [], []
    grid = side // cfg.patch
    for row in range(batch):
        scene = make_scene(int(rng.integers(TRAIN_SEED_BASE, 2**31)), text_probability=text_probability)
        pixels.append(to_pixel_values(scene.image, side, side, MEAN, STD)[0])
        aux.append(aux_targets(scene, side // cfg.patch))
        questions = [sample_question(scene, rng, t) for t in ("describe", "count", "read")]
        for kind in scene.unique_kinds():  # the colour of every unique kind
            phrasing = PROMPTS["colour"][int(rng.integers(len(PROMPTS["colour"])))]
            questions.append(Question("colour", phrasing.format(shape=kind), scene.colour_of(kind), {"shape": kind}))
        for q in questions:
            ids = prompt_ids(tok, q.prompt) + [answer]
            for offset, cell in grounding_targets(scene, q, grid):  # input index start-1+offset
                grounding.append((len(seqs), len(ids) - 1 + offset, 1 + cell))  # key 0 is <bos>
            starts.append(len(ids))
            seqs.append(ids + prompt_ids(tok, q.answer) + [eos])
            owner.append(row)
            weights.append(QUESTION_WEIGHTS[q.task])
    inp, tgt = pad_sequences(seqs, starts)
    return (torch.from_numpy(np.stack(pixels)), inp, tgt, torch.tensor(owner),
            torch.tensor(weights), torch.from_numpy(np.stack(aux)),
            torch.tensor(grounding, dtype=torch.long).reshape(-1, 3))


def _cell(scene, x: float, y: float, grid: int) -> int:
    cell = scene.image.shape[0] / grid
    return int(y // cell) * grid + int(x // cell)


def grounding_targets(scene, q, grid: int) -> list[tuple[int, int]]:
    """(answer offset, image cell) pairs: the token at offset k of the answer (0 = the first
    answer token) should be predicted while looking at that cell. Colour: the asked shape;
    describe: each shape, left to right, for its article, colour and kind; read: the label."""
    if q.task == "colour":
        shape = next(s for s in scene.shapes if s.kind == q.meta["shape"])
        return [(0, _cell(scene, shape.cx, shape.cy, grid))]
    if q.task == "describe":
        words = q.answer.split()
        articles = [i for i, w in enumerate(words) if w in ("a", "an")]
        shapes = sorted(scene.shapes, key=lambda s: s.cx)
        out = []
        for i, shape in zip(articles, shapes):
            cell = _cell(scene, shape.cx, shape.cy, grid)
            out += [(i, cell), (i + 1, cell), (i + 2, cell)]  # predicting the article, colour and kind
        return out
    if q.task == "read" and scene.text:
        x, y, w, h = scene.text_box
        cell = _cell(scene, x + w / 2, y + h / 2, grid)
        return [(k, cell) for k in range(len(scene.text))]
    return []


def grounding_loss(attention: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log of the attention head 0 pays to the target cell, at each target position.
    Teaches the decoder where to look (which image token answers this word) directly,
    instead of waiting for the two-hop circuit to emerge from the answer loss alone."""
    if targets.numel() == 0:
        return attention.new_zeros(())
    p = attention[targets[:, 0], 0, targets[:, 1], targets[:, 2]]
    return -(p + 1e-6).log().mean()


def question_loss(logits: torch.Tensor, tgt: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over questions of each answer's mean token loss: a 20-word description
    does not outweigh a one-word colour."""
    per_token = F.cross_entropy(logits.transpose(1, 2), tgt, ignore_index=-100, reduction="none")
    n = (tgt != -100).sum(1).clamp(min=1)
    return ((per_token.sum(1) / n) * weights).sum() / weights.sum()


NORM_SEED_BASE = 600_000  # scenes for the per-tier normalisation statistics (not eval, not training)


def tier_norm_batches(batches: int = 8, batch: int = 24) -> dict[int, list[torch.Tensor]]:
    """Pixel batches per tier index for `calibrate_tier_norms` (same scenes at every tier)."""
    scenes = [make_scene(NORM_SEED_BASE + i).image for i in range(batches * batch)]
    return {t: [torch.from_numpy(np.stack([to_pixel_values(img, side, side, MEAN, STD)[0]
                                           for img in scenes[b * batch:(b + 1) * batch]]))
                for b in range(batches)]
            for t, side in enumerate(TIERS.values())}


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
    ap.add_argument("--steps", type=int, default=3400, help="length of the learning-rate schedule")
    ap.add_argument("--stop-at", type=int, default=0,
                    help="end early here (with a checkpoint; 0 = run the whole schedule); the schedule still spans --steps")
    ap.add_argument("--batch", type=int, default=24, help="scenes per step; each brings all its questions")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "tiny-vlm")
    ap.add_argument("--eval-every", type=int, default=400)
    ap.add_argument("--encoder-warmup", type=int, default=150,
                    help="first steps train the encoder alone on the auxiliary targets")
    ap.add_argument("--text-probability", type=float, default=0.65,
                    help="share of training scenes with a text label (the generator's default is 0.5)")
    ap.add_argument("--grounding-weight", type=float, default=0.3,
                    help="weight of the decoder's grounding loss (where head 0 of layer 1 looks)")
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
    warmup = min(args.encoder_warmup + 150, args.steps // 5 + 1)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.03 + 0.97 * 0.5 * (1 + math.cos(math.pi * progress)))

    log = {"command": " ".join(sys.argv), "config": cfg.to_dict(), "seed": args.seed,
           "steps": args.steps, "batch": args.batch, "evals": []}
    tier_names, tier_p = list(TIER_WEIGHTS), list(TIER_WEIGHTS.values())
    bos_id = tok.token_to_id("<bos>")
    norm_batches = tier_norm_batches()
    t0 = time.time()
    stop = min(args.stop_at or args.steps, args.steps)
    bar = tqdm(range(stop), desc="train", unit="step", file=sys.stderr)
    ema = None
    for step in bar:
        rng = np.random.default_rng([args.seed, step])
        side = TIERS[str(rng.choice(tier_names, p=tier_p))]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        if step < args.encoder_warmup:
            # the encoder alone first, on its dense targets (cheap: no decoder): the decoder
            # then starts from features that already hold colour, kind and digits
            px, _, _, _, _, aux, _ = make_multi_batch(tok, rng, args.batch, side, cfg, args.text_probability)
            loss = aux_heads.loss(model.encoder(px), aux)
        else:
            px, inp, tgt, owner, weights, aux, grounding = make_multi_batch(
                tok, rng, args.batch, side, cfg, args.text_probability)
            logits, feats, attention = model.forward_shared_prefix(px, bos_id, inp, owner, record=True)
            loss = (question_loss(logits, tgt, weights) + args.aux_weight * aux_heads.loss(feats, aux)
                    + args.grounding_weight * grounding_loss(attention, grounding))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", side=side)
        last = step == stop - 1
        if (step + 1) % args.eval_every == 0 or last:
            calibrate_tier_norms(model.encoder, norm_batches)
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
