"""tools/quantize.py on a two-layer graph: symmetric QDQ, and --keep-float leaves a layer in float."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

# the runtime's floor is onnxruntime 1.20; the tool's q4 quantizer module is 1.22's (README "Set-up")
pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer",
                    reason="tools/quantize.py needs onnxruntime 1.22 or newer")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from quantize import matching_nodes, quantize_graph  # noqa: E402


def two_matmuls(path: Path) -> None:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(size=(8, 16)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(16, 4)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="/first/MatMul"),
         helper.make_node("Relu", ["h"], ["r"], name="/relu"),
         helper.make_node("MatMul", ["r", "w2"], ["y"], name="/head/MatMul")],
        "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # as an exporter writes it: make_model's default is the newest onnx knows
    onnx.save(model, str(path))


def weight_is_quantized(model: onnx.ModelProto, node_name: str) -> bool:
    """Does the node's weight input come out of a DequantizeLinear?"""
    node = next(n for n in model.graph.node if n.name == node_name)
    dq_outputs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return node.input[1] in dq_outputs


def test_keep_float_leaves_the_named_layer_unquantized(tmp_path):
    src, dst = tmp_path / "two.onnx", tmp_path / "two_int8.onnx"
    two_matmuls(src)
    feeds = [{"x": np.random.default_rng(i).normal(size=(3, 8)).astype(np.float32)} for i in range(8)]
    assert matching_nodes(src, ["/head/*"]) == ["/head/MatMul"]
    kept = quantize_graph(src, dst, feeds, "minmax", keep_float=["/head/*"])
    assert kept == ["/head/MatMul"]
    model = onnx.load(str(dst))
    assert weight_is_quantized(model, "/first/MatMul")
    assert not weight_is_quantized(model, "/head/MatMul")
    # symmetric: every zero point is 0, as TensorRT's explicit quantization needs
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    zero_points = [inits[n.input[2]] for n in model.graph.node
                   if n.op_type == "QuantizeLinear" and len(n.input) > 2]
    assert zero_points and all(not z.any() for z in zero_points)
    # and it still computes nearly the same function
    x = feeds[0]["x"]
    ref = ort.InferenceSession(str(src)).run(None, {"x": x})[0]
    out = ort.InferenceSession(str(dst)).run(None, {"x": x})[0]
    assert np.abs(out - ref).max() < 0.2 * np.abs(ref).max()


def test_without_keep_float_every_layer_is_quantized(tmp_path):
    src, dst = tmp_path / "two.onnx", tmp_path / "two_int8.onnx"
    two_matmuls(src)
    feeds = [{"x": np.random.default_rng(i).normal(size=(3, 8)).astype(np.float32)} for i in range(8)]
    assert quantize_graph(src, dst, feeds, "minmax") == []
    model = onnx.load(str(dst))
    assert weight_is_quantized(model, "/first/MatMul") and weight_is_quantized(model, "/head/MatMul")


def test_percentile_clips_the_range_that_one_outlier_would_set(tmp_path):
    """Feeds of two shapes (onnxruntime's own percentile calibration cannot take them) with one
    huge outlier: minmax stretches the input's scale to it, percentile does not."""
    src = tmp_path / "two.onnx"
    two_matmuls(src)
    feeds = [{"x": np.random.default_rng(i).normal(size=(3 + i % 2, 8)).astype(np.float32)} for i in range(40)]
    feeds[5]["x"][0, 0] = 1000.0
    scales = {}
    for method in ("minmax", "percentile"):
        dst = tmp_path / f"{method}.onnx"
        quantize_graph(src, dst, feeds, method, percentile=99.9)
        model = onnx.load(str(dst))
        inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
        scales[method] = float(inits[q.input[1]])
    assert scales["minmax"] > 1000 / 128  # the outlier sets the range
    assert scales["percentile"] < 10 / 127  # ordinary values (|x| < ~4) set it


def test_the_model_folder_names_its_float_layers(tmp_path, model_dir):
    from quantize import model_keep_float
    keep = model_keep_float(model_dir)
    assert keep and matching_nodes(model_dir / "vision_encoder.onnx", keep)  # the globs name real layers
    assert model_keep_float(tmp_path) == []  # no model.yaml (a Hugging Face folder): nothing kept
    (tmp_path / "model.yaml").write_text("quantization:\n  keep_float: /body.4/conv/Conv\n")
    with pytest.raises(SystemExit, match="keep_float must be a list"):
        model_keep_float(tmp_path)


def test_the_shipped_int8_encoder_leaves_exactly_those_layers_float(model_dir):
    from quantize import model_keep_float
    kept = set(matching_nodes(model_dir / "vision_encoder.onnx", model_keep_float(model_dir)))
    model = onnx.load(str(model_dir / "vision_encoder_int8.onnx"))
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    assert kept and kept < set(convs)
    for name in convs:
        assert weight_is_quantized(model, name) == (name not in kept), name
