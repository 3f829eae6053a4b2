#!/usr/bin/env python3
"""How often each precision variant (int8, q4, quantized, fp16 …) answers exactly like FP32,
greedy, same inputs.

    python tools/compare_precisions.py tests/fixtures/idefics3-tiny --n 40
    python tools/compare_precisions.py models/tiny-vlm --n 100 [--precision q4,quantized]

Runs generated scenes with a prompt per scene (all tiers in turn) through both
precisions of the same model folder and prints, as JSON, the share of answers whose
tokens are identical and the mean share of leading tokens that agree, for every variant
in the folder (or those --precision names).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgemm.config import load_config
from edgemm.errors import EdgemmError
from edgemm.engine.runtime import Runtime
from edgemm.model.scenes import PROMPTS, make_scene

SEED_BASE = 480_000  # evaluation range (< 500 000), apart from eval_tiny_vlm's seeds
ASKS = [PROMPTS["describe"][0], PROMPTS["count"][0], PROMPTS["read"][0]]


def runtime(model: Path, precision: str) -> Runtime:
    return Runtime(load_config({"model": {"path": str(model), "precision": precision},
                                "cache": {"max_bytes": 0}, "backend": {"intra_op_threads": 1}}))


def leading_agreement(a: list[int], b: list[int]) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(a), len(b), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--n", type=int, default=40, help="scenes (one prompt each)")
    ap.add_argument("--precision", default="all",
                    help="the variants compared with fp32, comma-separated (default: all in the folder)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()
    try:  # a missing folder or variant: one line (e.g. "… has no int8 graph; make it with …"), exit 1
        reference = runtime(args.model, "fp32")
        names = ([p for p in reference.manifest.precisions if p != "fp32"] if args.precision == "all"
                 else args.precision.split(","))
        variants = {name: runtime(args.model, name) for name in names}
    except EdgemmError as e:
        sys.exit(f"error: {e}")
    if not variants:
        sys.exit(f"error: {args.model} has no variant beside fp32 (precisions: {', '.join(reference.manifest.precisions)})")
    tiers = list(reference.manifest.tiers)
    exact = {name: [] for name in variants}
    leading = {name: [] for name in variants}
    for i in range(args.n):
        image, prompt, tier = make_scene(SEED_BASE + i).image, ASKS[i % len(ASKS)], tiers[i % len(tiers)]
        a = reference.infer(image, prompt, tier=tier, max_new_tokens=args.max_new_tokens).tokens
        for name, variant in variants.items():
            b = variant.infer(image, prompt, tier=tier, max_new_tokens=args.max_new_tokens).tokens
            exact[name].append(a == b)
            leading[name].append(leading_agreement(a, b))
    print(json.dumps({"model": str(args.model), "family": reference.manifest.family, "answers": args.n,
                      "max_new_tokens": args.max_new_tokens,
                      "variants": {name: {"identical_answers": round(sum(exact[name]) / args.n, 4),
                                          "leading_tokens_agreeing": round(sum(leading[name]) / args.n, 4)}
                                   for name in variants}}, indent=1))


if __name__ == "__main__":
    main()
