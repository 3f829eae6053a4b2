"""QDQ → (Q/DQ-free ONNX + TensorRT calibration cache) on the built-in model's _int8 graphs."""
from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from edgemm.backends.tensorrt.qdq import (calibration_version, format_cache, parse_cache, scale_hex,
                                translate, translate_file)
from edgemm.errors import ModelError
from edgemm.model.image import load_image
from edgemm.model.preprocess import to_pixel_values

GRAPHS = ["vision_encoder", "decoder_model_merged"]


def run(model, feeds: dict) -> list[np.ndarray]:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def qdq_activation_scales(model: onnx.ModelProto) -> dict[str, float]:
    """Read straight from the QDQ graph: the scale of every QuantizeLinear on an activation."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return {n.input[0]: float(inits[n.input[1]]) for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.input[0] not in inits}


@pytest.fixture(scope="module")
def encoder_feeds(model_dir):
    rgb = load_image(model_dir / "samples" / "scene_11.png")
    return {"pixel_values": to_pixel_values(rgb, 128, 128, (0.5,) * 3, (0.5,) * 3)}


@pytest.fixture(scope="module")
def decoder_feeds(model_dir):
    ids = np.array([[1, 5, 7, 9, 11, 13, 17]], np.int64)
    embeds = run(model_dir / "embed_tokens.onnx", {"input_ids": ids})[0]
    feeds = {"inputs_embeds": embeds, "attention_mask": np.ones(ids.shape, np.int64),
             "position_ids": np.arange(ids.shape[1])[None]}
    for i in range(4):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, 4, 0, 48), np.float32)
    return feeds


@pytest.fixture(scope="module", params=GRAPHS)
def translated(request, model_dir):
    source = onnx.load(str(model_dir / f"{request.param}_int8.onnx"))
    return request.param, source, translate(source)


def test_stripped_graph_has_no_qdq_and_is_valid(translated):
    _, source, result = translated
    ops = {n.op_type for n in result.model.graph.node}
    assert not ops & {"QuantizeLinear", "DequantizeLinear"}
    assert {n.op_type for n in source.graph.node} & {"QuantizeLinear", "DequantizeLinear"}
    onnx.checker.check_model(result.model, full_check=True)
    assert not any(t.data_type == onnx.TensorProto.INT8 for t in result.model.graph.initializer)
    assert [i.name for i in result.model.graph.input] == [i.name for i in source.graph.input]
    assert [o.name for o in result.model.graph.output] == [o.name for o in source.graph.output]


def test_stripped_graph_matches_fp32_closer_than_the_qdq_graph(translated, model_dir, encoder_feeds, decoder_feeds):
    name, _, result = translated
    feeds = encoder_feeds if name == "vision_encoder" else decoder_feeds
    fp32 = run(model_dir / f"{name}.onnx", feeds)[0]
    stripped = run(result.model, feeds)[0]
    fake_quant = run(model_dir / f"{name}_int8.onnx", feeds)[0]
    scale = np.abs(fp32).max()
    # only the weights' int8 rounding is left: well under 1 % of the output range
    assert np.abs(stripped - fp32).max() < 0.01 * scale
    assert np.abs(stripped - fp32).max() < np.abs(fake_quant - fp32).max()
    if name == "decoder_model_merged":
        assert (stripped.argmax(-1) == fp32.argmax(-1)).all()


def test_every_cache_scale_is_the_qdq_scale_it_came_from(translated):
    _, source, result = translated
    expected = qdq_activation_scales(source)
    assert expected and result.scales == expected
    _, parsed = parse_cache(format_cache(result.scales, "8.6.2"))
    assert parsed.keys() == expected.keys()
    for tensor, scale in expected.items():
        assert np.float32(parsed[tensor]) == np.float32(scale), tensor


def test_cache_keys_name_tensors_of_the_stripped_graph(translated):
    _, _, result = translated
    graph = result.model.graph
    produced = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    assert set(result.scales) <= produced


def test_folded_weights_requantize_to_the_same_int8(translated):
    """TensorRT derives weight scales as max|W|/127 per channel; that must give back the QDQ int8."""
    _, source, result = translated
    inits = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}
    folded = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    checked = 0
    for node in source.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            weight = folded[node.output[0]]
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            moved = np.moveaxis(weight, axis, 0)
            amax = np.abs(moved.reshape(moved.shape[0], -1)).max(axis=1)
            shape = [-1] + [1] * (weight.ndim - 1)
            requantized = np.round(moved / (amax / 127).reshape(shape))
            assert np.array_equal(requantized, np.moveaxis(inits[node.input[0]], axis, 0)), node.name
            checked += 1
    assert checked == len(result.folded_weights) > 0


def test_cache_file_is_in_tensorrt_format(tmp_path, model_dir):
    onnx_out, cache_out = tmp_path / "enc_noqdq.onnx", tmp_path / "enc.cache"
    result = translate_file(model_dir / "vision_encoder_int8.onnx", onnx_out, cache_out, "10.3.0")
    text = cache_out.read_text(encoding="ascii")
    lines = text.splitlines()
    assert text.endswith("\n")
    assert lines[0] == "TRT-100300-EntropyCalibration2"
    assert all(re.fullmatch(r".+: [0-9a-f]{1,8}", line) for line in lines[1:])
    assert len(lines) - 1 == len(result.scales)
    version, scales = parse_cache(text)
    assert version == "100300" and scales == pytest.approx(result.scales, rel=1e-7)
    assert onnx.load(str(onnx_out)).graph.node


@pytest.mark.parametrize("version, number", [("8.6.2", "8602"), ("8.6.1.6", "8601"), ("10.3.0", "100300"),
                                             ("10.7.0", "100700"), ("10.14.1", "101401")])
def test_calibration_version_numbers(version, number):
    assert calibration_version(version) == number


def test_scale_hex_is_the_float32_bit_pattern():
    assert scale_hex(1.0) == "3f800000"
    assert scale_hex(0.5) == "3f000000"
    assert scale_hex(2.0 ** -10) == "3a800000"


@pytest.mark.parametrize("text", ["", "TRT-8602-MinMaxCalibration\n", "TRT-x-EntropyCalibration2\n",
                                  "TRT-8602-EntropyCalibration2\nx 3f800000\n",
                                  "TRT-8602-EntropyCalibration2\nx: 3f80000000\n"])
def test_malformed_caches_are_refused(text):
    with pytest.raises(ValueError):
        parse_cache(text)


def test_asymmetric_quantization_is_refused(model_dir):
    model = onnx.load(str(model_dir / "vision_encoder_int8.onnx"))
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
    zero = next(t for t in model.graph.initializer if t.name == q.input[2])
    zero.CopyFrom(numpy_helper.from_array(np.array(3, np.int8), zero.name))
    with pytest.raises(ModelError, match="non-zero zero point"):
        translate(model)
