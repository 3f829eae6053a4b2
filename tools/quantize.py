#!/usr/bin/env python3
"""Make the `_int8` QDQ variants of a model's graphs, calibrated on generated scenes.

    python tools/quantize.py models/tiny-vlm [--scenes 480] [--method minmax|percentile]
                                             [--keep-float GLOB ...]

Symmetric int8 (zero points 0), per-channel weights, only Conv / MatMul / Gemm
quantized: the explicit-quantization form TensorRT's builder consumes directly
(and that tools/build_engines.py translates to a calibration cache for DLA).
Layers named by --keep-float (default: `quantization: keep_float:` in the model's
model.yaml) stay float: TensorRT runs them in FP16 when it builds with precision flags
(TensorRT 10, JetPack 6: on the GPU and on a DLA core), in FP32 in a strongly typed network.
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
import yaml
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                      QuantType, quantize_static)
from onnxruntime.quantization.qdq_loss_debug import (collect_activations,
                                                     modify_model_output_intermediate_tensors)
from onnxruntime.quantization.shape_inference import quant_pre_process

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemm.config import load_config  # noqa: E402
from edgemm.errors import EdgemmError  # noqa: E402
from edgemm.runtime import Runtime  # noqa: E402
from edgemm.scenes import make_scene, sample_question  # noqa: E402

CALIBRATION_SEED_BASE = 500_000  # disjoint from training (≥ 1e6) and eval (< 1e5) seeds
QUANTIZED_OPS = ["Conv", "MatMul", "Gemm"]
METHODS = ("minmax", "percentile")
PERCENTILE = 99.99  # --method percentile: each range is ±(this percentile of |x|)
SAMPLES_PER_FEED = 4096  # |x| values kept per tensor per calibration input for the percentile


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


def model_keep_float(model_dir: Path) -> list[str]:
    """The model's own choice of layers to leave in float: quantization.keep_float in its
    model.yaml (the layers its INT8 accuracy is most sensitive to; see its model card)."""
    path = model_dir / "model.yaml"
    data = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    keep = ((data or {}).get("quantization") or {}).get("keep_float") or []
    if not isinstance(keep, list) or not all(isinstance(p, str) for p in keep):
        sys.exit(f"error: {path}: quantization.keep_float must be a list of node-name globs")
    return keep


def matching_nodes(path: Path, patterns: list[str]) -> list[str]:
    """Names of the graph's Conv / MatMul / Gemm nodes that match any glob in `patterns`."""
    names = [n.name for n in onnx.load(str(path)).graph.node if n.op_type in QUANTIZED_OPS]
    return [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def percentile_overrides(src: Path, feeds: list[dict], percentile: float, chunk: int = 32) -> dict:
    """onnxruntime TensorQuantOverrides giving every tensor it would calibrate the range
    ±(|x| at `percentile`), pooled over all feeds. onnxruntime's own percentile calibration
    stacks each tensor's values from every feed into one array, so it needs feeds of one
    shape; edgemm's have several (three tiers; prefill and one-token decoder steps)."""
    rng = np.random.default_rng(0)
    pooled: dict[str, list[np.ndarray]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        augmented = Path(tmp) / "augmented.onnx"  # every Conv/MatMul/Gemm float tensor is an output too
        modify_model_output_intermediate_tensors(str(src), str(augmented), QUANTIZED_OPS)
        for start in range(0, len(feeds), chunk):  # a chunk at a time: whole activations are large
            for name, arrays in collect_activations(str(augmented), iter(feeds[start:start + chunk])).items():
                for values in arrays:
                    values = np.abs(values)
                    if values.size > SAMPLES_PER_FEED:
                        values = values[rng.integers(0, values.size, SAMPLES_PER_FEED)]
                    pooled.setdefault(name, []).append(values)
    ranges = {name: float(np.percentile(np.concatenate(parts), percentile)) for name, parts in pooled.items()}
    return {name: [{"rmin": np.float32(-r), "rmax": np.float32(r)}] for name, r in ranges.items() if r > 0}


def quantize_graph(src: Path, dst: Path, feeds: list[dict], method: str, moving_average: bool = False,
                   keep_float: list[str] = (), percentile: float = PERCENTILE) -> list[str]:
    """Quantize `src` into `dst`; the nodes matching `keep_float` stay float. Returns their names."""
    excluded = matching_nodes(src, list(keep_float))
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        # symbolic shape inference gives up on the dynamic image-token axis; onnx shape inference suffices
        quant_pre_process(str(src), str(prepared), skip_symbolic_shape=True)
        # ranges by the prepared graph's tensor names, which its optimisation may have changed
        overrides = percentile_overrides(prepared, feeds, percentile) if method == "percentile" else {}
        quantize_static(
            str(prepared), str(dst), ListReader(feeds), quant_format=QuantFormat.QDQ,
            op_types_to_quantize=QUANTIZED_OPS, nodes_to_exclude=excluded, per_channel=True,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,  # the percentile ranges, if any, override it
            # float bias: TensorRT has no int32 DequantizeLinear for a quantized bias
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                           "QuantizeBias": False, "CalibMovingAverage": moving_average,
                           "TensorQuantOverrides": overrides})
    drop_unused_opsets(dst, ir_version=onnx.load(str(src), load_external_data=False).ir_version)
    onnx.checker.check_model(str(dst))
    return excluded


def drop_unused_opsets(path: Path, ir_version: int | None = None) -> None:
    """ORT's optimiser declares its private domains; keep only those a node uses. The graph
    keeps the IR version of its source (`ir_version`), never a newer one: an onnxruntime
    older than the onnx package (the newest for Python 3.10 reads IR <= 11) refuses a newer IR."""
    model = onnx.load(str(path))
    if ir_version is not None:
        model.ir_version = min(model.ir_version, ir_version)
    used = {n.domain for n in model.graph.node} | {""}
    keep = [o for o in model.opset_import if o.domain in used or o.domain == "ai.onnx"]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    onnx.save(model, str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--scenes", type=int, default=480, help="calibration scenes (spread over tiers)")
    ap.add_argument("--method", choices=METHODS, default="minmax",
                    help="minmax: ranges are the extremes seen; percentile: ±(--percentile of |x|)")
    ap.add_argument("--percentile", type=float, default=PERCENTILE)
    ap.add_argument("--moving-average", action="store_true",
                    help="minmax: average each calibration input's range instead of the extremes over all")
    ap.add_argument("--keep-float", action="append", default=None, metavar="GLOB",
                    help="leave the Conv/MatMul/Gemm nodes whose name matches GLOB in float "
                         "(repeatable; default: quantization.keep_float in the folder's model.yaml, "
                         "if any; --keep-float '' for none)")
    args = ap.parse_args()
    t0 = time.time()
    print(f"calibrating on {args.scenes} generated scenes …", file=sys.stderr)
    try:
        rt, enc_feeds, dec_feeds = collect(args.model_dir, args.scenes)
    except EdgemmError as e:  # no such folder, not a model folder …: one line
        sys.exit(f"error: {e}")
    keep_float = model_keep_float(args.model_dir) if args.keep_float is None else [p for p in args.keep_float if p]
    kept: dict[str, list[str]] = {}
    for name, feeds in (("vision_encoder", enc_feeds), ("decoder", dec_feeds)):
        src = rt.manifest.graph_path(name, "fp32")  # onnx/ in a Hugging Face folder
        dst = src.with_name(f"{src.stem}_int8{src.suffix}")
        print(f"quantizing {src.name} on {len(feeds)} calibration inputs …", file=sys.stderr)
        kept[name] = quantize_graph(src, dst, feeds, args.method, args.moving_average, keep_float,
                                    args.percentile)
    # a lookup table has no Conv/MatMul/Gemm: the int8 variant is the same graph
    embed = rt.manifest.graph_path("embed_tokens", "fp32")
    shutil.copy(embed, embed.with_name(f"{embed.stem}_int8{embed.suffix}"))
    sizes = {p.name: p.stat().st_size for p in sorted(embed.parent.glob("*_int8.onnx"))}
    print(json.dumps({"seconds": round(time.time() - t0, 1), "method": args.method,
                      "moving_average": args.moving_average, "kept_float": kept,
                      "int8_bytes": sizes}, indent=1))


if __name__ == "__main__":
    main()
