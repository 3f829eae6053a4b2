#!/usr/bin/env python3
"""Accuracy of the exported tiny VLM per task, tier and precision, through onnxruntime.

    python tools/eval_tiny_vlm.py --n 500 --seed 7 --json

Scenes come from seeds below 500 000 (training draws from ≥ 1 000 000, calibration
from 500 000 on), so none was seen in training. Each scene is encoded once per tier
and precision; every question it supports is then answered greedily and scored by
exact match of the normalised answer. Also reports the median encoder time per tier.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemm.config import load_config  # noqa: E402
from edgemm.generate import GenerationOptions  # noqa: E402
from edgemm.runtime import Runtime  # noqa: E402
from edgemm.scenes import TASKS, make_scene, normalise_answer, questions_for  # noqa: E402

EVAL_SEED_LIMIT = 500_000


def scene_seeds(seed: int, n: int) -> range:
    start = seed * 10_000
    if start + n > EVAL_SEED_LIMIT:
        raise SystemExit(f"--seed {seed} with --n {n} reaches seeds ≥ {EVAL_SEED_LIMIT}, "
                         "which calibration uses; pick a smaller seed")
    return range(start, start + n)


def evaluate(rt: Runtime, seeds, tiers: list[str], progress: bool = True) -> dict:
    """{tier: {task: accuracy, ..., 'encoder_ms_median': x, 'n': {task: count}}}"""
    options = GenerationOptions(max_new_tokens=24)
    correct = {t: {task: 0 for task in TASKS} for t in tiers}
    total = {t: {task: 0 for task in TASKS} for t in tiers}
    encode_ms = {t: [] for t in tiers}
    bar = tqdm(seeds, desc=f"eval {rt.precision}", unit="scene", file=sys.stderr, disable=not progress)
    for seed in bar:
        scene = make_scene(seed)
        questions = questions_for(scene)
        for tier in tiers:
            pixel_values, _ = rt.preprocess(scene.image, tier)
            t0 = time.perf_counter()
            features = rt.generator.encode(pixel_values)
            encode_ms[tier].append((time.perf_counter() - t0) * 1e3)
            for q in questions:
                prompt = rt.adapter.build_prompt(q.prompt, rt.manifest.tiers[tier])
                gen = rt.generator.generate(features, prompt.input_ids, prompt.image_start, options)
                answer = rt.adapter.decode(gen.tokens)
                total[tier][q.task] += 1
                correct[tier][q.task] += normalise_answer(answer) == normalise_answer(q.answer)
    report = {}
    for tier in tiers:
        report[tier] = {task: round(100 * correct[tier][task] / max(1, total[tier][task]), 2) for task in TASKS}
        report[tier]["encoder_ms_median"] = round(statistics.median(encode_ms[tier]), 3)
        report[tier]["n"] = total[tier]
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="number of scenes")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-vlm")
    ap.add_argument("--precisions", default="fp32,int8")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    ap.add_argument("--json", action="store_true", help="print only the JSON report")
    args = ap.parse_args()
    seeds = scene_seeds(args.seed, args.n)
    report = {"model": str(args.model), "n_scenes": args.n, "seed": args.seed, "results": {}}
    t0 = time.time()
    for precision in args.precisions.split(","):
        rt = Runtime(load_config({"model": {"path": str(args.model), "precision": precision},
                                  "backend": {"intra_op_threads": args.threads}}))
        report["results"][precision] = evaluate(rt, seeds, list(rt.manifest.tiers))
    report["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(report, indent=1)
    if not args.json:
        for precision, tiers in report["results"].items():
            for tier, row in tiers.items():
                print(f"{precision:5} {tier:5} " + "  ".join(f"{t}={row[t]:5.1f}" for t in TASKS)
                      + f"  encoder={row['encoder_ms_median']:.2f} ms", file=sys.stderr)
    print(text)


if __name__ == "__main__":
    main()
