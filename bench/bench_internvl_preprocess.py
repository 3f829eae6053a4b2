#!/usr/bin/env python3
"""InternVL3 preprocessing at real size: edgemm's numpy pixels beside transformers' processors.

    python -m bench.bench_internvl_preprocess [--repeats 7] [--budget 12]
    python -m bench.bench_internvl_preprocess --against REV [--repeats 7] [--calls 3] [--budget 12]

InternVL3's settings (448 x 448 tiles, max_patches 12, ImageNet mean/std); camera-sized
images (VGA, 720p, 1080p) of seeded noise. Per size, one round runs edgemm's
`tile_pixels` (what `edgemm infer` runs on a Jetson, where there is no torch), then
transformers' GotOcr2ImageProcessor (torchvision, the default backend) and
GotOcr2ImageProcessorPil, interleaved so that load on a shared machine falls on all
alike; it prints the median, min and max milliseconds and the ratios as JSON, and checks
that edgemm's pixels equal the torchvision processor's (max |diff|, target <= 1e-6).
One thread everywhere (torch.set_num_threads(1)). Needs the `fixture` extra; the
torchvision column is left out where torchvision does not import.

`--against REV`: this tree's `tile_pixels` beside REV's instead (REV's files taken with
`git archive` into a temporary folder). Each round runs one fresh process per tree, the
two alternating, each timing `--calls` warm calls per size (after a first call, so REV
and this tree both have their imports and any cached weights) and keeping the fastest
(the one least disturbed by other load); it prints per size the median, min and max of
those over the rounds in milliseconds, the ratio, and whether the two trees' pixels are identical
(a SHA-256 of the float32 array). No torch needed.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent

import numpy as np  # noqa: E402

from edgemm.model.families.internvl import normalisation, tile_grid, tile_pixels  # noqa: E402

TILE = 448
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
SIZES = {"vga": (480, 640), "720p": (720, 1280), "1080p": (1080, 1920)}


def processors(budget: int) -> dict:
    import torch
    from PIL import Image
    from transformers import GotOcr2ImageProcessorPil
    torch.set_num_threads(1)
    settings = dict(size={"height": TILE, "width": TILE}, crop_to_patches=True, min_patches=1, max_patches=budget,
                    image_mean=MEAN, image_std=STD)
    pil = GotOcr2ImageProcessorPil(**settings)
    out = {"transformers_pil": lambda rgb: pil(images=[Image.fromarray(rgb)], return_tensors="np")["pixel_values"]}
    try:
        importlib.import_module("torchvision.transforms.v2.functional")
    except Exception:  # missing, or a build that does not match this torch
        return out
    from transformers import GotOcr2ImageProcessor
    fast = GotOcr2ImageProcessor(**settings)
    out["transformers_torchvision"] = lambda rgb: fast(images=[Image.fromarray(rgb)],
                                                       return_tensors="pt")["pixel_values"].numpy()
    return out


ONE_ROUND = """
import hashlib, json, os, time
os.environ["OMP_NUM_THREADS"] = "1"
import numpy as np
from edgemm.model.families.internvl import normalisation, tile_grid, tile_pixels
mean, std = normalisation(%(mean)r, %(std)r, 1 / 255)
rng = np.random.default_rng(0)
out = {}
for name, (h, w) in %(sizes)r.items():
    rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    grid = tile_grid(h, w, (%(tile)d, %(tile)d), 1, %(budget)d)
    tile_pixels(rgb, grid, %(tile)d, mean, std)
    times = []
    for _ in range(%(calls)d):
        started = time.perf_counter()
        pixels = tile_pixels(rgb, grid, %(tile)d, mean, std)
        times.append((time.perf_counter() - started) * 1e3)
    out[name] = [min(times), hashlib.sha256(pixels.tobytes()).hexdigest()]
print(json.dumps(out))
"""


def against(rev: str, repeats: int, budget: int, calls: int) -> dict:
    """This tree's tile_pixels and REV's, one fresh process each per round, alternating."""
    code = ONE_ROUND % {"mean": MEAN, "std": STD, "sizes": SIZES, "tile": TILE, "budget": budget, "calls": calls}
    with tempfile.TemporaryDirectory(prefix="bench-internvl-") as scratch:
        archive = subprocess.run(["git", "archive", rev, "edgemm"], cwd=ROOT, capture_output=True, check=False)
        if archive.returncode:
            raise SystemExit(f"bench_internvl_preprocess: git archive {rev}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", scratch], input=archive.stdout, check=True)
        trees = {"this_tree": ROOT, rev: Path(scratch)}
        runs: dict[str, list[dict]] = {key: [] for key in trees}
        for _ in range(repeats):
            for key, tree in trees.items():
                done = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=False)
                if done.returncode:
                    raise SystemExit(f"bench_internvl_preprocess: the run in {key} failed:\n{done.stderr[-2000:]}")
                runs[key].append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = {"against": rev, "budget": budget, "repeats": repeats, "calls": calls, "sizes": {}}
    for name in SIZES:
        row = {}
        for key in trees:
            times = [run[name][0] for run in runs[key]]
            row[key] = {"median_ms": round(statistics.median(times), 1), "min_ms": round(min(times), 1),
                        "max_ms": round(max(times), 1)}
        row["this_tree_over_rev"] = round(row["this_tree"]["median_ms"] / row[rev]["median_ms"], 2)
        row["identical_pixels"] = len({run[name][1] for key in trees for run in runs[key]}) == 1
        report["sizes"][name] = row
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budget", type=int, default=12, help="max_patches (the tier)")
    ap.add_argument("--against", metavar="REV", help="time this tree beside the git revision REV instead")
    ap.add_argument("--calls", type=int, default=3, help="with --against: warm calls per process, the fastest kept")
    args = ap.parse_args()
    if args.against:
        print(json.dumps(against(args.against, args.repeats, args.budget, args.calls), indent=1))
        return
    mean, std = normalisation(MEAN, STD, 1 / 255)
    theirs = processors(args.budget)
    rng = np.random.default_rng(0)
    report = {"budget": args.budget, "repeats": args.repeats, "sizes": {}}
    for name, (h, w) in SIZES.items():
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        grid = tile_grid(h, w, (TILE, TILE), 1, args.budget)
        runs = {"edgemm": lambda: tile_pixels(rgb, grid, TILE, mean, std),
                **{k: (lambda f=f: f(rgb)) for k, f in theirs.items()}}
        times: dict[str, list[float]] = {k: [] for k in runs}
        outputs = {}
        for _ in range(args.repeats):
            for key, run in runs.items():
                started = time.perf_counter()
                outputs[key] = run()
                times[key].append((time.perf_counter() - started) * 1e3)
        row = {"grid": list(grid), "tiles": int(outputs["edgemm"].shape[1]),
               **{k: {"median_ms": round(statistics.median(v), 1), "min_ms": round(min(v), 1),
                      "max_ms": round(max(v), 1)} for k, v in times.items()}}
        for key in theirs:
            row[f"{key}_over_edgemm"] = round(statistics.median(times[key]) / statistics.median(times["edgemm"]), 2)
            row[f"{key}_max_abs_diff"] = float(np.abs(outputs[key] - outputs["edgemm"][0]).max())
        report["sizes"][name] = row
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
