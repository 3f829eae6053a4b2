#!/usr/bin/env python3
"""Make the `_int8` QDQ variants of a model's graphs, calibrated on generated scenes.

    python tools/quantize.py models/tiny-vlm [--scenes 96] [--method minmax]

Symmetric int8 (zero points 0), per-channel weights, only Conv / MatMul / Gemm
quantized: the explicit-quantization form TensorRT's builder consumes directly
(and that tools/build_engines.py translates to a calibration cache for DLA).
Calibration runs the fp32 graphs through edgemm's own generation loop, so the
decoder is calibrated on the prefill and KV-cache steps it will really see.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                      QuantType, quantize_static)
from onnxruntime.quantization.shape_inference import quant_pre_process

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemm.config import load_config  # noqa: E402
from edgemm.errors import EdgemmError  # noqa: E402
from edgemm.runtime import Runtime  # noqa: E402
from edgemm.scenes import make_scene, sample_question  # noqa: E402

CALIBRATION_SEED_BASE = 500_000  # disjoint from training (≥ 1e6) and eval (< 1e5) seeds
QUANTIZED_OPS = ["Conv", "MatMul", "Gemm"]
KEEP_FLOAT: list[str] = []
METHODS = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
           "entropy": CalibrationMethod.Entropy}


class Recorder:
    """Wraps a component and keeps a copy of every feed it runs."""

    def __init__(self, component, keep_every: int = 1):
        self.component, self.feeds, self.keep_every, self.calls = component, [], keep_every, 0

    def __getattr__(self, name):
        return getattr(self.component, name)

    def run(self, feeds):
        if self.calls % self.keep_every == 0:
            self.feeds.append({k: np.array(v) for k, v in feeds.items()})
        self.calls += 1
        return self.component.run(feeds)


class ListReader(CalibrationDataReader):
    def __init__(self, feeds: list[dict]):
        self.items = iter(feeds)

    def get_next(self):
        return next(self.items, None)


def collect(model_dir: Path, scenes: int) -> tuple[Runtime, list[dict], list[dict]]:
    """Encoder and decoder feeds from running fp32 on scenes at every tier and task
    (the built-in model's folder or a Hugging Face folder such as SmolVLM's)."""
    rt = Runtime(load_config({"model": {"path": str(model_dir)}, "backend": {"warmup": False},
                              "cache": {"max_bytes": 0}}))
    enc = rt.generator.encoder = Recorder(rt.generator.encoder)
    dec = rt.generator.decoder = Recorder(rt.generator.decoder, keep_every=3)
    rng = np.random.default_rng(CALIBRATION_SEED_BASE)
    tiers = list(rt.manifest.tiers)
    for i in range(scenes):
        scene = make_scene(CALIBRATION_SEED_BASE + i)
        question = sample_question(scene, rng)
        rt.infer(scene.image, question.prompt, tier=tiers[i % len(tiers)])
    return rt, enc.feeds, dec.feeds


def matching_nodes(path: Path, patterns: list[str]) -> list[str]:
    """Names of the graph's Conv / MatMul / Gemm nodes that match any glob in `patterns`."""
    names = [n.name for n in onnx.load(str(path)).graph.node if n.op_type in QUANTIZED_OPS]
    return [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def quantize_graph(src: Path, dst: Path, feeds: list[dict], method: str, moving_average: bool = False,
                   keep_float: list[str] = ()) -> list[str]:
    """Quantize `src` into `dst`; the nodes matching `keep_float` stay float. Returns their names."""
    excluded = matching_nodes(src, list(keep_float))
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        # symbolic shape inference gives up on the dynamic image-token axis; onnx shape inference suffices
        quant_pre_process(str(src), str(prepared), skip_symbolic_shape=True)
        quantize_static(
            str(prepared), str(dst), ListReader(feeds), quant_format=QuantFormat.QDQ,
            op_types_to_quantize=QUANTIZED_OPS, nodes_to_exclude=excluded, per_channel=True,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            calibrate_method=METHODS[method],
            # float bias: TensorRT has no int32 DequantizeLinear for a quantized bias
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                           "QuantizeBias": False, "CalibMovingAverage": moving_average})
    drop_unused_opsets(dst)
    onnx.checker.check_model(str(dst))
    return excluded


def drop_unused_opsets(path: Path) -> None:
    """ORT's optimiser declares its private domains; keep only those a node uses."""
    model = onnx.load(str(path))
    used = {n.domain for n in model.graph.node} | {""}
    keep = [o for o in model.opset_import if o.domain in used or o.domain == "ai.onnx"]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    onnx.save(model, str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--scenes", type=int, default=480, help="calibration scenes (spread over tiers)")
    ap.add_argument("--method", choices=list(METHODS), default="minmax")
    ap.add_argument("--moving-average", action="store_true",
                    help="minmax: average each calibration input's range instead of the extremes over all")
    ap.add_argument("--keep-float", action="append", default=None, metavar="GLOB",
                    help="leave the Conv/MatMul/Gemm nodes whose name matches GLOB in float "
                         "(repeatable; default: KEEP_FLOAT)")
    args = ap.parse_args()
    t0 = time.time()
    print(f"calibrating on {args.scenes} generated scenes …", file=sys.stderr)
    try:
        rt, enc_feeds, dec_feeds = collect(args.model_dir, args.scenes)
    except EdgemmError as e:  # no such folder, not a model folder …: one line
        sys.exit(f"error: {e}")
    keep_float = KEEP_FLOAT if args.keep_float is None else [p for p in args.keep_float if p]
    kept: dict[str, list[str]] = {}
    for name, feeds in (("vision_encoder", enc_feeds), ("decoder", dec_feeds)):
        src = rt.manifest.graph_path(name, "fp32")  # onnx/ in a Hugging Face folder
        dst = src.with_name(f"{src.stem}_int8{src.suffix}")
        print(f"quantizing {src.name} on {len(feeds)} calibration inputs …", file=sys.stderr)
        kept[name] = quantize_graph(src, dst, feeds, args.method, args.moving_average, keep_float)
    # a lookup table has no Conv/MatMul/Gemm: the int8 variant is the same graph
    embed = rt.manifest.graph_path("embed_tokens", "fp32")
    shutil.copy(embed, embed.with_name(f"{embed.stem}_int8{embed.suffix}"))
    sizes = {p.name: p.stat().st_size for p in sorted(embed.parent.glob("*_int8.onnx"))}
    print(json.dumps({"seconds": round(time.time() - t0, 1), "method": args.method,
                      "moving_average": args.moving_average, "kept_float": kept,
                      "int8_bytes": sizes}, indent=1))


if __name__ == "__main__":
    main()
