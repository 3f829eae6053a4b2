"""The exported graphs of models/tiny-vlm against the model contract (docs/ARCHITECTURE.md, "The model contract").

Names, dtypes and dynamic axes as onnxruntime reads them; image tokens per tier; KV-cache
decoding equal to full recomputation; onnx.checker; size; the shape of the INT8 QDQ graphs.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import numpy_helper
from onnx.external_data_helper import uses_external_data

from edgemm.model.manifest import load_manifest

GRAPHS = ("vision_encoder", "embed_tokens", "decoder_model_merged")
SUFFIXES = ("", "_int8")
QUANTIZABLE = {"Conv", "MatMul", "Gemm"}
MAX_FP32_BYTES = 20_000_000


def session(model_dir, name: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(model_dir / f"{name}.onnx"), options,
                                providers=["CPUExecutionProvider"])


def is_dynamic(dim) -> bool:
    return not isinstance(dim, int)


@pytest.fixture(scope="module")
def dims(model_dir) -> dict:
    """The decoder section of model.yaml: layers, heads, head_dim, hidden_size, vocab_size."""
    return yaml.safe_load((model_dir / "model.yaml").read_text())["decoder"]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_vision_encoder_io(model_dir, dims, suffix):
    s = session(model_dir, "vision_encoder" + suffix)
    (inp,), (out,) = s.get_inputs(), s.get_outputs()
    assert (inp.name, inp.type) == ("pixel_values", "tensor(float)")
    assert len(inp.shape) == 4 and inp.shape[1] == 3
    assert all(is_dynamic(inp.shape[i]) for i in (0, 2, 3)), inp.shape
    assert (out.name, out.type, len(out.shape)) == ("image_features", "tensor(float)", 3)
    assert is_dynamic(out.shape[0]) and is_dynamic(out.shape[1]), out.shape
    # the dynamic axes really are dynamic: batch 2 at a non-square size runs
    features = s.run(None, {"pixel_values": np.zeros((2, 3, 128, 192), np.float32)})[0]
    assert features.shape[0] == 2 and features.shape[2] == dims["hidden_size"]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_embed_tokens_io(model_dir, dims, suffix):
    s = session(model_dir, "embed_tokens" + suffix)
    (inp,), (out,) = s.get_inputs(), s.get_outputs()
    assert (inp.name, inp.type) == ("input_ids", "tensor(int64)")
    assert len(inp.shape) == 2 and all(map(is_dynamic, inp.shape)), inp.shape
    assert (out.name, out.type) == ("inputs_embeds", "tensor(float)")
    assert len(out.shape) == 3 and out.shape[2] == dims["hidden_size"]
    embeds = s.run(None, {"input_ids": np.zeros((2, 5), np.int64)})[0]
    assert embeds.shape == (2, 5, dims["hidden_size"])


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_decoder_io(model_dir, dims, suffix):
    s = session(model_dir, "decoder_model_merged" + suffix)
    ins = {a.name: a for a in s.get_inputs()}
    outs = {a.name: a for a in s.get_outputs()}
    kv = [f"{i}.{kind}" for i in range(dims["layers"]) for kind in ("key", "value")]
    assert set(ins) - {"use_cache_branch", "num_logits_to_keep"} == {
        "inputs_embeds", "attention_mask", "position_ids", *(f"past_key_values.{n}" for n in kv)}
    assert set(outs) == {"logits", *(f"present.{n}" for n in kv)}

    embeds, mask, positions = ins["inputs_embeds"], ins["attention_mask"], ins["position_ids"]
    assert embeds.type == "tensor(float)" and embeds.shape[2] == dims["hidden_size"]
    assert is_dynamic(embeds.shape[0]) and is_dynamic(embeds.shape[1])
    for spec in (mask, positions):  # [B, past+S] and [B, S], both axes dynamic
        assert spec.type == "tensor(int64)" and len(spec.shape) == 2
        assert all(map(is_dynamic, spec.shape)), (spec.name, spec.shape)
    for n in kv:
        for spec in (ins[f"past_key_values.{n}"], outs[f"present.{n}"]):
            b, heads, length, head_dim = spec.shape
            assert spec.type == "tensor(float)"
            assert (heads, head_dim) == (dims["heads"], dims["head_dim"]), spec.name
            assert is_dynamic(b) and is_dynamic(length), (spec.name, spec.shape)
    logits = outs["logits"]
    assert logits.type == "tensor(float)" and logits.shape[2] == dims["vocab_size"]

    # batch 2, 3 new tokens on top of a past of 4
    b, s_new, past = 2, 3, 4
    feeds = {"inputs_embeds": np.zeros((b, s_new, dims["hidden_size"]), np.float32),
             "attention_mask": np.ones((b, past + s_new), np.int64),
             "position_ids": np.tile(np.arange(past, past + s_new), (b, 1)),
             **{f"past_key_values.{n}": np.zeros((b, dims["heads"], past, dims["head_dim"]), np.float32)
                for n in kv}}
    result = dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))
    assert result["logits"].shape == (b, s_new, dims["vocab_size"])
    assert result["present.0.key"].shape == (b, dims["heads"], past + s_new, dims["head_dim"])


def test_vocab_size_matches_tokenizer(runtime, dims):
    assert runtime.adapter.tokenizer.get_vocab_size() == dims["vocab_size"]


def test_image_tokens_per_tier_match_encoder_output(model_dir, dims):
    encoder = session(model_dir, "vision_encoder")
    for tier in load_manifest(model_dir).tiers.values():
        pixels = np.zeros((1, 3, tier.height, tier.width), np.float32)
        features = encoder.run(None, {"pixel_values": pixels})[0]
        assert features.shape == (1, tier.image_tokens, dims["hidden_size"]), tier.name


def test_kv_cache_decoding_matches_full_recompute(make_runtime, model_dir):
    # the exported fp32 graphs: a q4 decoder's kernels round differently for one row than for
    # many (onnxruntime 1.23 by ~0.006), which says nothing about the graphs' KV-cache wiring
    runtime = make_runtime(model={"precision": "fp32"})
    gen = runtime.generator
    pixels, tier = runtime.preprocess(model_dir / "samples" / "scene_12.png")
    prompt = runtime.adapter.build_prompt("describe the image", runtime.manifest.tiers[tier])
    embeds = gen.embed_prompt(prompt.input_ids, gen.encode(pixels), prompt.image_start)
    mask = np.ones((1, embeds.shape[1]), np.int64)
    logits, past = gen.step(embeds, mask, gen.empty_past(1))
    for _ in range(6):
        token = np.array([[np.argmax(logits[0])]], np.int64)
        new = gen.embed.run({"input_ids": token})["inputs_embeds"]
        embeds = np.concatenate([embeds, new], axis=1)
        mask = np.ones((1, embeds.shape[1]), np.int64)
        logits, past = gen.step(new, mask, past)
        full, _ = gen.step(embeds, mask, gen.empty_past(1))
        np.testing.assert_allclose(logits, full, rtol=0, atol=1e-4)
        assert past["past_key_values.0.key"].shape[2] == embeds.shape[1]
    # the cache matters: the last token alone, without its past, predicts something else
    alone, _ = gen.step(new, np.ones((1, 1), np.int64), gen.empty_past(1))
    assert not np.allclose(alone, logits, atol=1e-3)


@pytest.mark.parametrize("name", [g + s for s in SUFFIXES for g in GRAPHS])
def test_onnx_checker_passes(model_dir, name):
    onnx.checker.check_model(str(model_dir / f"{name}.onnx"), full_check=True)


def test_fp32_graphs_are_small(model_dir):
    total = 0
    for name in GRAPHS:
        path = model_dir / f"{name}.onnx"
        model = onnx.load(str(path), load_external_data=False)
        external = {e.value for t in model.graph.initializer if uses_external_data(t)
                    for e in t.external_data if e.key == "location"}
        total += path.stat().st_size + sum((path.parent / f).stat().st_size for f in external)
    assert total <= MAX_FP32_BYTES, f"{total / 1e6:.1f} MB of FP32 graphs"


# ---- INT8: QDQ, symmetric, per-channel weights, only Conv / MatMul / Gemm -------------------

def int8_graph(model_dir, name: str):
    graph = onnx.load(str(model_dir / f"{name}_int8.onnx")).graph
    inits = {t.name: t for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    return graph, inits, producer, consumers


@pytest.mark.parametrize("name", ["vision_encoder", "decoder_model_merged"])
def test_int8_graph_is_qdq(model_dir, name):
    graph, *_ = int8_graph(model_dir, name)
    ops = Counter(n.op_type for n in graph.node)
    assert ops["QuantizeLinear"] > 0 and ops["DequantizeLinear"] > 0
    operator_format = [op for op in ops if op.startswith("QLinear") or op.endswith("Integer")]
    assert not operator_format, f"QOperator nodes, not QDQ: {operator_format}"


@pytest.mark.parametrize("name", GRAPHS)
def test_int8_zero_points_are_int8_zeros(model_dir, name):
    graph, inits, *_ = int8_graph(model_dir, name)
    for n in graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            # an omitted zero point means uint8: it must be there, int8, and 0
            assert len(n.input) == 3 and n.input[2] in inits, f"{n.name}: no zero-point initializer"
            zero_point = inits[n.input[2]]
            assert zero_point.data_type == onnx.TensorProto.INT8, n.name
            assert not numpy_helper.to_array(zero_point).any(), f"{n.name}: zero point not 0"


@pytest.mark.parametrize("name", ["vision_encoder", "decoder_model_merged"])
def test_int8_weights_are_per_channel(model_dir, name):
    graph, inits, _, consumers = int8_graph(model_dir, name)
    weights = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert weights
    for n in weights:
        weight, scale = inits[n.input[0]], numpy_helper.to_array(inits[n.input[1]])
        axis = {a.name: a.i for a in n.attribute}.get("axis")
        assert axis is not None, f"{n.name}: per-tensor weight scale"
        assert weight.data_type == onnx.TensorProto.INT8, n.name
        assert scale.ndim == 1 and scale.shape[0] == weight.dims[axis] > 1, (n.name, scale.shape)
        assert {c.op_type for c in consumers[n.output[0]]} <= QUANTIZABLE, n.name


@pytest.mark.parametrize("name", ["vision_encoder", "decoder_model_merged"])
def test_int8_quantizes_only_conv_matmul_gemm(model_dir, name):
    """Every activation Q/DQ pair sits on an input or the output of a Conv/MatMul/Gemm."""
    graph, inits, producer, consumers = int8_graph(model_dir, name)
    for q in graph.node:
        if q.op_type != "QuantizeLinear" or q.input[0] in inits:
            continue
        source = producer.get(q.input[0])
        feeds = {c.op_type for dq in consumers[q.output[0]] for c in consumers.get(dq.output[0], [])}
        touches = (source is not None and source.op_type in QUANTIZABLE) or feeds & QUANTIZABLE
        assert touches, f"{q.name} quantizes {source.op_type if source else q.input[0]} → {feeds}"
