"""QDQ ONNX → (Q/DQ-free ONNX + TensorRT calibration cache), for DLA INT8 on TensorRT <= 10.7.

On JetPack 6 the DLA compiler takes INT8 only by implicit quantization: an ONNX graph
without QuantizeLinear/DequantizeLinear plus per-tensor scales read through a calibrator's
cache. The `_int8` graphs made by tools/quantize.py carry exactly those scales in their
Q/DQ pairs, so this module moves them from the graph into a cache, the way NVIDIA's
qdq-translator (NVIDIA-AI-IOT/cuDLA-samples, export/qdq_translator) does:

- activation `x → Q(s) → DQ(s) → consumers`: the consumers read `x` again and the cache gets
  `x: s`. TensorRT names its tensors after the ONNX tensors, so the cache keys match.
- weight `W_int8 → DQ(s, axis) → consumer`: the weight is folded back to float,
  `(W_int8 - zp) * s`. TensorRT derives per-channel weight scales itself (max |W| / 127),
  and re-quantizing the folded weights gives back the same int8 values.

Cache text (what TensorRT's IInt8EntropyCalibrator2 writes and reads back):

    TRT-<version number>-EntropyCalibration2
    <tensor name>: <IEEE-754 bits of the float32 scale, as hex>

The version number is the running TensorRT's (8.6.2 → 8602, 10.3.0 → 100300); TensorRT
refuses a cache whose header names another version.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgemm.errors import ModelError
from edgemm.model.quantization import BNB4_OPS, DYNAMIC_INT8_OPS, FOUR_BIT_OPS

CALIBRATOR = "EntropyCalibration2"
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


@dataclass
class Translation:
    model: onnx.ModelProto  # the graph without Q/DQ nodes
    scales: dict[str, float]  # activation tensor name → its QDQ scale
    folded_weights: list[str] = field(default_factory=list)  # weights turned back into float


def calibration_version(trt_version: str) -> str:
    """The number TensorRT writes in a cache header: NV_TENSORRT_VERSION of that release.

    TensorRT 8.x: major*1000 + minor*100 + patch (8.6.2 → 8602);
    TensorRT 10 and later: major*10000 + minor*100 + patch (10.3.0 → 100300).
    """
    try:
        major, minor, patch = (int(p) for p in (trt_version.split(".") + ["0", "0"])[:3])
    except ValueError:
        raise ValueError(f"not a TensorRT version: {trt_version!r}") from None
    return str(major * (10000 if major >= 10 else 1000) + minor * 100 + patch)


def scale_hex(scale: float) -> str:
    """float32 scale → the hex of its IEEE-754 bits (big-endian order), as TensorRT writes it."""
    return format(struct.unpack(">I", struct.pack(">f", scale))[0], "x")


def hex_scale(text: str) -> float:
    return struct.unpack(">f", struct.pack(">I", int(text, 16)))[0]


def format_cache(scales: dict[str, float], trt_version: str) -> str:
    lines = [f"TRT-{calibration_version(trt_version)}-{CALIBRATOR}"]
    lines += [f"{name}: {scale_hex(scale)}" for name, scale in scales.items()]
    return "\n".join(lines) + "\n"


def parse_cache(text: str) -> tuple[str, dict[str, float]]:
    """Cache text → (version number from the header, {tensor: scale}); strict, like TensorRT."""
    lines = text.splitlines()
    header = lines[0] if lines else ""
    parts = header.split("-")
    if len(parts) != 3 or parts[0] != "TRT" or not parts[1].isdigit() or parts[2] != CALIBRATOR:
        raise ValueError(f"not a TensorRT {CALIBRATOR} cache header: {header!r}")
    scales = {}
    for number, line in enumerate(lines[1:], start=2):
        name, sep, value = line.rpartition(": ")  # tensor names may contain ': '
        if not sep or not name or not all(c in "0123456789abcdef" for c in value) or len(value) > 8:
            raise ValueError(f"line {number}: expected '<tensor>: <hex>', got {line!r}")
        scales[name] = hex_scale(value)
    return parts[1], scales


class _Graph:
    """Lookups over one graph: constants by name, consumers of a tensor."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.initializers = {t.name: t for t in graph.initializer}
        self.constant_nodes = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}

    def constant(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.constant_nodes.get(name)
        if node is not None:
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
        return None

    def consumers(self, name: str) -> list[onnx.NodeProto]:
        return [n for n in self.graph.node if name in n.input]


def _qparams(g: _Graph, node: onnx.NodeProto, where: str) -> tuple[np.ndarray, np.ndarray, int]:
    scale = g.constant(node.input[1])
    if scale is None:
        raise ModelError(f"{where}: {node.op_type} {node.name!r} has a scale that is not a constant")
    zero = g.constant(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros_like(scale, np.int8)
    if zero is None or np.any(zero != 0):
        raise ModelError(f"{where}: {node.op_type} {node.name!r} has a non-zero zero point; "
                         "TensorRT needs symmetric quantization (make it with tools/quantize.py)")
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    return scale.astype(np.float32), zero, axis


def _fold_weight(values: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: int) -> np.ndarray:
    if scale.ndim == 0:
        return ((values.astype(np.float32) - zero.astype(np.float32)) * scale).astype(np.float32)
    shape = [1] * values.ndim
    shape[axis] = -1
    return ((values.astype(np.float32) - zero.astype(np.float32).reshape(shape))
            * scale.reshape(shape)).astype(np.float32)


def translate(model: onnx.ModelProto, where: str = "model") -> Translation:
    """Strip every Q/DQ pair from `model` (a copy is changed) and collect activation scales."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = _Graph(model.graph)
    scales: dict[str, float] = {}
    rename: dict[str, str] = {}  # DQ output → the float tensor that replaces it
    folded: list[str] = []
    new_initializers: list[onnx.TensorProto] = []
    if not any(n.op_type == "QuantizeLinear" and g.constant(n.input[0]) is None for n in model.graph.node):
        # no activation scale: a cache of none would build an engine calibrated on nothing
        ops = sorted({n.op_type for n in model.graph.node} & (DYNAMIC_INT8_OPS | FOUR_BIT_OPS | BNB4_OPS))
        found = f" (it has {', '.join(ops)}: not static QDQ)" if ops else ""
        raise ModelError(f"{where}: no QuantizeLinear/DequantizeLinear scale on any activation{found}, so no "
                         "calibration cache for the DLA; tools/quantize.py makes the QDQ int8 graph")
    for node in list(model.graph.node):
        if node.op_type != "DequantizeLinear":
            continue
        scale, zero, axis = _qparams(g, node, where)
        source = node.input[0]
        weight = g.constant(source)
        if weight is not None:  # a stored int8 weight: fold it back to float
            new_initializers.append(numpy_helper.from_array(_fold_weight(weight, scale, zero, axis), node.output[0]))
            folded.append(node.output[0])
            continue
        quantize = next((n for n in model.graph.node if source in n.output and n.op_type == "QuantizeLinear"), None)
        if quantize is None:
            raise ModelError(f"{where}: DequantizeLinear {node.name!r} reads {source!r}, "
                             "which is neither a constant nor a QuantizeLinear output")
        q_scale, _, _ = _qparams(g, quantize, where)
        if scale.size != 1 or not np.array_equal(q_scale, scale):
            raise ModelError(f"{where}: Q/DQ pair on {quantize.input[0]!r} is not one per-tensor scale")
        x = quantize.input[0]
        if g.constant(x) is not None:  # Q/DQ over a float weight: TensorRT re-derives weight scales
            rename[node.output[0]] = x
            continue
        value = float(scale.reshape(()))
        if x in scales and scales[x] != value:
            raise ModelError(f"{where}: tensor {x!r} is quantized with two scales ({scales[x]} and {value})")
        scales[x] = value
        rename[node.output[0]] = x
    _rewire(model.graph, rename)
    kept = [n for n in model.graph.node if n.op_type not in QDQ_OPS]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    model.graph.initializer.extend(new_initializers)
    _drop_unused(model.graph)
    return Translation(model, scales, folded)


def _rewire(graph: onnx.GraphProto, rename: dict[str, str]) -> None:
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    # a DQ output that is a graph output keeps its name through an Identity
    for output in graph.output:
        if output.name in rename:
            graph.node.append(helper.make_node("Identity", [rename[output.name]], [output.name],
                                               name=f"{output.name}_qdq_identity"))


def _drop_unused(graph: onnx.GraphProto) -> None:
    """Remove the int8 weights, scales and zero points nothing reads any more."""
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    constants = [n for n in graph.node if n.op_type == "Constant" and n.output[0] not in used]
    for node in constants:
        graph.node.remove(node)
    value_info = [v for v in graph.value_info if v.name in used or any(v.name in n.output for n in graph.node)]
    del graph.value_info[:]
    graph.value_info.extend(value_info)


def translate_file(src: Path, onnx_out: Path, cache_out: Path, trt_version: str) -> Translation:
    """Write the Q/DQ-free graph and the calibration cache of `src`; returns the translation."""
    try:
        model = onnx.load(str(src))
    except Exception as e:  # onnx raises DecodeError and others alike
        raise ModelError(f"cannot read {src}: {e}") from None
    result = translate(model, str(src))
    onnx.checker.check_model(result.model)
    onnx.save(result.model, str(onnx_out))
    cache_out.write_text(format_cache(result.scales, trt_version), encoding="ascii")
    return result
