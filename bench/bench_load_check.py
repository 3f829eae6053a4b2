#!/usr/bin/env python3
"""What the load-time image-token check costs (edgemm/engine/contract.py's check_image_tokens).

    python -m bench.bench_load_check [--model DIR ...] [--rounds 5] [--threads 2]

For each model folder (default: the built-in model and every family fixture): the runtime is
loaded once (warm-up off), then the check runs `--rounds` times. Prints one Markdown row per
folder: its tiers, the encoder calls the check makes (0 where the graph fixes the token axis),
the median (min–max) of the check's time, and the load's time beside it (which includes the
check's first, cold run).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from edgemm.config import load_config
from edgemm.engine.contract import check_image_tokens
from edgemm.engine.runtime import Runtime

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = [ROOT / "models" / "tiny-vlm", *sorted((ROOT / "tests" / "fixtures").glob("*-tiny"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", type=Path, help="a model folder (repeatable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print("| model | tiers | encoder calls | check (ms): median (min–max) | load, check included (ms) |")
    print("|---|---|---|---|---|")
    for folder in args.model or DEFAULT_MODELS:
        started = time.perf_counter()
        runtime = Runtime(load_config({"model": {"path": str(folder)},
                                       "backend": {"intra_op_threads": args.threads, "warmup": "none"}}))
        load_ms = (time.perf_counter() - started) * 1e3  # the check's first run included
        times, calls = [], 0
        for _ in range(args.rounds):
            started = time.perf_counter()
            calls = check_image_tokens(runtime.adapter, runtime.manifest, runtime.models.loaded.vision_encoder,
                                       runtime.generator.encode)
            times.append((time.perf_counter() - started) * 1e3)
        print(f"| {folder.name} | {len(runtime.manifest.tiers)} | {calls} | "
              f"{statistics.median(times):.1f} ({min(times):.1f}–{max(times):.1f}) | {load_ms:.0f} |")


if __name__ == "__main__":
    main()
