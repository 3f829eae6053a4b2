#!/usr/bin/env python3
"""Time and peak memory of edgemm's Pillow-exact resizes on the images that cost the most.

    python -m bench.bench_resize_limits [--repeat 3] [--baseline REV]

Each case runs in a fresh child process (its peak RSS is then the case's own, the input
image included), the cases interleaved round by round; prints, as JSON, the median and
min-max seconds and the peak RSS per case. The cases: a photo-sized square and the
longest strips edgemm accepts (limits.max_pixels, 25 MP) through Gemma 3's stretch
(bilinear to 896) and SmolVLM's first resize (Lanczos to 2048), and a strip through
LLaVA's shortest-edge resize to 336 with its centre crop (the window of the resize alone).
`--baseline REV` also runs edgemm/model/resample.py as it was at git revision REV, in the
same rounds, on the cases small enough for it (a 5 MP strip: the older code holds all the
weights at once, several GB at 25 MP), and prints the ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = {  # name → (input h, w, output h, w, filter, output window or None)
    "5000x5000 → 896 bilinear (gemma3)": (5000, 5000, 896, 896, 2, None),
    "5000x5000 → 2048 Lanczos (idefics3's first resize)": (5000, 5000, 2048, 2048, 1, None),
    "1x5M strip → 2048x1 Lanczos (idefics3's first resize)": (1, 5_000_000, 1, 2048, 1, None),
    "1x25M strip → 896 bilinear (gemma3)": (1, 25_000_000, 896, 896, 2, None),
    "1x25M strip → 2048x1 Lanczos": (1, 25_000_000, 1, 2048, 1, None),
    "2x12.5M strip → 336 crop of 336x2.1G bicubic (llava)": (2, 12_500_000, 336, 2_100_000_000, 3,
                                                                 ((0, 336), (1_049_999_832, 1_050_000_168))),
}
# the baseline (before this tool) had Lanczos only
BASELINE_CASES = ("5000x5000 → 2048 Lanczos (idefics3's first resize)",
                  "1x5M strip → 2048x1 Lanczos (idefics3's first resize)")

CHILD = """
import importlib.util, json, resource, sys, time
import numpy as np
h, w, oh, ow, f, window = json.loads(sys.argv[1])
if len(sys.argv) > 2:  # the baseline's resample.py (Lanczos only: resize_lanczos)
    spec = importlib.util.spec_from_file_location("baseline_resample", sys.argv[2])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    resize = lambda rgb: module.resize_lanczos(rgb, oh, ow)
else:
    from edgemm.model.resample import resize_pil
    resize = lambda rgb: resize_pil(rgb, oh, ow, f, *(window or ()))
rgb = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
start = time.perf_counter()
resize(rgb)
print(json.dumps({"s": time.perf_counter() - start, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def summary(rs: list[dict]) -> dict:
    return {"median_s": round(statistics.median(r["s"] for r in rs), 3),
            "min_max_s": [round(min(r["s"] for r in rs), 3), round(max(r["s"] for r in rs), 3)],
            "peak_rss_mb": round(max(r["peak_mb"] for r in rs))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", metavar="REV", help="also run edgemm/model/resample.py of this git revision")
    args = ap.parse_args()
    jobs = [(name, None) for name in CASES]
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            old = Path(tmp) / "baseline_resample.py"
            old.write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{args.baseline}:edgemm/model/resample.py"],
                                          check=True, capture_output=True, text=True).stdout)
            jobs += [(name, str(old)) for name in BASELINE_CASES]
        runs: dict[tuple, list[dict]] = {job: [] for job in jobs}
        for _ in range(args.repeat):  # round by round, so machine noise spreads over every case
            for name, baseline in jobs:
                # -c from the repository root: this tree's edgemm is first on the path
                out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES[name]), *([baseline] if baseline else [])],
                                     check=True, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""},
                                     cwd=ROOT)
                runs[(name, baseline)].append(json.loads(out.stdout))
    report = {name: summary(runs[(name, None)]) for name in CASES}
    for name, baseline in jobs:
        if baseline:
            old = report[f"{name} [{args.baseline}]"] = summary(runs[(name, baseline)])
            report[name]["time_ratio_to_baseline"] = round(report[name]["median_s"] / old["median_s"], 2)
            report[name]["peak_ratio_to_baseline"] = round(report[name]["peak_rss_mb"] / old["peak_rss_mb"], 2)
    print(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    sys.exit(main())
