#!/usr/bin/env python3
"""Make a precision variant of a model's graphs: QDQ int8 for TensorRT, or a CPU variant.

    python tools/quantize.py models/tiny-vlm [--scenes N] [--method minmax|percentile]
                                             [--keep-float GLOB ...]          # _int8 (QDQ)
    python tools/quantize.py MODEL --variant q4           # weight-only 4-bit MatMulNBits
    python tools/quantize.py MODEL --variant quantized    # dynamic int8 (quantize_dynamic)
    python tools/quantize.py MODEL --variant q4f16 | fp16

`--variant` names the file suffix of the Hugging Face ONNX layout the result is written
under (decoder_model_merged_q4.onnx …). The CPU variants need no calibration:

  q4         onnxruntime's MatMulNBitsQuantizer: every MatMul with a constant weight becomes a
             4-bit block-quantized MatMulNBits (block 32, symmetric, accuracy level 4: int8
             activations inside the kernel). Fewest bytes per token: the fastest decode on a CPU.
  quantized  onnxruntime's quantize_dynamic: int8 weights (per tensor), activations quantized
             at run time; MatMul only (ConvInteger is slower than a float Conv on a CPU).
  q4f16      float16 graph (onnxruntime.transformers.float16) then q4: for GPUs; slow on a CPU.
  fp16       float16 graph with float32 inputs and outputs kept.
  int8       (the default) QDQ, calibrated as below: what TensorRT builds from. On onnxruntime's
             CPU provider it is slower than fp32 (DequantizeLinear on every step).

For `int8`:
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
import collections
import fnmatch
import json
import logging
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import yaml
from onnx import helper, numpy_helper
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                      QuantType, quantize_dynamic, quantize_static)
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

logging.getLogger().setLevel(logging.WARNING)  # the quantizers log every node at INFO
logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
from onnxruntime.quantization.calibrate import CalibraterBase
from onnxruntime.quantization.shape_inference import quant_pre_process

from edgemm.config import load_config
from edgemm.errors import EdgemmError
from edgemm.model.manifest import COMPONENTS, load_manifest
from edgemm.engine.runtime import Runtime
from edgemm.model.scenes import make_scene, sample_question

CALIBRATION_SEED_BASE = 500_000  # disjoint from training (≥ 1e6) and eval (< 1e5) seeds
QUANTIZED_OPS = ["Conv", "MatMul", "Gemm"]
METHODS = ("minmax", "percentile")
VARIANTS = ("int8", "q4", "q4f16", "quantized", "fp16")  # --variant: the file suffix written
Q4_BLOCK = 32  # weights per 4-bit block (one scale each): onnxruntime's and transformers.js' q4 choice
Q4_ACCURACY_LEVEL = 4  # MatMulNBits computes with int8 activations: the fast CPU kernel
MOVING_AVERAGE = 0.01  # --moving-average: onnxruntime's calibrator's averaging constant
REDUCTION = "edgemm_calibration"  # the prefix of the reduction nodes' names and outputs
SAMPLE_INPUT = f"{REDUCTION}/uniform"  # --method percentile: the draws that pick each input's samples
SMALL_MODEL_BYTES = 64 << 20  # fp32 graphs under this: the default --scenes is SMALL_MODEL_SCENES
SMALL_MODEL_SCENES = 480  # the built-in model's shipped _int8 was calibrated on these
LARGE_MODEL_SCENES = 6  # a real-size model: every tier twice (docs/BENCHMARKS.md has the cost)
PERCENTILE = 99.99  # --method percentile: each range is ±(this percentile of |x|)
PROGRESS_EVERY_S = 1.0  # the progress line is rewritten at most this often within a scene
SAMPLES_PER_FEED = 4096  # |x| values kept per tensor per calibration input for the percentile


def one_tile_each(feeds: dict) -> list[dict]:
    """A tiled encoder's feed [B,T,3,H,W] as B·T feeds of one tile, in order (else [feeds]):
    the tiles are independent images, and at real size one call's activations for 17 tiles
    are gigabytes (a single SigLIP tile's attention alone is [12, 1024, 1024])."""
    pixels = feeds.get("pixel_values")
    if pixels is None or pixels.ndim != 5 or pixels.shape[0] * pixels.shape[1] == 1:
        return [feeds]
    mask = feeds.get("pixel_attention_mask")
    tiles = []
    for b in range(pixels.shape[0]):
        for t in range(pixels.shape[1]):
            tile = {"pixel_values": pixels[b:b + 1, t:t + 1]}
            if mask is not None:
                tile["pixel_attention_mask"] = mask[b:b + 1, t:t + 1]
            tiles.append(tile)
    return tiles


class Recorder:
    """Wraps a component: hands a copy of every `keep_every`-th input it runs to `keep` (if
    any), and runs a tiled encoder feed one tile at a time (one_tile_each), its outputs
    joined on the batch axis as the tiled call returns them ([B·T, n, D], or a shape the
    generator reshapes from that order), so the fp32 graphs making the feeds never hold
    more than one tile's activations either."""

    def __init__(self, component, keep=None, keep_every: int = 1):
        self.component, self.keep, self.keep_every, self.calls = component, keep, keep_every, 0

    def __getattr__(self, name):
        return getattr(self.component, name)

    def run(self, feeds):
        parts = one_tile_each(feeds)
        if self.keep is not None and self.calls % self.keep_every == 0:
            for part in parts:
                self.keep({k: np.array(v) for k, v in part.items()})
        self.calls += 1
        if len(parts) == 1:
            return self.component.run(feeds)
        outputs = [self.component.run(part) for part in parts]
        return {name: np.concatenate([o[name] for o in outputs]) for name in outputs[0]}


class SceneFeeds:
    """The feeds one component runs while the fp32 graphs answer generated scenes, scene by
    scene as they are asked for: only one scene's feeds are held at a time, never all of them.
    Scenes go round the tiers and a question each; the decoder keeps every third step of
    their answers (the encoder's pass only encodes, never answers). A tiled encoder's feed is
    one tile per input (Recorder)."""

    def __init__(self, rt: Runtime, component: str, scenes: int):
        self.rt, self.component, self.scenes = rt, component, scenes
        self.pending: collections.deque[dict] = collections.deque()
        self.count = 0
        self.shown = 0.0  # when the progress line was last written

    def __iter__(self):
        rng = np.random.default_rng(CALIBRATION_SEED_BASE)
        tiers = list(self.rt.manifest.tiers)
        generator = self.rt.generator
        encoder, decoder = generator.encoder, generator.decoder
        if self.component == "vision_encoder":
            generator.encoder = Recorder(encoder, self.pending.append)
        else:  # the encoder still one tile at a time
            generator.encoder, generator.decoder = Recorder(encoder), Recorder(decoder, self.pending.append, 3)
        started = time.perf_counter()
        try:
            for i in range(self.scenes):
                scene = make_scene(CALIBRATION_SEED_BASE + i)
                question = sample_question(scene, rng)
                tier = tiers[i % len(tiers)]
                if self.component == "vision_encoder":  # its inputs are all it needs: no answer
                    request = self.rt.prepare(scene.image, question.prompt, tier=tier)
                    self.rt.encode(request.pixel_values, [request.cache_key], request.route)
                else:
                    self.rt.infer(scene.image, question.prompt, tier=tier)
                in_scene = len(self.pending)
                for done in range(1, in_scene + 1):
                    self.count += 1
                    yield self.pending.popleft()
                    if done == in_scene or time.perf_counter() - self.shown >= PROGRESS_EVERY_S:
                        self._progress(i, done / in_scene, started)
                if not in_scene:
                    self._progress(i, 1.0, started)
        finally:
            generator.encoder, generator.decoder = encoder, decoder
            progress(None)

    def _progress(self, scene: int, fraction: float, started: float) -> None:
        """Where it is: scene k/N, inputs so far, seconds, and an ETA from the scenes done
        (`fraction` of scene `scene` included; over a round of tiers it averages their costs)."""
        self.shown = time.perf_counter()
        elapsed = self.shown - started
        eta = elapsed / (scene + fraction) * (self.scenes - scene - fraction)
        progress(f"calibrating {self.component}: scene {scene + 1}/{self.scenes}, {self.count} inputs, "
                 f"{elapsed:.0f} s, ETA {eta:.0f} s")


def progress(line: str | None) -> None:
    """One progress line on stderr, rewritten in place (None: end it)."""
    if line is None:
        print(file=sys.stderr, flush=True)
    else:
        print(f"\r{line}\033[K", end="", file=sys.stderr, flush=True)


class OneFeed(CalibrationDataReader):
    """quantize_static's own calibration pass, fed one small input: the ranges come from
    TensorQuantOverrides (activation_ranges), so its pass only has to run."""

    def __init__(self, feeds: dict):
        self.feeds = feeds

    def get_next(self):
        feeds, self.feeds = self.feeds, None
        return feeds


def fp32_runtime(model_dir: Path) -> Runtime:
    """The fp32 graphs (never a variant `auto` would take) that produce the calibration feeds."""
    return Runtime(load_config({"model": {"path": str(model_dir), "precision": "fp32"},
                                "backend": {"warmup": False}, "cache": {"max_bytes": 0}}))


def default_scenes(manifest) -> int:
    """--scenes when not given: many for a small model, a few (each tier a few times) for a real one."""
    size = sum(manifest.graph_path(c, "fp32").stat().st_size for c in COMPONENTS)
    return SMALL_MODEL_SCENES if size < SMALL_MODEL_BYTES else LARGE_MODEL_SCENES


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


def reduction_graph(prepared: Path, method: str) -> tuple[onnx.ModelProto, list[str]]:
    """The prepared graph with, for every float tensor a Conv/MatMul/Gemm reads or writes
    (onnxruntime's own calibrator's choice), a few small outputs of its own: its size and, for
    minmax, its ReduceMax and ReduceMin (max |x| = max(|max|, |min|): no |x| tensor is made);
    for percentile, SAMPLES_PER_FEED of its |x| values picked in the graph (every value of a
    smaller tensor). Only those are outputs, so onnxruntime frees each activation after its
    last use as in any inference, and one input's peak is one ordinary run's (making every
    activation an output kept them all alive to the end: 6.5 GB at SmolVLM-256M's size).
    Each reduction is placed right after the node that makes its tensor. Percentile sampling
    reads the graph input SAMPLE_INPUT: SAMPLES_PER_FEED uniforms in [0, 1) drawn per input;
    value i of a larger tensor of n is |x|[floor(u[i] * n)]. Returns the graph and the tensors."""
    calibrater = CalibraterBase(prepared, op_types_to_calibrate=QUANTIZED_OPS)
    model = calibrater.model
    tensors = sorted(calibrater.select_tensors_to_calibrate(model)[0])
    graph = model.graph
    c = {key: f"{REDUCTION}/{key}" for key in ("flat", "zero", "one", "samples")}
    if method == "percentile":
        graph.input.append(helper.make_tensor_value_info(SAMPLE_INPUT, onnx.TensorProto.DOUBLE, [SAMPLES_PER_FEED]))
        graph.initializer.extend(numpy_helper.from_array(np.array(value, np.int64), c[key]) for key, value in
                                 (("flat", [-1]), ("zero", 0), ("one", 1), ("samples", SAMPLES_PER_FEED)))

    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.input, *graph.output)}

    def reductions(tensor: str, i: int) -> list[onnx.NodeProto]:
        out = f"{REDUCTION}/{i}"  # tensor names can hold any character; the index is safe
        nodes = [helper.make_node("Size", [tensor], [f"{out}/size"])]
        outputs = [(f"{out}/size", onnx.TensorProto.INT64)]
        if method == "minmax":
            nodes += [helper.make_node("ReduceMax", [tensor], [f"{out}/max"], keepdims=1),
                      helper.make_node("ReduceMin", [tensor], [f"{out}/min"], keepdims=1)]
            outputs += [(f"{out}/max", None), (f"{out}/min", None)]
        else:
            n, o = f"{out}/size", out
            nodes += [
                helper.make_node("Min", [n, c["samples"]], [f"{o}/m"]),
                helper.make_node("Range", [c["zero"], f"{o}/m", c["one"]], [f"{o}/j"]),  # 0 … m-1
                helper.make_node("Gather", [SAMPLE_INPUT, f"{o}/j"], [f"{o}/u"]),
                helper.make_node("Cast", [n], [f"{o}/nf"], to=onnx.TensorProto.DOUBLE),
                helper.make_node("Mul", [f"{o}/u", f"{o}/nf"], [f"{o}/un"]),
                helper.make_node("Floor", [f"{o}/un"], [f"{o}/floor"]),
                helper.make_node("Cast", [f"{o}/floor"], [f"{o}/drawn"], to=onnx.TensorProto.INT64),
                helper.make_node("Sub", [n, c["one"]], [f"{o}/n1"]),
                helper.make_node("Min", [f"{o}/drawn", f"{o}/n1"], [f"{o}/clipped"]),  # u·n rounded up to n
                helper.make_node("Greater", [n, c["samples"]], [f"{o}/large"]),
                helper.make_node("Where", [f"{o}/large", f"{o}/clipped", f"{o}/j"], [f"{o}/index"]),
                helper.make_node("Reshape", [tensor, c["flat"]], [f"{o}/flat"]),
                helper.make_node("Gather", [f"{o}/flat", f"{o}/index"], [f"{o}/picked"]),
                helper.make_node("Abs", [f"{o}/picked"], [f"{o}/samples"])]
            outputs.append((f"{o}/samples", None))
        for name, elem in outputs:
            graph.output.append(helper.make_tensor_value_info(name, elem or types[tensor], None))
        for node in nodes:
            node.name = node.output[0]  # a profile (and the ordering test) says which tensor it reduces
        return nodes

    index = {name: i for i, name in enumerate(tensors)}
    produced = {t for node in graph.node for t in node.output}
    ordered = [n for t in tensors if t not in produced for n in reductions(t, index[t])]  # graph inputs
    for node in graph.node:
        ordered.append(node)
        ordered += [n for t in node.output if t in index for n in reductions(t, index[t])]
    del graph.node[:]
    graph.node.extend(ordered)
    return model, tensors


def calibration_options() -> ort.SessionOptions:
    """How the reduction graph is run: unoptimised (its tensors are the prepared graph's, by
    name), and its nodes in the graph's order where it can, each reduction just after its
    tensor is made. onnxruntime's default order ran the reductions late, so every activation
    stayed alive until then: one SigLIP tile took 3.9 GB more than an ordinary run, against
    0.13 GB (as an ordinary run) in this order."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return options


def activation_ranges(prepared: Path, feeds, method: str, percentile: float, moving_average: bool,
                      first: list) -> dict:
    """onnxruntime TensorQuantOverrides: for every float tensor a Conv/MatMul/Gemm reads or
    writes, the symmetric range ±r. minmax: r is the largest |x| seen (with `moving_average`,
    each input's largest |x| averaged as onnxruntime's calibrator does); percentile: r is that
    percentile of |x|, from SAMPLES_PER_FEED values a tensor keeps per input. Streamed and
    reduced in the graph (reduction_graph): one input, and of its activations only what an
    ordinary run holds, is in memory at a time. `first` gets the smallest feed seen, for OneFeed."""
    rng = np.random.default_rng(0)
    largest: dict[str, float] = {}
    samples: dict[str, list[np.ndarray]] = {}
    model, tensors = reduction_graph(prepared, method)
    with tempfile.TemporaryDirectory() as tmp:
        augmented = Path(tmp) / "augmented.onnx"
        onnx.save(model, str(augmented))
        del model  # the session holds its own copy of the weights
        session = ort.InferenceSession(str(augmented), calibration_options(), providers=["CPUExecutionProvider"])
    per_tensor = 3 if method == "minmax" else 2
    names = [f"{REDUCTION}/{i}/{part}" for i in range(len(tensors))
             for part in (("size", "max", "min") if method == "minmax" else ("size", "samples"))]
    for feeds_ in feeds:
        size = sum(v.nbytes for v in feeds_.values())
        if not first or size < first[1]:
            first[:] = [feeds_, size]
        if method == "percentile":
            feeds_ = {**feeds_, SAMPLE_INPUT: rng.random(SAMPLES_PER_FEED)}
        values = session.run(names, feeds_)
        for i, name in enumerate(tensors):
            got = values[i * per_tensor:(i + 1) * per_tensor]
            if int(got[0]) == 0:  # an empty tensor has no range
                continue
            if method == "percentile":
                samples.setdefault(name, []).append(got[1].astype(np.float32))
                continue
            r = float(max(abs(got[1].item()), abs(got[2].item())))
            if name not in largest:
                largest[name] = r
            elif moving_average:  # onnxruntime's averaging constant
                largest[name] += MOVING_AVERAGE * (r - largest[name])
            else:
                largest[name] = max(largest[name], r)
    if method == "percentile":
        largest = {name: float(np.percentile(np.concatenate(parts), percentile)) for name, parts in samples.items()}
    return {name: [{"rmin": np.float32(-r), "rmax": np.float32(r)}] for name, r in largest.items() if r > 0}


def in_child(function, *args, **kwargs) -> None:
    """`function(*args, **kwargs)` in a process of its own: onnxruntime's pre-processing and
    quantizer hold a real-size graph several times over, and a process keeps the peak of what
    it ever allocated, on top of the fp32 graphs making the calibration feeds."""
    child = multiprocessing.get_context("spawn").Process(target=function, args=args, kwargs=kwargs)
    child.start()
    child.join()
    if child.exitcode:
        raise SystemExit(f"error: {getattr(function, '__name__', function)} failed (exit {child.exitcode})")


def quantize_graph(src: Path, dst: Path, feeds, method: str, moving_average: bool = False,
                   keep_float: list[str] = (), percentile: float = PERCENTILE) -> list[str]:
    """Quantize `src` into `dst` on the calibration inputs `feeds` (an iterable, consumed once);
    the nodes matching `keep_float` stay float. Returns their names."""
    excluded = matching_nodes(src, list(keep_float))
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        # symbolic shape inference gives up on the dynamic image-token axis; onnx shape inference suffices
        in_child(quant_pre_process, str(src), str(prepared), skip_symbolic_shape=True)
        # ranges by the prepared graph's tensor names, which its optimisation may have changed
        first: list = []
        overrides = activation_ranges(prepared, feeds, method, percentile, moving_average, first)
        if not first:
            raise SystemExit(f"error: no calibration inputs reached {src.name}")
        in_child(
            quantize_static, str(prepared), str(dst), OneFeed(first[0]), quant_format=QuantFormat.QDQ,
            op_types_to_quantize=QUANTIZED_OPS, nodes_to_exclude=excluded, per_channel=True,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,  # its ranges are all overridden
            # float bias: TensorRT has no int32 DequantizeLinear for a quantized bias
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True,
                           "QuantizeBias": False, "TensorQuantOverrides": overrides})
    drop_unused_opsets(dst, ir_version=onnx.load(str(src), load_external_data=False).ir_version)
    onnx.checker.check_model(str(dst))
    return excluded


def float16_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph in float16, inputs and outputs too (the Hugging Face layout's _fp16)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16
    return convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=True)


def weight_only_graph(src: Path, dst: Path, variant: str, component: str) -> dict:
    """`src` as the CPU variant `variant` (q4, q4f16, quantized, fp16) at `dst`; no calibration.
    Returns {op type: count} of the nodes the result has that the source had not."""
    model = onnx.load(str(src))
    before = {n.op_type for n in model.graph.node}
    if variant in ("fp16", "q4f16"):
        model = float16_graph(model)
    if variant in ("q4", "q4f16"):
        # the embedding's table too (GatherBlockQuantized): a third of SmolVLM-256M's bytes
        ops = ("MatMul", "Gather") if component == "embed_tokens" else ("MatMul",)
        quantizer = MatMulNBitsQuantizer(model, block_size=Q4_BLOCK, is_symmetric=True,
                                         accuracy_level=Q4_ACCURACY_LEVEL, op_types_to_quantize=ops,
                                         quant_axes=(("MatMul", 0), ("Gather", 1)))
        with np.errstate(invalid="ignore"):  # an all-zero block (a padding row) divides 0 by 0, and is 0
            quantizer.process()
        model = quantizer.model.model
    if variant == "quantized":
        with tempfile.TemporaryDirectory() as tmp:
            plain = Path(tmp) / "plain.onnx"
            onnx.save(model, str(plain))
            # int8 weights, uint8 activations quantized per call (u8s8: the fast x86/ARM kernel);
            # only MatMuls with a constant weight: the attention's activation × activation stays float
            quantize_dynamic(str(plain), str(dst), op_types_to_quantize=["MatMul"], per_channel=False,
                             weight_type=QuantType.QInt8, extra_options={"MatMulConstBOnly": True})
        model = onnx.load(str(dst))
    # the source's IR version, or 10 where int4 tensors need it (onnxruntime for Python 3.10 reads <= 11)
    source_ir = onnx.load(str(src), load_external_data=False).ir_version
    uses_int4 = any(t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) for t in model.graph.initializer)
    model.ir_version = min(model.ir_version, max(source_ir, 10 if uses_int4 else 0))
    onnx.save(model, str(dst))
    drop_unused_opsets(dst)
    onnx.checker.check_model(str(dst))
    added: dict[str, int] = {}
    for node in onnx.load(str(dst), load_external_data=False).graph.node:
        if node.op_type not in before:
            added[node.op_type] = added.get(node.op_type, 0) + 1
    return added


def make_weight_only_variant(model_dir: Path, variant: str) -> dict:
    """Every graph of the folder as `variant`: {graph file: {"bytes": n, "new_ops": {...}}}."""
    manifest = load_manifest(model_dir)
    report = {}
    for component in COMPONENTS:
        src = manifest.graph_path(component, "fp32")
        dst = src.with_name(f"{src.stem}_{variant}{src.suffix}")
        print(f"{variant}: {src.name} → {dst.name} …", file=sys.stderr, flush=True)
        added = weight_only_graph(src, dst, variant, component)
        report[dst.name] = {"bytes": dst.stat().st_size, "new_ops": added}
    return report


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
    ap.add_argument("--variant", choices=VARIANTS, default="int8",
                    help="the precision variant to write (its file suffix); all but int8 need no calibration")
    ap.add_argument("--scenes", type=int, default=None,
                    help=f"calibration scenes per graph, spread over tiers (default: {SMALL_MODEL_SCENES} for a "
                         f"model under {SMALL_MODEL_BYTES >> 20} MB of graphs such as the built-in one, "
                         f"else {LARGE_MODEL_SCENES}: minutes at SmolVLM-256M's size)")
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
    if args.variant != "int8":
        try:
            report = make_weight_only_variant(args.model_dir, args.variant)
        except EdgemmError as e:
            sys.exit(f"error: {e}")
        print(json.dumps({"seconds": round(time.time() - t0, 1), "variant": args.variant, "graphs": report},
                         indent=1))
        return
    try:
        rt = fp32_runtime(args.model_dir)
    except EdgemmError as e:  # no such folder, not a model folder …: one line
        sys.exit(f"error: {e}")
    scenes = args.scenes if args.scenes is not None else default_scenes(rt.manifest)
    print(f"calibrating on {scenes} generated scenes per graph …", file=sys.stderr)
    keep_float = model_keep_float(args.model_dir) if args.keep_float is None else [p for p in args.keep_float if p]
    kept: dict[str, list[str]] = {}
    inputs: dict[str, int] = {}
    for name in ("vision_encoder", "decoder"):
        src = rt.manifest.graph_path(name, "fp32")  # onnx/ in a Hugging Face folder
        dst = src.with_name(f"{src.stem}_int8{src.suffix}")
        feeds = SceneFeeds(rt, name, scenes)
        kept[name] = quantize_graph(src, dst, feeds, args.method, args.moving_average, keep_float, args.percentile)
        inputs[name] = feeds.count
    # a lookup table has no Conv/MatMul/Gemm: the int8 variant is the same graph
    embed = rt.manifest.graph_path("embed_tokens", "fp32")
    shutil.copy(embed, embed.with_name(f"{embed.stem}_int8{embed.suffix}"))
    sizes = {p.name: p.stat().st_size for p in sorted(embed.parent.glob("*_int8.onnx"))}
    print(json.dumps({"seconds": round(time.time() - t0, 1), "method": args.method, "scenes": scenes,
                      "calibration_inputs": inputs, "moving_average": args.moving_average, "kept_float": kept,
                      "int8_bytes": sizes}, indent=1))


if __name__ == "__main__":
    main()
