#!/usr/bin/env python3
"""Accuracy of the exported tiny VLM per task, tier and precision, through onnxruntime.

    python tools/eval_tiny_vlm.py --n 500 --seed 7 --json

Scenes come from seeds below 500 000 (training draws from ≥ 1 000 000, calibration
from 500 000 on), so none was seen in training. Each scene is encoded once per tier
and precision; every question it supports is then answered greedily and scored by
exact match of the normalised answer. Also reports the median encoder time per tier.

With both precisions, `agreement` pairs their answers question by question: the share
int8 answers exactly as fp32 does, and how many only fp32 (or only int8) got right.
That separates a systematic int8 loss from the noise of a few flipped guesses.
`--tiers` and `--tasks` narrow the run, e.g. to look at one cell on many scenes:

    python tools/eval_tiny_vlm.py --n 4000 --seed 20 --tiers low --tasks read --json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent

from edgemm.config import load_config  # noqa: E402
from edgemm.engine.decode import BatchItem, generate  # noqa: E402
from edgemm.engine.generate import GenerationOptions  # noqa: E402
from edgemm.engine.runtime import Runtime  # noqa: E402
from edgemm.model.scenes import TASKS, make_scene, normalise_answer, questions_for  # noqa: E402

EVAL_SEED_LIMIT = 500_000


def scene_seeds(seed: int, n: int) -> range:
    start = seed * 10_000
    if start + n > EVAL_SEED_LIMIT:
        raise SystemExit(f"--seed {seed} with --n {n} reaches seeds ≥ {EVAL_SEED_LIMIT}, "
                         "which calibration uses; pick a smaller seed")
    return range(start, start + n)


def evaluate(rt: Runtime, seeds, tiers: list[str], tasks: tuple[str, ...] = TASKS,
             progress: bool = True, answers: dict | None = None) -> dict:
    """{tier: {task: accuracy, ..., 'encoder_ms_median': x, 'n': {task: count}}}.
    `answers`, if given, collects {(seed, tier, question index): (answer, correct)}."""
    options = GenerationOptions(max_new_tokens=24)
    correct = {t: {task: 0 for task in TASKS} for t in tiers}
    total = {t: {task: 0 for task in TASKS} for t in tiers}
    encode_ms = {t: [] for t in tiers}
    bar = tqdm(seeds, desc=f"eval {rt.precision}", unit="scene", file=sys.stderr, disable=not progress)
    for seed in bar:
        scene = make_scene(seed)
        questions = [q for q in questions_for(scene) if q.task in tasks]
        if not questions:
            continue
        for tier in tiers:
            pixel_values, _ = rt.preprocess(scene.image, tier)
            t0 = time.perf_counter()
            features = rt.generator.encode(pixel_values)
            encode_ms[tier].append((time.perf_counter() - t0) * 1e3)
            for i, q in enumerate(questions):
                prompt = rt.adapter.build_prompt(q.prompt, rt.manifest.tiers[tier])
                gen = generate(rt.generator, BatchItem(features, prompt.input_ids, prompt.image_start, options))
                answer = rt.adapter.decode(gen.tokens)
                total[tier][q.task] += 1
                right = normalise_answer(answer) == normalise_answer(q.answer)
                correct[tier][q.task] += right
                if answers is not None:
                    answers[(seed, tier, i, q.task)] = (normalise_answer(answer), right)
    report = {}
    for tier in tiers:
        report[tier] = {task: round(100 * correct[tier][task] / max(1, total[tier][task]), 2) for task in tasks}
        report[tier]["encoder_ms_median"] = round(statistics.median(encode_ms[tier]), 3)
        report[tier]["n"] = {task: total[tier][task] for task in tasks}
    return report


def agreement(fp32: dict, int8: dict) -> dict:
    """{tier: {task: {'agree': % same answer, 'fp32_only': n right only in fp32, 'int8_only': n,
    'delta': int8 - fp32 accuracy in points, 'delta_se': its standard error}}}.

    The standard error is the paired one (McNemar's): only questions the two precisions
    answer differently move the difference, so it is sqrt(b + c - (b - c)^2 / n) / n."""
    out: dict = {}
    for key, (answer, right) in fp32.items():
        _, tier, _, task = key
        other, other_right = int8[key]
        cell = out.setdefault(tier, {}).setdefault(task, {"agree": 0, "fp32_only": 0, "int8_only": 0, "n": 0})
        cell["n"] += 1
        cell["agree"] += answer == other
        cell["fp32_only"] += right and not other_right
        cell["int8_only"] += other_right and not right
    for cells in out.values():
        for cell in cells.values():
            n, b, c = cell["n"], cell["fp32_only"], cell["int8_only"]
            cell["agree"] = round(100 * cell["agree"] / n, 2)
            cell["delta"] = round(100 * (c - b) / n, 2)
            cell["delta_se"] = round(100 * math.sqrt(max(0.0, b + c - (b - c) ** 2 / n)) / n, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="number of scenes")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-vlm")
    ap.add_argument("--precisions", default="fp32,int8")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    ap.add_argument("--tiers", default=None, help="comma-separated tiers (default: all)")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks (default: all)")
    ap.add_argument("--json", action="store_true", help="print only the JSON report")
    args = ap.parse_args()
    seeds = scene_seeds(args.seed, args.n)
    report = {"model": str(args.model), "n_scenes": args.n, "seed": args.seed, "results": {}}
    tasks = tuple(t for t in args.tasks.split(",") if t)
    if unknown := [t for t in tasks if t not in TASKS]:
        raise SystemExit(f"unknown task(s) {unknown} (tasks: {', '.join(TASKS)})")
    t0 = time.time()
    answers: dict[str, dict] = {}
    for precision in args.precisions.split(","):
        rt = Runtime(load_config({"model": {"path": str(args.model), "precision": precision},
                                  "backend": {"intra_op_threads": args.threads}}))
        tiers = args.tiers.split(",") if args.tiers else list(rt.manifest.tiers)
        if unknown := [t for t in tiers if t not in rt.manifest.tiers]:
            raise SystemExit(f"unknown tier(s) {unknown} (tiers: {', '.join(rt.manifest.tiers)})")
        answers[precision] = {}
        report["results"][precision] = evaluate(rt, seeds, tiers, tasks, answers=answers[precision])
    if "fp32" in answers and "int8" in answers:
        report["agreement"] = agreement(answers["fp32"], answers["int8"])
    for variant in [p for p in answers if p not in ("fp32", "int8")]:  # q4, quantized …: their own pairing
        if "fp32" in answers:  # (the int8_only / int8 names stand for the variant)
            report[f"agreement_{variant}"] = agreement(answers["fp32"], answers[variant])
    report["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(report, indent=1)
    if not args.json:
        for precision, tiers in report["results"].items():
            for tier, row in tiers.items():
                print(f"{precision:5} {tier:5} " + "  ".join(f"{t}={row[t]:5.1f}" for t in tasks)
                      + f"  encoder={row['encoder_ms_median']:.2f} ms", file=sys.stderr)
    print(text)


if __name__ == "__main__":
    main()
