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

from edgemm.cli.main import main
from edgemm.backends.tensorrt import build
from edgemm.backends.tensorrt.build import BuildRequest, EngineJob, plan_jobs, quantization_mode
from edgemm.backends.tensorrt.platform import MISSING, Platform
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
        from edgemm.backends.tensorrt.platform import probe
        return probe()
    except EngineError:
        return None


GPU = _gpu_platform()


@pytest.mark.tensorrt
@pytest.mark.skipif(GPU is None, reason="needs TensorRT and a CUDA device that initialises")
def test_gpu_engines_build_run_and_match_onnxruntime(model_dir, tmp_path):
    from edgemm.config import load_config
    from edgemm.engine.runtime import Runtime
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


# ---- profiles from the graph's named dimensions (any model folder) ---------------------------------

IDEFICS3 = ROOT / "tests" / "fixtures" / "idefics3-tiny"


def test_idefics3_gpu_profiles_cover_every_input_by_its_named_dimensions():
    built = jobs(IDEFICS3, max_batch=2, max_beams=4)
    assert [(j.component, j.tier, j.onnx.name) for j in built] == [
        ("vision_encoder", None, "vision_encoder_int8.onnx"), ("embed_tokens", None, "embed_tokens_int8.onnx"),
        ("decoder", None, "decoder_model_merged_int8.onnx")]
    # 5-D tiles [B,T,3,32,32]: 1 tile (the global tier) … 10 (3x3 tiles + the global image); the mask alike
    assert built[0].profiles == [{
        "pixel_values": {"min": [1, 1, 3, 32, 32], "opt": [1, 10, 3, 32, 32], "max": [2, 10, 3, 32, 32]},
        "pixel_attention_mask": {"min": [1, 1, 32, 32], "opt": [1, 10, 32, 32], "max": [2, 10, 32, 32]}}]
    prefill, decode = built[2].profiles
    assert set(decode) == {"inputs_embeds", "attention_mask", "position_ids", *(
        f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value"))}
    assert decode["past_key_values.1.value"] == {"min": [1, 2, 1, 16], "opt": [1, 2, 512, 16], "max": [4, 2, 1023, 16]}
    assert decode["attention_mask"] == {"min": [1, 2], "opt": [1, 513], "max": [4, 2046]}
    assert prefill["inputs_embeds"]["max"] == [4, 1024, 64]


def test_idefics3_dla_plan_is_one_tile_for_every_tier():
    built = jobs(IDEFICS3, device="dla0")
    assert [(j.component, j.tier, j.file) for j in built] == [("vision_encoder", None, "vision_encoder.dla0.int8.plan")]
    assert built[0].profiles == [{"pixel_values": {k: [1, 1, 3, 32, 32] for k in ("min", "opt", "max")},
                                  "pixel_attention_mask": {k: [1, 1, 32, 32] for k in ("min", "opt", "max")}}]


def _with_encoder_axis(tmp_path: Path, model_dir: Path, axis: int, name: str) -> Path:
    """A copy of `model_dir` whose int8 encoder names `axis` of pixel_values `name` ("" = unnamed)."""
    import onnx
    import shutil
    copy = tmp_path / model_dir.name
    shutil.copytree(model_dir, copy, ignore=shutil.ignore_patterns("samples"))
    path = copy / "vision_encoder_int8.onnx"
    graph = onnx.load(str(path))
    dim = graph.graph.input[0].type.tensor_type.shape.dim[axis]
    dim.Clear()
    if name:
        dim.dim_param = name
    onnx.save(graph, str(path))
    return copy


@pytest.mark.parametrize("name, reason", [
    ("image_side", "its axis 2 is 'image_side', not a dimension edgemm sizes here (batch_size, batch, height, width)"),
    ("", "its axis 2 is dynamic without a name (re-export the graph with named dynamic axes)"),
])
def test_an_axis_it_cannot_size_refuses_the_build_naming_the_input(model_dir, tmp_path, name, reason):
    copy = _with_encoder_axis(tmp_path, model_dir, 2, name)
    message = one_line_error(run_cli(copy, "--dry-run", "--tensorrt", "10.3.0"))
    assert message == f"cannot profile input 'pixel_values' of vision_encoder_int8.onnx: {reason}"


def test_dry_run_prints_the_jobs_without_tensorrt():
    result = CliRunner().invoke(main, ["engines", "build", str(IDEFICS3), "--dry-run", "--tensorrt", "10.3.0",
                                       "--components", "vision_encoder,embed_tokens"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "vision_encoder.gpu.int8.plan: from vision_encoder_int8.onnx (explicit), 1 profile(s)",
        "  profile 0 pixel_values: min [1, 1, 3, 32, 32] opt [1, 10, 3, 32, 32] max [4, 10, 3, 32, 32]",
        "  profile 0 pixel_attention_mask: min [1, 1, 32, 32] opt [1, 10, 32, 32] max [4, 10, 32, 32]",
        "embed_tokens.gpu.int8.plan: from embed_tokens_int8.onnx (explicit), 1 profile(s)",
        "  profile 0 input_ids: min [1, 1] opt [1, 32] max [16, 1024]"]
    assert one_line_error(CliRunner().invoke(main, ["engines", "build", str(IDEFICS3), "--tensorrt", "10.3.0"])) \
        .startswith("--tensorrt is for --dry-run")


# ---- FP16 at a strongly typed DLA plan's boundary --------------------------------------------------

def _odd_graph(folder: Path) -> Path:
    """FP32 x and int64 k in; out: y = x·W, z = y + x (a node reads the output y), c = float(k),
    x_fp32 = -x (the name edgemm would give x inside), x and k passed through; y's shape in
    value_info; W stored as external data next to the graph."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    weights = numpy_helper.from_array(np.arange(9, dtype=np.float32).reshape(3, 3) / 7, "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Add", ["y", "x"], ["z"]),
             helper.make_node("Cast", ["k"], ["c"], to=TensorProto.FLOAT), helper.make_node("Neg", ["x"], ["x_fp32"])]
    io = {n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("x", "y", "z", "x_fp32")}
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [2])
    graph = helper.make_graph(nodes, "odd", [io["x"], k],
                              [io["y"], io["z"], helper.make_tensor_value_info("c", TensorProto.FLOAT, [2]),
                               io["x_fp32"], helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]), k],
                              [weights], value_info=[helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    folder.mkdir()
    path = folder / "odd.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, location="odd.onnx.data", size_threshold=0)
    return path


def test_fp16_io_makes_every_fp32_input_and_output_fp16_and_keeps_the_names(tmp_path):
    import onnx
    import onnxruntime as ort
    import shutil
    source = _odd_graph(tmp_path / "model")
    out = tmp_path / "build" / "odd.fp16_io.onnx"
    out.parent.mkdir()
    assert build.fp16_io(source, out) == ["x", "y", "z", "c", "x_fp32"]  # k is int64: left alone
    x = (np.arange(6, dtype=np.float32).reshape(2, 3) / 3).astype(np.float16)
    k = np.array([3, -4], np.int64)
    theirs = ort.InferenceSession(str(source)).run(None, {"x": x.astype(np.float32), "k": k})
    shutil.rmtree(source.parent)  # the converted graph has its weights with it
    converted = onnx.load(str(out))
    onnx.checker.check_model(converted)
    types = {v.name: v.type.tensor_type.elem_type for v in (*converted.graph.input, *converted.graph.output)}
    assert types == {"x": onnx.TensorProto.FLOAT16, "k": onnx.TensorProto.INT64, "y": onnx.TensorProto.FLOAT16,
                     "z": onnx.TensorProto.FLOAT16, "c": onnx.TensorProto.FLOAT16, "x_fp32": onnx.TensorProto.FLOAT16}
    ours = ort.InferenceSession(str(out)).run(None, {"x": x, "k": k})
    assert np.array_equal(ours.pop(), k) and np.array_equal(theirs.pop(), k)
    assert len(ours) == 5
    for mine, reference in zip(ours, theirs):  # the same graph in FP32 inside, rounded to FP16 at the edges
        assert mine.dtype == np.float16 and np.array_equal(mine, reference.astype(np.float16))


QWEN2_VL = ROOT / "tests" / "fixtures" / "qwen2-vl-tiny"


def test_qwen2_vl_profiles_are_patches_with_their_grid_and_3d_positions():
    """GPU: flattened patches from one image token to max_batch images of the most tokens a tier
    gives (113 at the 64-token budget, a 200:1 image), the top budget the optimum; the grid one
    row per image; the decoder's position_ids [3, B, S]. DLA: one static plan per pixel budget,
    one image at the tier's square grid."""
    vision, _, decoder = jobs(QWEN2_VL, max_batch=2, max_beams=4)
    assert vision.profiles == [{"pixel_values": {"min": [4, 1176], "opt": [256, 1176], "max": [2 * 113 * 4, 1176]},
                                "grid_thw": {"min": [1, 3], "opt": [1, 3], "max": [2, 3]}}]
    prefill, decode = decoder.profiles
    assert prefill["position_ids"] == {"min": [3, 1, 1], "opt": [3, 1, 64], "max": [3, 4, 1024]}
    assert decode["position_ids"] == {"min": [3, 1, 1], "opt": [3, 1, 1], "max": [3, 4, 1023]}
    dla = jobs(QWEN2_VL, device="dla0")
    assert [(j.tier, j.profiles[0]["pixel_values"]["max"]) for j in dla] == [
        ("16x28x28", [64, 1176]), ("32x28x28", [100, 1176]), ("64x28x28", [256, 1176])]
    assert all(j.profiles[0]["grid_thw"] == {k: [1, 3] for k in ("min", "opt", "max")} for j in dla)


def test_a_family_of_one_file_sizes_its_patch_encoders_profiles(monkeypatch):
    """The builder knows no family: a family registered from anywhere that says how many patch
    rows an image makes at a tier (encoder_patches) gets its patch profiles from that alone."""
    from edgemm.model import family
    from edgemm.model.family import EncoderPatches, register

    monkeypatch.setattr(family, "_registry", dict(family.registered()))  # restored afterwards
    asked = []

    @register("patchy_vlm")
    class PatchyFamily:
        @staticmethod
        def encoder_patches(manifest, tier):
            asked.append(tier.name)
            tokens = tier.image_tokens
            return EncoderPatches(least=3, budget=5 * tokens, most=7 * tokens, square=tier.height + tier.width)

    model = dataclasses.replace(load_manifest(QWEN2_VL), family="patchy_vlm")
    dims = build._input_dims(model.graph_path("vision_encoder", "fp32"))
    tiers = list(model.tiers.values())  # 16, 32 and 64 image tokens
    (gpu,) = build.encoder_profiles(dims, model, tiers, max_batch=2, static=False)
    assert gpu["pixel_values"] == {"min": [3, 1176], "opt": [5 * 64, 1176], "max": [2 * 7 * 64, 1176]}
    assert gpu["grid_thw"] == {"min": [1, 3], "opt": [1, 3], "max": [2, 3]}
    (dla,) = build.encoder_profiles(dims, model, tiers[1:2], max_batch=1, static=True)
    side = tiers[1].height + tiers[1].width
    assert dla["pixel_values"] == {"min": [side, 1176], "opt": [side, 1176], "max": [side, 1176]}
    assert asked == [t.name for t in tiers] + [tiers[1].name]


def test_qwen2_vl_gpu_profile_fits_the_most_elongated_image_at_the_top_tier():
    """smart_resize keeps one unit on the short side: a 200:1 image (the most preparation takes)
    gets more patches than the top budget's. The plan `--dry-run` prints takes --max-batch of them."""
    import numpy as np
    from edgemm.config import load_config
    from edgemm.engine.runtime import Runtime
    result = CliRunner().invoke(main, ["engines", "build", str(QWEN2_VL), "--dry-run", "--tensorrt", "10.3.0",
                                       "--components", "vision_encoder", "--max-batch", "3"])
    assert result.exit_code == 0, result.output
    ranges = {line.split()[2][:-1]: line for line in result.output.splitlines() if line.startswith("  profile 0")}
    patches_max = int(ranges["pixel_values"].split("max [")[1].split(",")[0])
    grid_max = int(ranges["grid_thw"].split("max [")[1].split(",")[0])
    rt = Runtime(load_config({"model": {"path": str(QWEN2_VL)}, "backend": {"warmup": False, "intra_op_threads": 1}}))
    top = list(rt.manifest.tiers.values())[-1]
    for height, width in ((28, 5600), (5600, 28), (25, 5000)):
        request = rt.prepare(np.zeros((height, width, 3), np.uint8), "What is in the image?", tier=top.name)
        feeds = rt.adapter.encoder_feeds(np.concatenate([request.pixel_values] * 3))
        assert len(feeds["pixel_values"]) > 3 * top.image_tokens * 4  # past the top budget's patches
        assert len(feeds["pixel_values"]) <= patches_max and len(feeds["grid_thw"]) <= grid_max
