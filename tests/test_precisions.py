"""Precision variants: recognised by file suffix, chosen per backend by `auto`, made by
tools/quantize.py (q4, quantized) for the built-in model, and a missing one named."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from tests.support import trt_harness as h
from tests.support.published_folders import batch_mate_difference
from edgemm.cli.main import main
from edgemm.config import load_config
from edgemm.errors import ModelError
from edgemm.model.hf_folder import precisions_present
from edgemm.model.manifest import load_manifest
from edgemm.model.manifest_types import PRECISIONS
from edgemm.engine.runtime import Runtime

ROOT = Path(__file__).resolve().parent.parent
GRAPHS = ("vision_encoder.onnx", "embed_tokens.onnx", "decoder_model_merged.onnx")
QUESTION = "how many shapes are there ?"


def without_variants(folder, names):
    """shutil.copytree's ignore: every *_<precision>.onnx."""
    return [n for n in names if any(n.endswith(f"_{p}.onnx") for p in PRECISIONS)]


def tiny_copy(tmp_path: Path, variants: tuple[str, ...] = (), graphs: tuple[str, ...] = GRAPHS) -> Path:
    """The built-in model's folder without its variants, plus `variants` as links to the fp32
    graphs (a link is enough for recognition and selection: each is a valid graph)."""
    folder = tmp_path / "tiny"
    shutil.copytree(h.MODEL_DIR, folder, ignore=without_variants)
    for variant in variants:
        for graph in graphs:
            (folder / graph.replace(".onnx", f"_{variant}.onnx")).symlink_to(folder / graph)
    return folder


def cpu_runtime(folder: Path, precision: str = "auto") -> Runtime:
    return Runtime(load_config({"model": {"path": str(folder), "precision": precision},
                                "backend": {"warmup": False, "intra_op_threads": 1}, "cache": {"max_bytes": 0}}))


# ---- recognition ---------------------------------------------------------------------------------

def test_every_suffix_is_recognised_in_a_model_yaml_folder(tmp_path):
    folder = tiny_copy(tmp_path, tuple(p for p in PRECISIONS if p != "fp32"))
    assert load_manifest(folder).precisions == list(PRECISIONS)


def test_every_suffix_is_recognised_in_a_hugging_face_folder(tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(h.IDEFICS3_DIR, folder, ignore=without_variants)
    for variant in PRECISIONS[1:]:
        for graph in GRAPHS:
            (folder / "onnx" / graph.replace(".onnx", f"_{variant}.onnx")).symlink_to(folder / "onnx" / graph)
    assert precisions_present(folder) == list(PRECISIONS)
    assert load_manifest(folder).precisions == list(PRECISIONS)


def test_a_variant_counts_only_with_all_three_graphs(tmp_path):
    folder = tiny_copy(tmp_path, ("q4",), graphs=("decoder_model_merged.onnx",))
    assert load_manifest(folder).precisions == ["fp32"]


# ---- selection -------------------------------------------------------------------------------------

def test_auto_on_the_cpu_takes_q4_and_never_the_qdq_int8_nor_dynamic_int8(tmp_path):
    rt = cpu_runtime(tiny_copy(tmp_path, ("int8", "quantized", "uint8", "q4")))
    assert rt.precision == "q4" and {c.precision for c in rt.components.all()} == {"q4"}
    assert rt.models.precision_choices["decoder"].startswith("auto: q4 on cpu")
    rt = cpu_runtime(tiny_copy(tmp_path / "b", ("int8", "quantized", "uint8", "fp16")))
    # int8 is QDQ (TensorRT's, slower than fp32 on a CPU), dynamic int8 is not batch-invariant
    # (test_dynamic_int8_rows_depend_on_their_batch_mates), fp16 is slower than fp32 on a CPU
    assert rt.precision == "fp32"
    assert rt.models.precision_choices["decoder"].endswith("present: fp32)")


def test_auto_picks_per_component_by_what_the_folder_holds(tmp_path):
    folder = tiny_copy(tmp_path, ("q4",), graphs=("decoder_model_merged.onnx",))
    rt = cpu_runtime(folder)
    assert {c.name: c.precision for c in rt.components.all()} == {
        "vision_encoder": "fp32", "embed_tokens": "fp32", "decoder": "q4"}
    assert rt.precision == "fp32+q4"


def test_feature_cache_keys_name_the_variants_loaded_not_auto(tmp_path):
    """Features and prompt prefixes are cached by key: `auto` over a folder with a q4 decoder
    keys apart from `auto` over one without, and the latter as named fp32 (the same graphs)."""
    pixels = np.zeros((3, 8, 8), np.float32)
    with_q4 = cpu_runtime(tiny_copy(tmp_path / "a", ("q4",), graphs=("decoder_model_merged.onnx",)))
    assert with_q4.preparation.variants == "vision_encoder=fp32 embed_tokens=fp32 decoder=q4"
    plain = tiny_copy(tmp_path / "b")
    keys = [rt.preparation.feature_key(pixels, "low") for rt in (with_q4, cpu_runtime(plain), cpu_runtime(plain, "fp32"))]
    assert keys[0] != keys[1] and keys[1] == keys[2]


def test_each_result_has_its_own_precision_choice(tmp_path):
    """A caller that changes one result's precision_choice changes neither the next result's
    nor the runtime's."""
    rt = cpu_runtime(tiny_copy(tmp_path, ("q4",)))
    image = h.MODEL_DIR / "samples" / "scene_11.png"
    first = rt.infer(image, QUESTION, max_new_tokens=2)
    expected = dict(first.precision_choice)
    assert expected["decoder"].startswith("auto: q4 on cpu")
    first.precision_choice["decoder"] = "changed"
    first.precision_choice.clear()
    assert rt.infer(image, QUESTION, max_new_tokens=2).precision_choice == expected
    assert rt.models.precision_choices == expected


def test_an_explicit_precision_is_loaded_even_where_auto_would_not(tmp_path):
    rt = cpu_runtime(tiny_copy(tmp_path, ("int8", "q4")), "int8")
    assert rt.precision == "int8" and rt.models.precision_choices == {}


def test_auto_on_tensorrt_takes_int8_then_fp16(monkeypatch, tmp_path):
    h.install(monkeypatch, "10.3.0")
    gpu = {"vision_encoder": ["gpu"], "embed_tokens": ["gpu"], "decoder": ["gpu"]}
    h.build(tmp_path / "fp16", precision="fp16")
    rt = h.runtime(tmp_path / "fp16", "auto", **gpu)
    assert rt.precision == "fp16" and rt.devices["decoder"] == "gpu"
    assert rt.models.precision_choices["decoder"].startswith("auto: fp16 on gpu")
    h.build(tmp_path / "both", precision="fp16")
    h.build(tmp_path / "both", precision="int8")
    rt = h.runtime(tmp_path / "both", "auto", **gpu)
    assert rt.precision == "int8" and {c.precision for c in rt.components.all()} == {"int8"}


def test_auto_without_engines_falls_back_to_the_cpu_and_its_own_order(monkeypatch, tmp_path):
    h.install(monkeypatch, "10.3.0")
    folder = tiny_copy(tmp_path, ("int8", "q4"))
    rt = h.runtime(tmp_path / "none", "auto", model_dir=folder)  # [gpu, cpu] for every component
    assert rt.devices["decoder"] == "cpu" and rt.precision == "q4"


def test_infer_json_says_which_precision_auto_took_and_why(tmp_path):
    folder = tiny_copy(tmp_path, ("int8", "q4"))
    result = CliRunner().invoke(main, ["infer", str(h.SAMPLE), "--prompt", QUESTION, "--model", str(folder),
                                       "--json", "--quiet", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["precision"] == "q4"
    assert out["precision_choice"]["decoder"].startswith("auto: q4 on cpu")


def test_a_missing_variant_is_one_line_naming_the_precisions_present(tmp_path):
    folder = tiny_copy(tmp_path, ("int8",))
    with pytest.raises(ModelError) as info:
        cpu_runtime(folder, "q4")
    message = str(info.value)
    assert "\n" not in message and "has no q4 graph" in message and "precisions present: fp32, int8" in message
    assert "tools/quantize.py" in message and "--variant q4" in message
    result = CliRunner().invoke(main, ["infer", str(h.SAMPLE), "--prompt", QUESTION, "--model", str(folder),
                                       "--precision", "q4", "--quiet"])
    assert result.exit_code == 2 and "precisions present: fp32, int8" in result.stderr


# ---- tools/quantize.py's CPU variants on the built-in model ------------------------------------------

@pytest.fixture(scope="module")
def quantized_tiny(tmp_path_factory) -> Path:
    # the runtime's floor is onnxruntime 1.20; the tool's q4 quantizer module is 1.22's (README "Set-up")
    pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer",
                        reason="tools/quantize.py needs onnxruntime 1.22 or newer")
    folder = tiny_copy(tmp_path_factory.mktemp("quantized"))
    for variant in ("q4", "quantized"):
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "quantize.py"), str(folder), "--variant", variant],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["variant"] == variant
    return folder


@pytest.mark.parametrize("variant, op", [("q4", "MatMulNBits"), ("quantized", "MatMulInteger")])
def test_quantize_tool_makes_cpu_variants_that_load_and_answer(quantized_tiny, variant, op):
    decoder = onnx.load(str(quantized_tiny / f"decoder_model_merged_{variant}.onnx"))
    ops = [n.op_type for n in decoder.graph.node]
    weights = {t.name for t in decoder.graph.initializer}
    assert op in ops and not [n.name for n in decoder.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    assert "DequantizeLinear" not in ops  # not QDQ: nothing to dequantize on every step
    fp32 = (quantized_tiny / "decoder_model_merged.onnx").stat().st_size
    assert (quantized_tiny / f"decoder_model_merged_{variant}.onnx").stat().st_size < 0.4 * fp32
    assert variant in load_manifest(quantized_tiny).precisions
    rt = cpu_runtime(quantized_tiny, variant)
    assert {c.precision for c in rt.components.all()} == {variant}
    # the samples' ground truth, every question, at the two tiers fp32 answers all of right
    truth = json.loads((quantized_tiny / "samples" / "ground_truth.json").read_text())
    wrong = [(name, q["prompt"], tier) for name, scene in truth.items() for q in scene["questions"]
             for tier in ("mid", "high")
             if rt.infer(quantized_tiny / "samples" / name, q["prompt"], tier=tier).text != q["answer"]]
    assert wrong == []


def test_dynamic_int8_rows_depend_on_their_batch_mates_and_q4_rows_do_not(quantized_tiny):
    """Why `auto` never takes `quantized`: quantize_dynamic scales the activations per call over
    the whole batch, so a row's logits change with the rows beside it; q4 (MatMulNBits) scales
    them per row and block, so a row decodes alike alone or in any batch, as fp32 does."""
    differences = {precision: batch_mate_difference(cpu_runtime(quantized_tiny, precision).generator.decoder)
                   for precision in ("fp32", "q4", "quantized")}
    assert differences["fp32"] == 0.0 and differences["q4"] == 0.0
    assert differences["quantized"] > 1e-3
