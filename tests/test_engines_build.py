"""`edgemm engines build` / tools/build_engines.py: argument checks, what gets built, and
(with TensorRT and a GPU only) a real GPU engine compared with onnxruntime."""
from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemm.cli import main
from edgemm.engines import build
from edgemm.engines.build import BuildRequest, EngineJob, plan_jobs, quantization_mode
from edgemm.engines.platform import MISSING, Platform
from edgemm.errors import EngineError, InputError, ModelError
from edgemm.model.manifest import load_manifest

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
ROOT = Path(__file__).resolve().parent.parent
ORIN = Platform(tensorrt="10.3.0", gpu="Orin", compute_capability="8.7", integrated=True, dla_cores=2)
NANO = dataclasses.replace(ORIN, gpu="Orin Nano", dla_cores=0)


def run_cli(*args):
    return CliRunner().invoke(main, ["engines", "build", *map(str, args)])


def one_line_error(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgemm: error: "), result.stderr
    return lines[0][len("edgemm: error: "):]


@pytest.fixture
def on(monkeypatch):
    """on(platform): make the build see that module instead of probing the hardware."""
    def use(platform: Platform):
        monkeypatch.setattr(build, "probe", lambda: platform)
    return use


# ---- the command line ----------------------------------------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["--device", "dla2"], "Invalid value for '--device': 'dla2' is not one of 'gpu', 'dla0', 'dla1'."),
    (["--device", "cpu"], "Invalid value for '--device': 'cpu' is not one of 'gpu', 'dla0', 'dla1'."),
    (["--precision", "fp32"], "Invalid value for '--precision': 'fp32' is not one of 'int8', 'fp16'."),
    (["--max-beams", "0"], "Invalid value for '--max-beams': 0 is not in the range 1<=x<=16."),
])
def test_bad_options_are_usage_errors(model_dir, args, expected):
    assert one_line_error(run_cli(model_dir, *args)).startswith(expected)


def test_missing_model_folder(tmp_path):
    assert one_line_error(run_cli(tmp_path / "nope")) == f"model folder not found: {tmp_path / 'nope'}"


def test_folder_without_model_yaml(tmp_path):
    assert one_line_error(run_cli(tmp_path)) == f"{tmp_path} is not a model folder: model.yaml not found"


def test_dla_on_a_module_without_dla_is_refused(model_dir, on):
    on(NANO)
    assert one_line_error(run_cli(model_dir, "--device", "dla0")) == (
        "dla0: this module (Orin Nano) has no DLA cores (Orin Nano and Thor have none; "
        "AGX Orin and Orin NX have two); use gpu")


def test_second_dla_core_on_a_one_core_module(model_dir, on):
    on(dataclasses.replace(ORIN, dla_cores=1))
    assert one_line_error(run_cli(model_dir, "--device", "dla1")) == (
        "dla1: this module (Orin) has 1 DLA core(s), dla0..dla0")


def test_decoder_on_a_dla_is_refused(model_dir, on):
    on(ORIN)
    assert one_line_error(run_cli(model_dir, "--device", "dla0", "--components", "decoder")) == (
        "decoder cannot be built for dla0: a DLA takes static shapes, so only the vision encoder goes there; "
        "build decoder with --device gpu")


def test_unknown_tier_and_component(model_dir, on):
    on(ORIN)
    assert one_line_error(run_cli(model_dir, "--tiers", "low,huge")) == (
        "unknown tier 'huge' for model tiny-vlm (tiers: low, mid, high)")
    assert one_line_error(run_cli(model_dir, "--components", "encoder")) == (
        "unknown component 'encoder' (components: vision_encoder, embed_tokens, decoder)")


@pytest.mark.skipif(HAVE_TENSORRT, reason="checks the message where TensorRT is absent")
def test_without_tensorrt_the_build_says_so(model_dir):
    assert one_line_error(run_cli(model_dir)) == MISSING


@pytest.mark.skipif(HAVE_TENSORRT, reason="checks the message where TensorRT is absent")
def test_tools_script_is_the_same_command(model_dir):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "build_engines.py"), str(model_dir),
                             "--precision", "fp32"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.startswith("edgemm: error: Invalid value for '--precision'")
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "build_engines.py"), str(model_dir)],
                            capture_output=True, text=True, cwd=ROOT)
    assert (result.returncode, result.stderr.strip()) == (2, f"edgemm: error: {MISSING}")


# ---- what gets built -------------------------------------------------------------------------

def jobs(model_dir, platform=ORIN, **options) -> list[EngineJob]:
    request = BuildRequest(model_dir=model_dir, out=Path("unused"), **options)
    return plan_jobs(request, load_manifest(model_dir), platform)


def test_gpu_int8_builds_every_component_from_its_qdq_graph(model_dir):
    built = jobs(model_dir)
    assert [(j.component, j.tier, j.onnx.name, j.file) for j in built] == [
        ("vision_encoder", None, "vision_encoder_int8.onnx", "vision_encoder.gpu.int8.plan"),
        ("embed_tokens", None, "embed_tokens_int8.onnx", "embed_tokens.gpu.int8.plan"),
        ("decoder", None, "decoder_model_merged_int8.onnx", "decoder.gpu.int8.plan")]
    encoder = built[0].profiles
    assert encoder == [{"pixel_values": {"min": [1, 3, 96, 96], "opt": [1, 3, 256, 256], "max": [4, 3, 256, 256]}}]


def test_decoder_profiles_cover_prefill_and_single_token_decode(model_dir):
    decoder = jobs(model_dir, components=["decoder"], max_beams=8)[0]
    prefill, decode = decoder.profiles
    layers = {n for n in prefill if n.startswith("past_key_values.")}
    assert len(layers) == 8  # 4 layers, key and value
    assert prefill["past_key_values.0.key"] == {"min": [1, 4, 0, 48], "opt": [1, 4, 0, 48], "max": [8, 4, 0, 48]}
    assert prefill["inputs_embeds"] == {"min": [1, 1, 192], "opt": [1, 64, 192], "max": [8, 320, 192]}
    assert prefill["attention_mask"]["max"] == [8, 320]
    # one new token (opt), up to max_context-1 for the rest of a prompt after a cached image prefix
    assert decode["inputs_embeds"] == {"min": [1, 1, 192], "opt": [1, 1, 192], "max": [8, 319, 192]}
    assert decode["position_ids"]["max"] == [8, 319]
    assert decode["past_key_values.3.value"] == {"min": [1, 4, 1, 48], "opt": [1, 4, 160, 48], "max": [8, 4, 319, 48]}
    assert decode["attention_mask"] == {"min": [1, 2], "opt": [1, 161], "max": [8, 638]}


def test_dla_builds_one_static_encoder_plan_per_tier(model_dir):
    built = jobs(model_dir, device="dla1", tiers=["low", "high"])
    assert [(j.component, j.tier, j.file) for j in built] == [
        ("vision_encoder", "low", "vision_encoder.dla1.int8.low.plan"),
        ("vision_encoder", "high", "vision_encoder.dla1.int8.high.plan")]
    for job, size in zip(built, (96, 256)):
        shape = [1, 3, size, size]
        assert job.profiles == [{"pixel_values": {"min": shape, "opt": shape, "max": shape}}]


def test_fp16_builds_from_the_fp32_graph_before_tensorrt_11(model_dir):
    assert {j.onnx.name for j in jobs(model_dir, precision="fp16")} == {
        "vision_encoder.onnx", "embed_tokens.onnx", "decoder_model_merged.onnx"}


def test_fp16_on_tensorrt_11_needs_the_fp16_graph(model_dir):
    with pytest.raises(ModelError, match="vision_encoder has no fp16 graph"):
        jobs(model_dir, platform=dataclasses.replace(ORIN, tensorrt="11.4.1"), precision="fp16")


def test_tensorrt_releases_without_dla_refuse_dla(model_dir):
    with pytest.raises(EngineError, match=r"^TensorRT 10\.8\.0 does not support the DLA"):
        jobs(model_dir, platform=dataclasses.replace(ORIN, tensorrt="10.8.0"), device="dla0")
    assert jobs(model_dir, platform=dataclasses.replace(ORIN, tensorrt="11.4.1"), device="dla0")


def test_bad_request_values_are_input_errors(model_dir):
    with pytest.raises(InputError, match="unknown device 'npu'"):
        jobs(model_dir, device="npu")
    with pytest.raises(InputError, match="unknown precision 'fp32'"):
        jobs(model_dir, precision="fp32")


@pytest.mark.parametrize("device, precision, version, mode", [
    ("gpu", "int8", "8.6.2", "explicit"), ("gpu", "fp16", "10.3.0", "none"),
    ("dla0", "int8", "8.6.2", "calibration-cache"), ("dla1", "int8", "10.7.0", "calibration-cache"),
    ("dla0", "fp16", "10.3.0", "none"), ("dla0", "int8", "11.4.1", "strongly-typed"),
    ("gpu", "int8", "11.4.1", "strongly-typed"), ("gpu", "fp16", "11.0.0", "strongly-typed"),
])
def test_quantization_mode_follows_the_tensorrt_version(device, precision, version, mode):
    job = EngineJob("vision_encoder", device, precision, "low", Path("x.onnx"))
    assert quantization_mode(job, version) == mode


# ---- on a machine with TensorRT and a GPU -------------------------------------------------------

def _gpu_platform() -> Platform | None:
    """The platform where TensorRT and a CUDA device actually start (not just an importable module)."""
    if not HAVE_TENSORRT:
        return None
    try:
        from edgemm.engines.platform import probe
        return probe()
    except EngineError:
        return None


GPU = _gpu_platform()


@pytest.mark.tensorrt
@pytest.mark.skipif(GPU is None, reason="needs TensorRT and a CUDA device that initialises")
def test_gpu_engines_build_run_and_match_onnxruntime(model_dir, tmp_path):
    from edgemm.config import load_config
    from edgemm.runtime import Runtime
    # a precision the model has on this TensorRT: strongly typed FP16 (11+) needs an _fp16 graph
    precision = "fp16" if build.version_tuple(GPU.tensorrt) < build.STRONGLY_TYPED else "int8"
    runtime = Runtime(load_config({"model": {"path": str(model_dir), "precision": "int8" if precision == "int8"
                                             else "fp32"}, "backend": {"warmup": False}}))
    result = run_cli(model_dir, "--out", tmp_path, "--device", "gpu", "--precision", precision)
    assert result.exit_code == 0, result.output
    rt = Runtime(load_config({"model": {"path": str(model_dir), "precision": precision, "engines": str(tmp_path)},
                              "placement": {"vision_encoder": ["gpu"], "embed_tokens": ["gpu"], "decoder": ["gpu"]},
                              "backend": {"warmup": False}}))
    assert rt.devices == {"vision_encoder": "gpu", "embed_tokens": "gpu", "decoder": "gpu"}
    image = model_dir / "samples" / "scene_11.png"
    for tier in ("low", "high"):
        pixels, _ = runtime.preprocess(image, tier)
        ours, reference = rt.generator.encode(pixels), runtime.generator.encode(pixels)
        assert np.abs(ours - reference).max() < 0.05 * np.abs(reference).max()
    assert rt.infer(image, "how many shapes are there ?").text == runtime.infer(image, "how many shapes are there ?").text
