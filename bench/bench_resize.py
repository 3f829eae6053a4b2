#!/usr/bin/env python3
"""The Pillow-exact resizes (edgemm/model/resample.py) against Pillow itself, on a camera frame.

    OMP_NUM_THREADS=1 python -m bench.bench_resize [--repeats 15] [--frame 1080x1920]

Pillow is not a runtime dependency (the `fixture` extra has it); edgemm resizes in numpy
so that its pixels equal the reference processors' (SmolVLM: Lanczos, Qwen2-VL: bicubic).
Each target size is run alternately by both, `--repeats` times, and the outputs compared
bit for bit; prints the median and min–max ms of each and their ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from PIL import Image

from edgemm.model.families.qwen2_vl import smart_resize
from edgemm.model.resample import resize_bicubic, resize_lanczos

FILTERS = {"bicubic": (resize_bicubic, Image.BICUBIC), "lanczos": (resize_lanczos, Image.LANCZOS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--frame", default="1080x1920", help="HxW of the source frame")
    args = ap.parse_args()
    h, w = (int(v) for v in args.frame.split("x"))
    frame = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    # Qwen2-VL's three budgets (256, 512, 1024 image tokens) on this frame
    targets = [smart_resize(h, w, 28, 3136, tokens * 28 * 28) for tokens in (256, 512, 1024)]
    rows = []
    for name, (ours, pillow_filter) in FILTERS.items():
        for out_h, out_w in targets:
            times: dict[str, list[float]] = {"edgemm": [], "pillow": []}
            for i in range(args.repeats):
                runs = [("edgemm", lambda: ours(frame, out_h, out_w)),
                        ("pillow", lambda: np.asarray(Image.fromarray(frame).resize((out_w, out_h), pillow_filter)))]
                results = {}
                for who, run in runs if i % 2 else runs[::-1]:
                    started = time.perf_counter()
                    results[who] = run()
                    times[who].append((time.perf_counter() - started) * 1e3)
                assert np.array_equal(results["edgemm"], results["pillow"]), (name, out_h, out_w)
            med = {who: statistics.median(ms) for who, ms in times.items()}
            rows.append({"filter": name, "to": f"{out_h}x{out_w}", "edgemm_ms": round(med["edgemm"], 1),
                         "edgemm_range": [round(min(times["edgemm"]), 1), round(max(times["edgemm"]), 1)],
                         "pillow_ms": round(med["pillow"], 1),
                         "pillow_range": [round(min(times["pillow"]), 1), round(max(times["pillow"]), 1)],
                         "ratio": round(med["edgemm"] / med["pillow"], 2)})
    print(json.dumps({"frame": args.frame, "repeats": args.repeats, "rows": rows}, indent=1))
    print()
    print(f"| {args.frame} to | filter | edgemm ms median (min–max) | Pillow ms median (min–max) | edgemm / Pillow |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['to']} | {r['filter']} | {r['edgemm_ms']} ({r['edgemm_range'][0]}–{r['edgemm_range'][1]}) | "
              f"{r['pillow_ms']} ({r['pillow_range'][0]}–{r['pillow_range'][1]}) | {r['ratio']} |")


if __name__ == "__main__":
    main()
