"""Model folders as they are published (issue 32, items 1 and 2): a folder with any one
precision answers, and a graph's quantization is read from its operators, so that a
published `_int8` of dynamic int8 runs as what it is: exact alone or beside other requests,
and refused by the TensorRT engine builder and the DLA translation."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from tests.support import trt_harness as h
from tests.support.published_folders import (batch_mate_difference, graphs_folder, only_variant,
                                             published_int8, variants_in)
from edgemm.backends.tensorrt.qdq import translate_file
from edgemm.cli.main import main
from edgemm.config import load_config
from edgemm.engine.pipeline import Pipeline, Request
from edgemm.engine.runtime import Runtime
from edgemm.errors import ModelError
from edgemm.model.manifest import load_manifest
from edgemm.model.quantization import graph_kind, read_ops

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
QUESTION = "how many shapes are there ?"
WAIT_S = 60


def runtime(folder: Path, precision: str = "auto", cache: int = 0) -> Runtime:
    return Runtime(load_config({"model": {"path": str(folder), "precision": precision},
                                "backend": {"warmup": False, "intra_op_threads": 1}, "cache": {"max_bytes": cache}}))


def infer(folder: Path, *extra: str, image: Path = h.SAMPLE, prompt: str = QUESTION):
    return CliRunner().invoke(main, ["infer", str(image), "--prompt", prompt, "--model", str(folder),
                                     "--json", "--quiet", "--max-new-tokens", "4", *extra])


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory) -> Path:
    """The built-in model with only `_int8` graphs, each dynamic int8 (as transformers.js publishes them)."""
    return published_int8(h.MODEL_DIR, tmp_path_factory.mktemp("published") / "tiny-int8")


# ---- what a graph is, by its operators -------------------------------------------------------------

def test_the_kind_comes_from_the_operators_not_the_file_name(tiny_int8):
    assert graph_kind(h.MODEL_DIR / "decoder_model_merged.onnx") == "fp32"
    assert graph_kind(h.MODEL_DIR / "decoder_model_merged_int8.onnx") == "qdq-int8"  # tools/quantize.py's
    assert graph_kind(h.MODEL_DIR / "decoder_model_merged_q4.onnx") == "4bit"
    assert graph_kind(h.MODEL_DIR / "embed_tokens_q4.onnx") == "4bit"  # GatherBlockQuantized
    assert graph_kind(tiny_int8 / "decoder_model_merged_int8.onnx") == "dynamic-int8"  # the same name, published
    assert graph_kind(tiny_int8 / "vision_encoder_int8.onnx") == "dynamic-int8"
    assert graph_kind(tiny_int8 / "embed_tokens_int8.onnx") == "int8-weights"  # a Gather of int8 rows: exact per row


def small_graph(tmp_path: Path, name: str, op: str, dtype: int, domain: str = "com.microsoft") -> Path:
    """A one-node graph with one initializer of `dtype`: enough for its kind."""
    weight = numpy_helper.from_array(np.zeros(4, onnx.helper.tensor_dtype_to_np_dtype(dtype)), "w")
    node = helper.make_node(op, ["x", "w"], ["y"], domain=domain if op not in ("MatMul", "Add") else "")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", dtype, [4])],
                              [helper.make_tensor_value_info("y", dtype, [4])], [weight])
    path = tmp_path / f"{name}.onnx"
    onnx.save(helper.make_model(graph), str(path))
    return path


@pytest.mark.parametrize("op, dtype, kind", [("MatMulBnb4", TensorProto.FLOAT, "bnb4"),
                                             ("MatMulNBits", TensorProto.FLOAT16, "q4f16"),
                                             ("MatMulNBits", TensorProto.FLOAT, "4bit"),
                                             ("Add", TensorProto.FLOAT16, "fp16"),
                                             ("Add", TensorProto.FLOAT, "fp32")])
def test_each_kind_is_told_apart(tmp_path, op, dtype, kind):
    assert graph_kind(small_graph(tmp_path, f"{op}{dtype}", op, dtype)) == kind


def test_the_reader_sees_every_operator_onnx_sees_subgraphs_included():
    """The wire-format reader against onnx's own parser, on every graph committed: a merged
    decoder's operators sit in its If's branches."""
    def ops(graph: onnx.GraphProto) -> set[str]:
        found = set()
        for node in graph.node:
            found.add(node.op_type)
            for attribute in node.attribute:
                for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                    found |= ops(sub)
        return found
    graphs = sorted(FIXTURES.glob("*/onnx/*.onnx")) + sorted(h.MODEL_DIR.glob("*.onnx"))
    assert len(graphs) > 20
    for path in graphs:
        model = onnx.load(str(path), load_external_data=False)
        in_functions = {node.op_type for function in model.functions for node in function.node}
        assert set(read_ops(path).ops) == ops(model.graph) | in_functions, path


def test_a_graph_with_any_dynamic_int8_operator_is_dynamic_int8(tmp_path):
    """A 4-bit graph whose remaining MatMuls quantize_dynamic went over still scales its
    activations per call: its rows depend on their batch mates."""
    x, w = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]), numpy_helper.from_array(np.zeros(4, np.float32), "w")
    nodes = [helper.make_node("MatMulNBits", ["x", "w"], ["a"], domain="com.microsoft"),
             helper.make_node("DynamicQuantizeLinear", ["a"], ["q", "s", "z"])]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("q", TensorProto.UINT8, [4])], [w])
    onnx.save(helper.make_model(graph), str(tmp_path / "mixed.onnx"))
    assert graph_kind(tmp_path / "mixed.onnx") == "dynamic-int8"


def test_operators_inside_a_local_function_count(tmp_path):
    function = helper.make_function("local", "quantized", ["x"], ["y"],
                                    [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
                                    [helper.make_opsetid("", 17)])
    graph = helper.make_graph([helper.make_node("quantized", ["x"], ["y"], domain="local")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [4])])
    model = helper.make_model(graph, functions=[function],
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    onnx.save(model, str(tmp_path / "function.onnx"))
    assert graph_kind(tmp_path / "function.onnx") == "dynamic-int8"


def test_float16_weights_count_in_external_data_and_constant_nodes(tmp_path):
    """fp16 against fp32 by the values the tensors hold, not the bytes inside the .onnx file."""
    weight = numpy_helper.from_array(np.zeros((64, 64), np.float16), "w")
    small = numpy_helper.from_array(np.zeros(4, np.float32), "b")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 64])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT16, [1, 64])], [weight, small])
    onnx.save(helper.make_model(graph), str(tmp_path / "external.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="external.onnx_data", size_threshold=0)
    assert graph_kind(tmp_path / "external.onnx") == "fp16"
    constant = helper.make_node("Constant", [], ["w"], value=weight)
    graph = helper.make_graph([constant, helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 64])], [small])
    onnx.save(helper.make_model(graph), str(tmp_path / "constant.onnx"))
    assert graph_kind(tmp_path / "constant.onnx") == "fp16"


def test_a_file_that_is_no_graph_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "decoder_model_merged.onnx"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelError, match="not an ONNX graph") as info:
        graph_kind(bad)
    assert str(bad) in str(info.value) and "\n" not in str(info.value)


def test_the_kind_is_read_again_when_the_file_changes(tmp_path):
    path = small_graph(tmp_path, "g", "Add", TensorProto.FLOAT)
    assert graph_kind(path) == "fp32"
    small_graph(tmp_path, "g", "MatMulBnb4", TensorProto.FLOAT)  # same path, new content and size
    assert graph_kind(path) == "bnb4"


# ---- a folder with any one precision ----------------------------------------------------------------

@pytest.mark.parametrize("src", [h.MODEL_DIR, FIXTURES / "idefics3-tiny"], ids=["model.yaml", "hugging-face"])
def test_a_q4_only_folder_answers(tmp_path, src):
    folder = only_variant(src, tmp_path / "q4-only", "q4")
    assert variants_in(folder) == {"q4"}
    assert load_manifest(folder).precisions == ["q4"]
    image = h.SAMPLE if src == h.MODEL_DIR else src / "wide.png"
    result = infer(folder, image=image, prompt="describe the image")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["precision"] == "q4" and out["tokens"]
    full = folder.with_name("q4-only-made") if folder.with_name("q4-only-made").is_dir() else src  # fp32 + q4
    alone = runtime(full, "q4").infer(image, "describe the image", max_new_tokens=4)
    assert out["tokens"] == alone.tokens  # the same graphs as in the full folder: the same answer


def test_a_hugging_face_folder_needs_each_graph_in_some_precision(tmp_path):
    folder = only_variant(FIXTURES / "idefics3-tiny", tmp_path / "q4-only", "q4")
    (graphs_folder(folder) / "embed_tokens_q4.onnx").unlink()
    with pytest.raises(ModelError) as info:
        load_manifest(folder)
    message = str(info.value)
    assert "\n" not in message and "without onnx/embed_tokens.onnx in any precision" in message
    assert "vision_encoder q4 · embed_tokens none · decoder q4" in message


def test_an_explicit_precision_missing_for_a_graph_names_each_graph(tmp_path):
    folder = only_variant(FIXTURES / "idefics3-tiny", tmp_path / "q4-only", "q4")
    onnx_dir = graphs_folder(folder)
    (onnx_dir / "decoder_model_merged_q4.onnx").rename(onnx_dir / "decoder_model_merged_fp16.onnx")
    assert load_manifest(folder).precisions == []  # no precision has all three graphs
    result = infer(folder, "--precision", "q4", image=FIXTURES / "idefics3-tiny" / "wide.png")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "q4 missing for decoder" in lines[0]
    assert "per graph: vision_encoder q4 · embed_tokens q4 · decoder fp16" in lines[0]


# ---- a published dynamic int8 folder ---------------------------------------------------------------

def test_auto_runs_a_dynamic_int8_folder_as_what_it_is(tiny_int8):
    rt = runtime(tiny_int8)
    assert rt.precision == "int8"
    assert rt.models.precision_choices["decoder"].startswith("auto: int8 on cpu, the only kind present")
    assert rt.models.kinds[("decoder", "cpu")] == "dynamic-int8"
    assert rt.placement_report()["decoder"]["quantization"] == "dynamic-int8"  # edgemm status shows it
    assert not rt.decodes_batched(None)
    assert runtime(h.MODEL_DIR, "int8").decodes_batched(None)  # edgemm's QDQ int8 batches exactly


def test_dynamic_int8_rows_really_depend_on_their_batch(tiny_int8):
    """Why such a decoder is kept out of batches: its logits for one row change with a batch mate."""
    assert batch_mate_difference(runtime(tiny_int8).generator.decoder) > 1e-3


def test_a_dynamic_int8_folder_gives_the_same_tokens_alone_and_batched(tiny_int8, monkeypatch):
    """Requests piled up behind a held decoder would decode together (max_batch 4, joins on):
    with a dynamic int8 decoder each decodes in a batch of its own, its encoder call too, and
    its prompt prefix is never reused, so every answer is the one it gets alone, every time."""
    rt = runtime(tiny_int8, cache=64 << 20)
    samples = sorted((h.MODEL_DIR / "samples").glob("*.png"))
    questions = [QUESTION, "what color is the largest shape ?", "describe the image", QUESTION]
    work = [(samples[i % len(samples)], q) for i, q in enumerate(questions)] * 2  # each asked twice
    release, entered = threading.Event(), threading.Event()
    open_batch = rt.open_batch

    def held(*args, **kwargs):
        if not entered.is_set():
            entered.set()
            assert release.wait(WAIT_S)
        return open_batch(*args, **kwargs)
    monkeypatch.setattr(rt, "open_batch", held)
    encoded: list[int] = []
    encode = rt.generator.encode
    monkeypatch.setattr(rt.generator, "encode", lambda pixels: encoded.append(len(pixels)) or encode(pixels))
    with Pipeline(rt, queue_size=len(work), max_batch=4, batch_timeout_ms=50, decoder_joins="on") as pipeline:
        futures = [pipeline.submit(Request(image, q, {"tier": "low", "max_new_tokens": 6}), block=False)
                   for image, q in work]
        assert entered.wait(WAIT_S)
        release.set()
        results = [f.result(timeout=WAIT_S) for f in futures]
    assert set(encoded) == {1}
    assert [r.decode_batch for r in results] == [1] * len(work)
    assert not any(r.prefix_reused for r in results)
    fresh = runtime(tiny_int8)
    for (image, q), result in zip(work, results):
        assert result.tokens == fresh.infer(image, q, tier="low", max_new_tokens=6).tokens, (image.name, q)


def test_engines_build_refuses_a_dynamic_int8_graph(tiny_int8):
    result = CliRunner().invoke(main, ["engines", "build", str(tiny_int8), "--dry-run", "--tensorrt", "10.3"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "vision_encoder_int8.onnx: dynamic-int8" in lines[0] and "TensorRT's ONNX parser cannot take" in lines[0]
    assert f"python tools/quantize.py {tiny_int8}" in lines[0]
    # edgemm's own QDQ graphs still plan
    done = CliRunner().invoke(main, ["engines", "build", str(h.MODEL_DIR), "--dry-run", "--tensorrt", "10.3"])
    assert done.exit_code == 0, done.output


def test_engines_build_refuses_a_4bit_graph(tmp_path):
    folder = only_variant(h.MODEL_DIR, tmp_path / "q4", "q4")
    for graph in ("vision_encoder", "embed_tokens", "decoder_model_merged"):  # a q4 file named _int8
        (folder / f"{graph}_q4.onnx").rename(folder / f"{graph}_int8.onnx")
    result = CliRunner().invoke(main, ["engines", "build", str(folder), "--dry-run", "--tensorrt", "10.3",
                                       "--components", "decoder"])
    assert result.exit_code == 2 and "decoder_model_merged_int8.onnx: 4bit" in result.stderr, result.output


def test_the_dla_translation_refuses_a_graph_without_qdq_scales(tiny_int8, tmp_path):
    with pytest.raises(ModelError, match="no QuantizeLinear/DequantizeLinear scale on any activation") as info:
        translate_file(tiny_int8 / "vision_encoder_int8.onnx", tmp_path / "out.onnx", tmp_path / "cache", "10.3.0")
    assert "MatMulInteger" in str(info.value) or "ConvInteger" in str(info.value)
    assert not (tmp_path / "cache").exists()


def test_runtime_calls_split_a_dynamic_int8_batch_into_single_requests(tiny_int8, monkeypatch):
    """Runtime.encode on several images and Runtime.decode_batch on several requests: one call
    per image and a decoding batch per request, each answer the one it gets alone."""
    rt = runtime(tiny_int8)
    samples = sorted((h.MODEL_DIR / "samples").glob("*.png"))
    prepared = [rt.prepare(s, QUESTION, tier="low", max_new_tokens=5) for s in samples]
    calls: list[int] = []
    encode = rt.generator.encode
    monkeypatch.setattr(rt.generator, "encode", lambda pixels: calls.append(len(pixels)) or encode(pixels))
    features = rt.encode(np.concatenate([p.pixel_values for p in prepared]))
    assert calls == [1] * len(samples)
    results = rt.decode_batch(prepared, [features[i:i + 1] for i in range(len(samples))])
    assert [r.decode_batch for r in results] == [1] * len(samples)
    for sample, result in zip(samples, results):
        assert result.tokens == runtime(tiny_int8).infer(sample, QUESTION, tier="low", max_new_tokens=5).tokens
    qdq = runtime(h.MODEL_DIR, "int8")  # edgemm's QDQ int8: batched as ever
    batched = qdq.decode_batch([qdq.prepare(s, QUESTION, tier="low", max_new_tokens=5) for s in samples],
                               [features[i:i + 1] for i in range(len(samples))])
    assert [r.decode_batch for r in batched] == [len(samples)] * len(samples)
