"""What quantization a graph holds, read from its operators, not from its file name.

The same suffix means different graphs in different folders: `_int8` is QDQ int8 where
tools/quantize.py made it, and dynamic int8 where transformers.js's scripts/quantize.py did
(the published onnx-community folders). What runs where, and whether rows batch exactly,
depends on the kind, so it is read from the graph itself:

    fp32          no quantization operator, float32 weights (Optimum's export)
    fp16          no quantization operator, float16 weights (`_fp16`: onnxconverter's
                  float16 conversion)
    qdq-int8      QuantizeLinear on activations with static scales, then DequantizeLinear:
                  onnxruntime's quantize_static in QDQ format (tools/quantize.py's `_int8`),
                  what TensorRT builds explicit INT8 engines from and the DLA translation
                  reads its scales from
    dynamic-int8  DynamicQuantizeLinear / MatMulInteger / ConvInteger (or onnxruntime's fused
                  DynamicQuantizeMatMul, MatMulIntegerToFloat): onnxruntime's quantize_dynamic,
                  transformers.js's `_int8`, `_uint8` and `_quantized`. The activations are
                  scaled per call over the whole tensor, so a row's result depends on the rows
                  and tokens in the same call; TensorRT's ONNX parser has none of these ops
    int8-weights  int8 weights dequantized by DequantizeLinear, activations left in float
                  (quantize_dynamic's embedding table: a Gather of int8 rows): exact per row
    4bit          MatMulNBits / GatherBlockQuantized over float32 (`_q4`: onnxruntime's
                  MatMulNBitsQuantizer), onnxruntime's contrib ops
    q4f16         the same over float16 (`_q4f16`)
    bnb4          MatMulBnb4 (`_bnb4`: NF4/FP4 weights, onnxruntime's contrib op)

Only the node list is read: a small reader of ONNX's protobuf wire format walks the graph
and its subgraphs (a merged decoder's If branches), reads each initializer's name and type
and skips its bytes (external data is never opened), so a gigabyte graph costs a scan of its
node list. Each answer is kept per file, by path, size and mtime.
"""
from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from edgemm.errors import ModelError

KINDS = ("fp32", "fp16", "qdq-int8", "dynamic-int8", "int8-weights", "4bit", "q4f16", "bnb4")
DYNAMIC_INT8_OPS = frozenset({"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger",
                              "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "DynamicQuantizeLSTM"})
FOUR_BIT_OPS = frozenset({"MatMulNBits", "GatherBlockQuantized"})
BNB4_OPS = frozenset({"MatMulBnb4"})
# Kinds whose rows are exact alone or batched (dynamic int8 scales each call as a whole)
BATCH_DEPENDENT = frozenset({"dynamic-int8"})
# Kinds TensorRT's ONNX parser cannot take: onnxruntime's contrib and integer ops
TENSORRT_UNPARSABLE = frozenset({"dynamic-int8", "4bit", "q4f16", "bnb4"})
DESCRIPTIONS = {
    "fp32": "float32, no quantization", "fp16": "float16, no quantization",
    "qdq-int8": "static QDQ int8 (QuantizeLinear/DequantizeLinear on activations)",
    "dynamic-int8": "dynamic int8 (DynamicQuantizeLinear/MatMulInteger/ConvInteger)",
    "int8-weights": "int8 weights dequantized in the graph, float activations",
    "4bit": "4-bit MatMulNBits/GatherBlockQuantized", "q4f16": "4-bit MatMulNBits over float16",
    "bnb4": "4-bit MatMulBnb4"}
FLOAT16, FLOAT32 = 10, 1  # onnx.TensorProto.DataType


@dataclass(frozen=True)
class GraphOps:
    """What the kind is read from: every operator (subgraphs and the model's local functions
    included), the inputs of the QuantizeLinear nodes, the constants (initializers, Constant
    outputs) and how many float16 and float32 values the constant tensors hold (from their
    dims, so weights in external data count too)."""
    ops: frozenset[str]
    quantized_inputs: frozenset[str]
    constants: frozenset[str]
    float16_elements: int
    float32_elements: int


def kind_of(ops: GraphOps) -> str:
    # any dynamic int8 operator first, whatever else the graph holds (a 4-bit graph whose rest
    # quantize_dynamic went over): its rows then depend on their batch mates
    if ops.ops & DYNAMIC_INT8_OPS:
        return "dynamic-int8"
    if ops.ops & BNB4_OPS:
        return "bnb4"
    if ops.ops & FOUR_BIT_OPS:
        return "q4f16" if ops.float16_elements > ops.float32_elements else "4bit"
    if ops.quantized_inputs - ops.constants:
        return "qdq-int8"
    if "DequantizeLinear" in ops.ops:
        return "int8-weights"
    return "fp16" if ops.float16_elements > ops.float32_elements else "fp32"


_cache: dict[tuple[str, int, int], str] = {}
_lock = threading.Lock()


def graph_kind(path: str | os.PathLike) -> str:
    """The quantization kind of the ONNX graph at `path` (one of KINDS); a ModelError naming
    the file where it is not an ONNX graph."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError as e:
        raise ModelError(f"{path}: {e.strerror or e}") from None
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _lock:
        if key in _cache:
            return _cache[key]
    kind = kind_of(read_ops(path))
    with _lock:
        _cache[key] = kind
    return kind


def describe(kind: str) -> str:
    return DESCRIPTIONS.get(kind, kind)


# ---- ONNX's protobuf wire format, only as far as the kind needs --------------------------------
# ModelProto.graph 7, .functions 25; FunctionProto.node 7; GraphProto.node 1, .initializer 5;
# NodeProto.input 1, .output 2, .op_type 4, .attribute 5; AttributeProto.t 5, .g 6, .graphs 11;
# TensorProto.dims 1 (packed or not), .data_type 2, .name 8.

def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("malformed protobuf")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, wire type, value or (start, end) of a length-delimited field) from buf[start:end]."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, wire, value
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise ValueError("malformed protobuf")
            yield number, wire, (pos, pos + length)
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            yield number, wire, None
        else:
            raise ValueError("malformed protobuf")
    if pos != end:
        raise ValueError("malformed protobuf")


class _Reader:
    def __init__(self, buf):
        self.buf = buf
        self.ops: set[str] = set()
        self.quantized_inputs: set[str] = set()
        self.constants: set[str] = set()
        self.elements = {FLOAT16: 0, FLOAT32: 0}

    def text(self, span: tuple[int, int]) -> str:
        return bytes(self.buf[span[0]:span[1]]).decode("utf-8", "replace")

    def model(self) -> None:
        for number, wire, value in _fields(self.buf, 0, len(self.buf)):
            if number == 7 and wire == 2:
                self.graph(*value)
            elif number == 25 and wire == 2:  # a local function: its nodes run where it is called
                for f_number, f_wire, f_value in _fields(self.buf, *value):
                    if f_number == 7 and f_wire == 2:
                        self.node(*f_value)

    def graph(self, start: int, end: int) -> None:
        for number, wire, value in _fields(self.buf, start, end):
            if wire != 2:
                continue
            if number == 1:
                self.node(*value)
            elif number == 5:
                self.initializer(*value)

    def node(self, start: int, end: int) -> None:
        inputs, outputs, op = [], [], ""
        for number, wire, value in _fields(self.buf, start, end):
            if wire != 2:
                continue
            if number == 1:
                inputs.append(self.text(value))
            elif number == 2:
                outputs.append(self.text(value))
            elif number == 4:
                op = self.text(value)
            elif number == 5:
                for a_number, a_wire, a_value in _fields(self.buf, *value):
                    if a_wire == 2 and a_number in (6, 11):  # a subgraph: an If's branch, a Loop's body
                        self.graph(*a_value)
                    elif a_wire == 2 and a_number == 5:  # a Constant's tensor: weights too
                        self.initializer(*a_value)
        self.ops.add(op)
        if op == "QuantizeLinear" and inputs:
            self.quantized_inputs.add(inputs[0])
        if op == "Constant":
            self.constants.update(outputs)

    def initializer(self, start: int, end: int) -> None:
        data_type, name, elements = 0, None, 1
        for number, wire, value in _fields(self.buf, start, end):
            if number == 2 and wire == 0:
                data_type = value
            elif number == 8 and wire == 2:
                name = self.text(value)
            elif number == 1 and wire == 0:  # one dim
                elements *= value
            elif number == 1 and wire == 2:  # the dims, packed
                pos, stop = value
                while pos < stop:
                    dim, pos = _varint(self.buf, pos)
                    elements *= dim
        if name is not None:
            self.constants.add(name)
        if data_type in self.elements:
            self.elements[data_type] += elements


def read_ops(path: Path) -> GraphOps:
    """The operators of the graph at `path` (its weights are skipped, never decoded)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ValueError("malformed protobuf")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                reader = _Reader(buf)
                reader.model()
    except ValueError:  # the wire format broken anywhere
        raise ModelError(f"{path}: not an ONNX graph (its protobuf does not parse)") from None
    except OSError as e:
        raise ModelError(f"{path}: not readable ({e.strerror or e})") from None
    if not reader.ops - {""}:
        raise ModelError(f"{path}: not an ONNX graph (no operators)")
    return GraphOps(frozenset(reader.ops), frozenset(reader.quantized_inputs), frozenset(reader.constants),
                    reader.elements[FLOAT16], reader.elements[FLOAT32])
