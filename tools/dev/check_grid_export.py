#!/usr/bin/env python3
"""Does a Qwen2-VL vision_encoder graph really take its grid, or was it frozen at export?

    python -m tools.dev.check_grid_export MODEL_DIR [--precision fp32|int8|fp16]

transformers' vision tower reads the grid with `.tolist()`, so a traced export keeps only
the grid it was traced on: another grid of the same patch count then gives that grid's
features, with no error (README, "Qwen2-VL and Qwen2.5-VL"). This encodes one set of random
patches as a 16x8 grid and as an 8x16 grid: a graph that uses its grid gives different
features; equal features, or a failure on one of them, mean the grid was frozen.
Exit 0: the grid is an input; 1: frozen; 2: not a Qwen2-VL folder or graph.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

GRID_INPUTS = ("grid_thw", "image_grid_thw")
GRIDS = ([1, 16, 8], [1, 8, 16])  # transposed: the same patch count
SAME = 1e-4  # features closer than this are the same


def check(path: Path) -> tuple[bool, str]:
    """(the grid is honoured, why) for one vision_encoder graph."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    grid_name = next((name for name in GRID_INPUTS if name in inputs), None)
    if grid_name is None or "pixel_values" not in inputs:
        raise ValueError(f"{path} declares {', '.join(inputs)}: no pixel_values with grid_thw / image_grid_thw")
    width = inputs["pixel_values"].shape[-1]
    if not isinstance(width, int):
        raise ValueError(f"{path}: pixel_values' last axis is {width!r}, not a patch size")
    dtype = np.float16 if "float16" in inputs["pixel_values"].type else np.float32
    patches = np.random.default_rng(0).standard_normal((int(np.prod(GRIDS[0])), width)).astype(dtype)
    features = []
    for grid in GRIDS:
        try:
            out = session.run(["image_features"], {"pixel_values": patches, grid_name: np.array([grid], np.int64)})
        except Exception as e:  # a graph frozen to another patch count fails here
            return False, f"the graph fails on grid {grid}: {str(e).splitlines()[0]}"
        features.append(out[0].astype(np.float32))
    difference = float(np.abs(features[0] - features[1]).max())
    if difference < SAME:
        return False, f"grids {GRIDS[0]} and {GRIDS[1]} give the same features (max difference {difference:.2g})"
    return True, f"grids {GRIDS[0]} and {GRIDS[1]} give different features (max difference {difference:.3g})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--precision", choices=["fp32", "int8", "fp16"], default="fp32")
    args = ap.parse_args()
    suffix = "" if args.precision == "fp32" else f"_{args.precision}"
    path = args.model_dir / "onnx" / f"vision_encoder{suffix}.onnx"
    if not path.is_file():
        print(f"check_grid_export: {path} does not exist", file=sys.stderr)
        return 2
    try:
        honoured, why = check(path)
    except ValueError as e:
        print(f"check_grid_export: {e}", file=sys.stderr)
        return 2
    print(f"{path}: {'the grid is an input' if honoured else 'the grid is FROZEN'}: {why}")
    return 0 if honoured else 1


if __name__ == "__main__":
    sys.exit(main())
