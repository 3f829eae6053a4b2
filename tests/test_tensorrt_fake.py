"""The TensorRT path executed against the fake tensorrt module and fake CUDA drivers:
builds, loads, answers, buffer reuse, profile selection, DLA cores, failures → fallback,
and the component lock."""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import re
import sys
import threading
import time

import numpy as np
import pytest
import yaml

from tests.support import trt_harness as h
from edgemm.backends.tensorrt.component import TensorRTBackend, capacity_for, _Profile
from edgemm.config import load_config
from edgemm.backends.tensorrt.build import BuildRequest, build_engines, decoder_profiles, _input_dims
from edgemm.backends.errors import CudaError
from edgemm.backends.tensorrt.cuda import load_cuda
from edgemm.backends.tensorrt.manifest import read_manifest
import edgemm.backends.tensorrt.build
from edgemm.backends.tensorrt.platform import probe
from edgemm.errors import BackendError, EngineError
from edgemm.model.manifest import load_manifest
from edgemm.engine.runtime import Runtime
from tests.support.fake_cuda import CUresult

QUESTION = "how many shapes are there ?"


@pytest.fixture(scope="module")
def reference():
    """ONNX Runtime CPU on the int8 graphs: what the fake TensorRT must answer too."""
    return Runtime(load_config({"model": {"path": str(h.MODEL_DIR), "precision": "int8"},
                                "backend": {"warmup": False, "intra_op_threads": 1}}))


@pytest.mark.parametrize("version", ["8.6.1", "10.3.0", "11.4.1"])
@pytest.mark.parametrize("cuda", ["cuda-python", "pycuda"])
def test_engines_build_load_and_answer_like_onnxruntime(monkeypatch, tmp_path, reference, version, cuda):
    fakes = h.install(monkeypatch, version, cuda=cuda)
    h.build(tmp_path)
    rt = h.runtime(tmp_path, vision_encoder=["gpu"], embed_tokens=["gpu"], decoder=["gpu"])
    assert rt.devices == {"vision_encoder": "gpu", "embed_tokens": "gpu", "decoder": "gpu"}
    assert rt.placement_report()["decoder"]["provider"] == f"TensorRT {version} GPU"
    for tier in ("low", "high"):
        ours = rt.infer(h.SAMPLE, QUESTION, tier=tier, max_new_tokens=6)
        assert ours.text == reference.infer(h.SAMPLE, QUESTION, tier=tier, max_new_tokens=6).text
    plans = fakes.trt._built
    if version.startswith("11"):
        assert all(p["strongly_typed"] and p["flags"] == [] for p in plans)
    else:
        assert all(not p["strongly_typed"] and p["flags"] == ["FP16", "INT8"] for p in plans)
    if version == "8.6.1":  # no INT64 tensors before TensorRT 10: the ids go in as int32
        assert plans[1]["inputs"]["input_ids"]["dtype"] == "INT32"


@pytest.mark.parametrize("integrated", [True, False])
def test_no_allocation_per_token_after_the_first_request_at_a_shape(monkeypatch, tmp_path, integrated):
    fakes = h.install(monkeypatch, "10.3.0", integrated=integrated)
    h.build(tmp_path)
    rt = h.runtime(tmp_path)
    first = rt.infer(h.SAMPLE, "describe the image", tier="low", max_new_tokens=12)
    after_first = fakes.memory.total()
    assert after_first > 0
    assert set(fakes.memory.allocations) == ({"mapped"} if integrated else {"host", "device"})
    second = rt.infer(h.SAMPLE, "describe the image", tier="low", max_new_tokens=12)
    assert second.text == first.text and len(second.tokens) > 1
    assert fakes.memory.total() == after_first  # 0 allocations for the whole second request


def test_discrete_copies_move_exactly_each_tensors_bytes(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "10.3.0", integrated=False)
    h.build(tmp_path, components=["embed_tokens"])
    backend = TensorRTBackend.for_model(load_manifest(h.MODEL_DIR), tmp_path)
    embed = backend.load_component("embed_tokens", "gpu", "int8")
    ids = np.arange(7, dtype=np.int64).reshape(1, 7)
    out = embed.run({"input_ids": ids})["inputs_embeds"]
    assert fakes.memory.copies == [("htod", ids.nbytes), ("dtoh", out.nbytes)]
    assert capacity_for(ids.nbytes) == 64 * 4 and capacity_for(300) == 512 and capacity_for(0) == 256


def test_decoder_switches_profiles_between_prefill_and_decode(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, components=["decoder"])
    backend = TensorRTBackend.for_model(load_manifest(h.MODEL_DIR), tmp_path)
    decoder = backend.load_component("decoder", "gpu", "int8")
    engine = decoder.engines[0]
    assert [p.index for p in engine.profiles] == [0, 1]
    dims = {n: s.shape for n, s in decoder.inputs.items()}
    past_names = [n for n in dims if n.startswith("past_key_values.")]

    def feeds(new: int, past: int) -> dict:
        out = {"inputs_embeds": np.zeros((1, new, 192), np.float32),
               "attention_mask": np.ones((1, past + new), np.int64),
               "position_ids": np.arange(past, past + new, dtype=np.int64).reshape(1, new)}
        out.update({n: np.zeros((1, 4, past, 48), np.float32) for n in past_names})
        return {k: v for k, v in out.items() if k in dims}
    decoder.run(feeds(5, 0))
    assert engine.context._profile == 0 and engine.active_profile == 0
    decoder.run(feeds(1, 5))
    assert engine.context._profile == 1
    decoder.run(feeds(200, 10))  # the rest of a long prompt after a cached image prefix
    assert engine.context._profile == 1
    assert fakes.trt._loaded[0]._plan["profiles"][1]["inputs_embeds"][2][1] == 319


def test_decode_profile_takes_what_onnxruntime_answers_after_a_cached_prefix():
    model = load_manifest(h.MODEL_DIR)
    dims = _input_dims(model.graph_path("decoder", "int8"))
    prefill, decode = decoder_profiles(dims, 16, model.max_context)
    ranges = {n: (tuple(p["min"]), tuple(p["max"])) for n, p in decode.items()}
    cached, rest = 80, model.max_context - 1 - 80  # a cached image prefix, then the longest question
    shapes = {"inputs_embeds": (1, rest, 192), "attention_mask": (1, cached + rest), "position_ids": (1, rest),
              **{n: (1, 4, cached, 48) for n in dims if n.startswith("past_key_values.")}}
    assert _Profile(1, ranges).accepts({n: s for n, s in shapes.items() if n in ranges})
    assert not _Profile(1, ranges).accepts({**shapes, "position_ids": (1, model.max_context)})


def test_dla_core_is_set_before_the_plan_is_deserialised(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, device="dla1", tiers=["low", "mid", "high"])
    backend = TensorRTBackend.for_model(load_manifest(h.MODEL_DIR), tmp_path)
    encoder = backend.load_component("vision_encoder", "dla1", "int8")
    assert [e._dla_core_at_load for e in fakes.trt._loaded] == [1, 1, 1]
    assert encoder.provider == "TensorRT 10.3.0 DLA1"
    pixels = np.zeros((3, 3, 96, 96), np.float32)  # three images on a batch-1 static plan: row by row
    assert encoder.run({"pixel_values": pixels})["image_features"].shape[0] == 3


def test_dla_int8_up_to_10_7_uses_the_calibration_cache(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, device="dla0", tiers=["low"])
    plan = fakes.trt._built[0]
    assert plan["calibration_cache"].startswith("TRT-")  # the translated scales, in TensorRT's format
    assert plan["flags"] == ["FP16", "GPU_FALLBACK", "INT8"] and plan["dla_core"] == 0
    entry = read_manifest(tmp_path, "").engines[0]
    assert entry.quantization == "calibration-cache" and entry.gpu_fallback  # the fake's GPU-only ops


def fp16_edges(pixels: np.ndarray, encode) -> np.ndarray:
    """What an encoder answers with FP16 at its boundary: `encode` (ONNX Runtime on the int8 graph,
    in FP32) on the pixels rounded to FP16, its features rounded to FP16, both as FP32 again."""
    return encode(pixels.astype(np.float16).astype(np.float32)).astype(np.float16).astype(np.float32)


def test_dla_int8_on_11_4_1_is_strongly_typed_and_follows_the_dla_guidance(monkeypatch, tmp_path, reference):
    fakes = h.install(monkeypatch, "11.4.1", integrated=False)
    said = []
    request = BuildRequest(model_dir=h.MODEL_DIR, out=tmp_path, device="dla0")  # a plan per tier
    build_engines(request, load_manifest(h.MODEL_DIR), probe(), echo=lambda text, **_: said.append(text))
    for plan in fakes.trt._built:
        assert plan["strongly_typed"] and plan["calibration_cache"] is None and plan["flags"] == ["GPU_FALLBACK"]
        assert plan["parser_flags"] == ["ADJUST_FOR_DLA"]
        # the built-in model's graph is FP32 at its edges; the network TensorRT parsed is FP16 there
        assert (plan["inputs"]["pixel_values"]["dtype"], plan["outputs"]["image_features"]["dtype"]) == ("HALF",
                                                                                                          "HALF")
    for entry in read_manifest(tmp_path, "").engines:
        assert entry.quantization == "strongly-typed" and "ADJUST_FOR_DLA" in entry.flags
        assert entry.fp16_io == ["pixel_values", "image_features"] and entry.onnx == "vision_encoder_int8.onnx"
    assert "fp32_boundaries" not in (tmp_path / "manifest.yaml").read_text()
    assert not [line for line in said if "modelopt" in line or "FP32" in line]  # no conversion left to do

    encoder = TensorRTBackend.for_model(load_manifest(h.MODEL_DIR), tmp_path).load_component(
        "vision_encoder", "dla0", "int8")
    assert all(e.dtypes == {"pixel_values": np.float16, "image_features": np.float16}  # what the engines declare
               for e in encoder.engines)
    assert encoder.inputs["pixel_values"].dtype == np.float32  # what edgemm feeds, as on the CPU
    pixels, _ = reference.preprocess(h.SAMPLE, "low")
    features = encoder.run({"pixel_values": pixels})["image_features"]
    assert features.dtype == np.float32
    assert fakes.memory.copies == [("htod", pixels.size * 2), ("dtoh", features.size * 2)]  # FP16 bytes, exactly
    assert np.array_equal(features, fp16_edges(pixels, reference.generator.encode))
    rt = h.runtime(tmp_path, vision_encoder=["dla0"], embed_tokens=["cpu"], decoder=["cpu"])
    ours = rt.infer(h.SAMPLE, QUESTION, tier="low", max_new_tokens=6)
    assert rt.devices["vision_encoder"] == "dla0"
    assert ours.text == reference.infer(h.SAMPLE, QUESTION, tier="low", max_new_tokens=6).text


def test_gpu_plans_on_11_4_1_keep_the_graphs_types(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "11.4.1")
    h.build(tmp_path, components=["vision_encoder"])
    assert fakes.trt._built[0]["inputs"]["pixel_values"]["dtype"] == "FLOAT"
    assert read_manifest(tmp_path, "").engines[0].fp16_io == []
    encoder = TensorRTBackend.for_model(load_manifest(h.MODEL_DIR), tmp_path).load_component(
        "vision_encoder", "gpu", "int8")
    assert encoder.engines[0].dtypes["image_features"] == np.float32


def test_dla_before_11_has_no_parser_flag_and_no_boundary_rule(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, device="dla0", tiers=["low"])
    assert fakes.trt._built[0]["parser_flags"] == []
    entry = read_manifest(tmp_path, "").engines[0]
    assert "ADJUST_FOR_DLA" not in entry.flags and entry.fp16_io == []
    assert fakes.trt._built[0]["inputs"]["pixel_values"]["dtype"] == "FLOAT"  # the builder picks DLA formats


def test_the_manifest_records_dla_loadables_per_core(monkeypatch, tmp_path):
    h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, device="dla0", tiers=["low", "mid", "high"])
    h.build(tmp_path, device="dla1", tiers=["low"])
    h.build(tmp_path, components=["embed_tokens"])
    manifest = read_manifest(tmp_path, "")
    per_plan = {e.file: e.dla_loadables for e in manifest.engines}
    # the fake sends Gather to the GPU: the encoder's DLA layers fall into 4 runs between them
    assert per_plan == {"vision_encoder.dla0.int8.low.plan": 4, "vision_encoder.dla0.int8.mid.plan": 4,
                        "vision_encoder.dla0.int8.high.plan": 4, "vision_encoder.dla1.int8.low.plan": 4,
                        "embed_tokens.gpu.int8.plan": 0}
    assert manifest.loadables_per_core() == {"dla0": 12, "dla1": 4}
    assert yaml.safe_load((tmp_path / "manifest.yaml").read_text())["dla_loadables"] == {"dla0": 12, "dla1": 4}


def test_a_plan_set_over_16_loadables_on_a_core_is_refused_before_building(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, device="dla0", tiers=["low", "mid"])  # 8 loadables
    before = (tmp_path / "manifest.yaml").read_text()
    calls = itertools.count()  # a graph that splits more: every 20th layer on the GPU
    monkeypatch.setattr(fakes.trt.IBuilderConfig, "can_run_on_DLA", lambda self, layer: next(calls) % 20 != 19)
    fakes.trt._built.clear()
    with pytest.raises(EngineError) as refused:
        h.build(tmp_path, device="dla0", tiers=["high"])
    message = str(refused.value)
    assert re.fullmatch(r"dla0 would hold \d+ DLA loadables, more than the 16 a DLA core takes "
                        r"\(vision_encoder\.dla0\.int8\.low\.plan 4, vision_encoder\.dla0\.int8\.mid\.plan 4, "
                        r"vision_encoder\.dla0\.int8\.high\.plan \d+\); build fewer tiers there \(--tiers\) and the "
                        r"rest on the other DLA core or the GPU", message), message
    assert fakes.trt._built == [] and (tmp_path / "manifest.yaml").read_text() == before
    h.build(tmp_path, device="dla1", tiers=["high"])  # the other core holds its own 16
    assert len(fakes.trt._built) == 1


# ---- failures ---------------------------------------------------------------------------------

def test_cuda_without_a_driver_falls_back_to_the_cpu(monkeypatch, tmp_path):
    h.install(monkeypatch, "10.3.0", raise_on_init=RuntimeError('"cuda" is an NVIDIA driver library and can '
                                                                'only be found via system search.\nEnsure …'))
    rt = h.runtime(tmp_path)
    assert rt.devices == {"vision_encoder": "cpu", "embed_tokens": "cpu", "decoder": "cpu"}
    reason = rt.placement_report()["decoder"]["skipped"][0]["reason"]
    assert reason.startswith("cuda-python 12.9.fake: CUDA did not start (cuInit): \"cuda\" is an NVIDIA driver library")
    assert reason.endswith("; pycuda: not installed") and "\n" not in reason


def test_no_visible_device_is_said_in_one_line(monkeypatch):
    h.install(monkeypatch, "10.3.0", devices=0)
    with pytest.raises(EngineError, match=r"^no CUDA device is visible"):
        probe()


def test_pycuda_without_a_device_is_a_cuda_error(monkeypatch):
    h.install(monkeypatch, "10.3.0", cuda="pycuda", devices=0)
    with pytest.raises(CudaError, match=r"^CUDA \(pycuda\) init failed: cuInit failed: no CUDA-capable device"):
        load_cuda()


def test_cuda_python_that_cannot_start_the_driver_falls_back_to_pycuda(monkeypatch):
    # e.g. cuda-bindings 13 on JetPack 6's CUDA 12 driver, where JetPack's pycuda works
    h.install(monkeypatch, "10.3.0", cuda="both", fail={"cuInit": CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH})
    cuda = load_cuda()
    assert cuda.name == "pycuda 2024.1.fake" and cuda.device_info(0).name == "Orin"


@pytest.mark.parametrize("pycuda, its_reason", [
    ("installed", "pycuda: CUDA (pycuda) init failed: cuInit failed: no CUDA-capable device is detected"),
    ("missing", "pycuda: not installed")])
def test_when_neither_binding_starts_cuda_one_line_names_both_reasons(monkeypatch, pycuda, its_reason):
    h.install(monkeypatch, "10.3.0", cuda="both", pycuda_devices=0,
              fail={"cuInit": CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH})
    if pycuda == "missing":
        monkeypatch.setitem(sys.modules, "pycuda", None)
        monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    with pytest.raises(CudaError) as raised:
        load_cuda()
    assert str(raised.value) == ("cuda-python 12.9.fake: CUDA cuInit failed: "
                                 f"CUDA_ERROR_SYSTEM_DRIVER_MISMATCH (system driver mismatch); {its_reason}")


def test_tensorrt_runtime_that_will_not_start_falls_back(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "10.3.0")
    h.build(tmp_path)
    fakes.trt._runtime_fails = True
    rt = h.runtime(tmp_path, decoder=["gpu", "cpu"])
    assert rt.devices["decoder"] == "cpu"
    assert rt.placement_report()["decoder"]["skipped"] == [{"device": "gpu", "reason": (  # what TensorRT logged
        "TensorRT 10.3.0 could not start its runtime: 6: CUDA initialization failure with error: 35. "
        "Please check your CUDA installation.")}]


def test_out_of_device_memory_is_an_engine_error(monkeypatch, tmp_path):
    h.install(monkeypatch, "10.3.0", integrated=False, fail={"cuMemAlloc": CUresult.CUDA_ERROR_OUT_OF_MEMORY})
    embed = h.built_embed(tmp_path)
    with pytest.raises(EngineError, match=r"^CUDA cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY \(out of memory\)$"):
        embed.run({"input_ids": np.ones((1, 3), np.int64)})


def test_mapping_refused_falls_back_to_device_copies(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "10.3.0", fail={"cuMemHostGetDevicePointer": CUresult.CUDA_ERROR_INVALID_VALUE})
    embed = h.built_embed(tmp_path)
    out = embed.run({"input_ids": np.ones((1, 3), np.int64)})["inputs_embeds"]
    assert out.shape == (1, 3, 192) and embed.engines[0].zero_copy is False
    assert fakes.memory.allocations["device"] == 2


def test_failed_execution_context_and_execution_are_engine_errors(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, components=["embed_tokens"])
    backend = TensorRTBackend.for_model(load_manifest(h.MODEL_DIR), tmp_path)
    embed = backend.load_component("embed_tokens", "gpu", "int8")
    fakes.trt._execute_fails = True
    with pytest.raises(EngineError, match=r"^embed_tokens\.gpu\.int8\.plan: TensorRT execution failed"):
        embed.run({"input_ids": np.ones((1, 3), np.int64)})
    monkeypatch.setattr(fakes.trt.ICudaEngine, "create_execution_context", lambda self: None)
    with pytest.raises(EngineError, match=r"could not create an execution context"):
        backend.load_component("embed_tokens", "gpu", "int8")


def test_a_plan_of_another_release_is_refused_with_the_rebuild_command(monkeypatch, tmp_path):
    h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, components=["embed_tokens"])
    fakes = h.install(monkeypatch, "10.3.0")
    fakes.trt.__version__ = "10.3.1"  # same manifest check, but the plan itself says 10.3.0
    backend = TensorRTBackend(dataclasses.replace(probe(), tensorrt="10.3.0"), tmp_path, h.MODEL_DIR, "tiny-vlm",
                              ["low", "mid", "high"])
    with pytest.raises(EngineError, match=r"could not deserialise .*embed_tokens\.gpu\.int8\.plan: .*rebuild with: "
                                          r"edgemm engines build"):
        backend.load_component("embed_tokens", "gpu", "int8")


def test_tensorrts_own_reason_is_in_the_engine_error_and_in_the_edgemm_log(monkeypatch, tmp_path, caplog):
    # its stock trt.Logger writes to fd 2, which infer, stream and serve point at /dev/null
    h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, components=["embed_tokens"])
    fakes = h.install(monkeypatch, "10.3.0")
    fakes.trt.__version__ = "10.3.1"
    backend = TensorRTBackend(dataclasses.replace(probe(), tensorrt="10.3.0"), tmp_path, h.MODEL_DIR, "tiny-vlm",
                              ["low", "mid", "high"])
    theirs = ("IRuntime::deserializeCudaEngine: Error Code 1: Serialization (Serialization assertion "
              "stdVersionRead == kSERIALIZATION_VERSION failed.Version tag does not match. Note: Current Version: "
              "10.3.1, Serialized Engine Version: 10.3.0)")
    with caplog.at_level(logging.WARNING, logger="edgemm"):
        with pytest.raises(EngineError) as raised:
            backend.load_component("embed_tokens", "gpu", "int8")
    assert str(raised.value) == (f"TensorRT 10.3.0 could not deserialise {tmp_path / 'embed_tokens.gpu.int8.plan'}: "
                                 f"{theirs}; rebuild with: {raised.value.args[0].split('rebuild with: ')[1]}")
    assert "\n" not in str(raised.value)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("edgemm", logging.ERROR, f"TensorRT: {theirs}")]


def test_a_failed_execution_says_tensorrts_reason(monkeypatch, tmp_path, caplog):
    fakes = h.install(monkeypatch, "10.3.0")
    embed = h.built_embed(tmp_path)
    fakes.trt._execute_fails = True
    with pytest.raises(EngineError) as raised:
        embed.run({"input_ids": np.ones((1, 3), np.int64)})
    assert str(raised.value) == ("embed_tokens.gpu.int8.plan: TensorRT execution failed: IExecutionContext::enqueueV3: "
                                 "Error Code 1: Cuda Runtime (an illegal memory access was encountered)")
    fakes.trt._execute_fails = False  # the reason is the last error of this call, not a stale one
    embed.run({"input_ids": np.ones((1, 3), np.int64)})
    monkeypatch.setattr(fakes.trt.IExecutionContext, "execute_async_v3", lambda self, stream_handle: False)
    with pytest.raises(EngineError, match=r"execution failed \(TensorRT logged no reason\)$"):
        embed.run({"input_ids": np.ones((1, 3), np.int64)})


def test_dla_fallback_warnings_and_build_errors_reach_the_edgemm_log(monkeypatch, tmp_path, caplog):
    h.install(monkeypatch, "10.3.0")
    with caplog.at_level(logging.WARNING, logger="edgemm"):
        h.build(tmp_path, "dla0", components=["vision_encoder"], tiers=["low"])
    assert any(r.levelno == logging.WARNING and "Unsupported on DLA. Switching this layer's device type to GPU"
               in r.getMessage() for r in caplog.records), caplog.records
    monkeypatch.setattr(edgemm.backends.tensorrt.build, "decoder_profiles", lambda *a, **k: [])
    with pytest.raises(EngineError) as raised:
        h.build(tmp_path, "gpu", components=["decoder"])
    assert str(raised.value) == ("TensorRT could not build decoder.gpu.int8.plan: IBuilder::buildSerializedNetwork: "
                                 "Error Code 4: Network has dynamic or shape inputs, but no optimization profile has "
                                 "been defined.")


def test_a_shape_no_engine_accepts_is_refused(monkeypatch, tmp_path):
    h.install(monkeypatch, "10.3.0")
    embed = h.built_embed(tmp_path)
    with pytest.raises(Exception, match=r"no engine accepts input shapes \{'input_ids': \(1, 321\)\}"):
        embed.run({"input_ids": np.ones((1, 321), np.int64)})


def test_one_component_called_from_two_threads_runs_one_call_at_a_time(monkeypatch, tmp_path):
    fakes = h.install(monkeypatch, "10.3.0")
    embed = h.built_embed(tmp_path)
    inside, most = [0], [0]
    execute = fakes.trt.IExecutionContext.execute_async_v3

    def slow_execute(self, stream_handle):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.02)  # long enough for the other thread to arrive mid-run
        try:
            return execute(self, stream_handle)
        finally:
            inside[0] -= 1
    monkeypatch.setattr(fakes.trt.IExecutionContext, "execute_async_v3", slow_execute)
    results = {}

    def call(n):
        ids = np.full((1, n), n, np.int64)
        results[n] = [embed.run({"input_ids": ids})["inputs_embeds"] for _ in range(5)]
    threads = [threading.Thread(target=call, args=(n,)) for n in (3, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
    for n in (3, 9):  # each thread got its own rows back, never the other's
        assert all(r.shape == (1, n, 192) and np.array_equal(r, results[n][0]) for r in results[n])
    assert not np.array_equal(results[3][0][0, 0], np.zeros(192))
    assert fakes.driver.context_stack == []  # every push popped


# ---- the fake driver's names are cuda-python's ---------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("cuda") is None, reason="cuda-bindings not installed (the tensorrt extra)")
def test_fake_cuda_python_driver_has_the_real_names(monkeypatch):
    import importlib as il
    real = il.import_module("cuda.bindings.driver")
    fake = h.fake_cuda.cuda_python(h.fake_cuda.Memory())
    for name in [n for n in vars(fake) if n.startswith("cu")]:
        assert hasattr(real, name), name
        ours = getattr(fake, name).__code__.co_varnames[:getattr(fake, name).__code__.co_argcount]
        theirs = getattr(real, name).__doc__.splitlines()[0].split("(", 1)[1].rstrip(")")
        assert [p.split(":")[0].split()[-1] for p in theirs.split(", ") if p] == list(ours), name
    for member in CUresult.__members__:
        assert int(getattr(real.CUresult, member)) == int(getattr(CUresult, member))
    for member in h.fake_cuda.CUdevice_attribute:
        assert int(getattr(real.CUdevice_attribute, member.name)) == int(member)
    assert real.CU_MEMHOSTALLOC_DEVICEMAP == fake.CU_MEMHOSTALLOC_DEVICEMAP


# ---- a tiled family (idefics3 / SmolVLM): 5-D pixels and their mask ---------------------------------

@pytest.mark.parametrize("version, device", [("10.3.0", "gpu"), ("11.4.1", "dla0")])
def test_idefics3_encoder_builds_and_runs_through_the_fake(monkeypatch, tmp_path, version, device):
    """The builder accepts the profiles of every encoder input; the plan answers what ONNX Runtime does,
    at every tier, for a square image (the most tiles) and a wide one (fewer)."""
    fakes = h.install(monkeypatch, version)
    h.build(tmp_path, device, model_dir=h.IDEFICS3_DIR, components=["vision_encoder"])
    assert len(fakes.trt._built) == 1 and set(fakes.trt._built[0]["profiles"][0]) == {
        "pixel_values", "pixel_attention_mask"}
    ours = h.runtime(tmp_path, model_dir=h.IDEFICS3_DIR, vision_encoder=[device], embed_tokens=["cpu"],
                     decoder=["cpu"])
    assert ours.devices["vision_encoder"] == device
    reference = Runtime(load_config({"model": {"path": str(h.IDEFICS3_DIR), "precision": "int8"},
                                     "backend": {"warmup": False, "intra_op_threads": 1}}))
    tiles = []
    for image in ("tall.png", "wide.png"):
        for tier in ours.manifest.tiers:
            pixels, _ = reference.preprocess(h.IDEFICS3_DIR / image, tier)
            if device == "gpu":
                expected = reference.generator.encode(pixels)
            else:  # 11.4.1's DLA plan has FP16 pixels and features (the mask stays bool)
                expected = fp16_edges(pixels, reference.generator.encode)
            assert np.array_equal(ours.generator.encode(pixels), expected), (image, tier)
            tiles.append(pixels.shape[1])
    assert tiles == [1, 3, 7, 1, 5, 10]  # tall: fewer tiles than a tier takes at most; wide: the most
    runs = sum(e.context._runs for e in ours.generator.encoder.engines)
    # the DLA plan takes one tile per call; and one blank tile first, the load's image-token check
    assert runs == 1 + (6 if device == "gpu" else sum(tiles))


def test_infer_and_status_json_say_why_a_gpu_placement_answered_on_the_cpu(monkeypatch, tmp_path):
    """placement [gpu, cpu] where CUDA will not start: the answer comes from the CPU, and both
    `edgemm infer --json` and the status report's components say why."""
    import json
    from click.testing import CliRunner
    from edgemm.cli.main import main
    from edgemm.server.service import components
    h.install(monkeypatch, "10.3.0", raise_on_init=RuntimeError("cuInit: no CUDA driver"))
    config = tmp_path / "edgemm.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(h.MODEL_DIR), "precision": "int8", "engines": str(tmp_path / "engines")},
        "placement": {"vision_encoder": ["gpu", "cpu"], "embed_tokens": ["cpu"], "decoder": ["gpu", "cpu"]},
        "backend": {"warmup": False, "intra_op_threads": 1}}))
    result = CliRunner().invoke(main, ["infer", str(h.SAMPLE), "-p", QUESTION, "--config", str(config), "--json",
                                       "--tier", "low"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["devices"] == {"encode": "cpu", "decode": "cpu"} and answer["answer"]
    why = "gpu: cuda-python 12.9.fake: CUDA did not start (cuInit): cuInit: no CUDA driver; pycuda: not installed"
    assert answer["schedule"]["placement"] == f"vision_encoder on cpu ({why}); decoder on cpu ({why})"
    rt = h.runtime(tmp_path / "engines", embed_tokens=["cpu"])
    report = components(rt)
    assert report["decoder"]["device"] == "cpu"
    assert report["decoder"]["skipped"] == [{"device": "gpu", "reason": why[len("gpu: "):]}]
    assert report["embed_tokens"]["skipped"] == []


# ---- tools/hil_check.py against the fakes --------------------------------------------------------

def _hil_check():
    from tools import hil_check
    return hil_check


HIL_ARGS = ["--encoder", "gpu", "--embed", "gpu", "--decoder", "gpu", "--n", "1", "--tiers", "low",
            "--max-new-tokens", "2"]


def test_hil_check_reports_cuda_that_will_not_start(monkeypatch, tmp_path, capsys):
    import json
    h.install(monkeypatch, "10.3.0", raise_on_init=RuntimeError("cuInit: no CUDA driver"))
    code = _hil_check().main([str(h.MODEL_DIR), "--engines", str(tmp_path), *HIL_ARGS])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["ok"] is False
    assert report["platform"] == {"error": "cuda-python 12.9.fake: CUDA did not start (cuInit): cuInit: no CUDA driver; "
                                           "pycuda: not installed"}
    assert report["placement"]["decoder"]["device"] == "cpu"
    assert report["placement"]["decoder"]["skipped"][0]["reason"].startswith(
        "cuda-python 12.9.fake: CUDA did not start (cuInit)")
    assert report["kv_memory"] == {"skipped": "the decoder runs on cpu (CPUExecutionProvider), not on TensorRT"}


def test_hil_check_compares_zero_copy_and_device_memory_for_the_kv_tensors(monkeypatch, tmp_path, capsys):
    import json
    fakes = h.install(monkeypatch, "10.3.0")
    code = _hil_check().main([str(h.MODEL_DIR), "--engines", str(tmp_path), "--build", *HIL_ARGS])
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{\n"):])
    assert code == 0 and report["ok"] and report["placement"]["decoder"]["provider"] == "TensorRT 10.3.0 GPU"
    kv = report["kv_memory"]
    assert kv["past"] == 128 and set(kv["median_ms"]) == {"zero_copy", "device"}
    assert kv["faster"] in ("zero_copy", "device")
    assert fakes.memory.allocations["device"] > 0  # the device-memory way really ran with device buffers


# ---- Qwen2-VL: flattened patches with their grid, [3, B, S] positions ---------------------------------

QWEN2_VL_DIR = h.IDEFICS3_DIR.parent / "qwen2-vl-tiny"


def test_qwen2_vl_engines_take_the_grid_and_3d_positions(monkeypatch, tmp_path):
    """GPU plans of all three graphs from their profiles (patches × 1176 and the grid; positions
    [3, B, S]) answer what ONNX Runtime does, for two grids of the same patch count."""
    fakes = h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, model_dir=QWEN2_VL_DIR)
    encoder_profile, = fakes.trt._built[0]["profiles"]
    assert set(encoder_profile) == {"pixel_values", "grid_thw"}
    assert fakes.trt._built[2]["profiles"][1]["position_ids"][2][0] == 3  # (min, opt, max): max
    ours = h.runtime(tmp_path, model_dir=QWEN2_VL_DIR, vision_encoder=["gpu"], embed_tokens=["gpu"],
                     decoder=["gpu"])
    assert ours.devices == {"vision_encoder": "gpu", "embed_tokens": "gpu", "decoder": "gpu"}
    reference = Runtime(load_config({"model": {"path": str(QWEN2_VL_DIR), "precision": "int8"},
                                     "backend": {"warmup": False, "intra_op_threads": 1}, "cache": {"max_bytes": 0}}))
    for image in ("wide.png", "tall.png"):  # grids 8x26 and 26x8
        got = ours.infer(QWEN2_VL_DIR / image, "What is in the image?", max_new_tokens=6)
        assert got.tokens == reference.infer(QWEN2_VL_DIR / image, "What is in the image?", max_new_tokens=6).tokens
        assert got.image_tokens == 52


def test_qwen2_vl_dla_plans_are_one_static_grid_per_tier(monkeypatch, tmp_path):
    """A DLA plan per pixel budget, at the tier's square grid: an image of that grid runs on it
    as on ONNX Runtime; an image of another grid is refused by name, not run wrong."""
    fakes = h.install(monkeypatch, "11.4.1")
    h.build(tmp_path, "dla0", model_dir=QWEN2_VL_DIR)
    shapes = [p["profiles"][0]["pixel_values"][2] for p in fakes.trt._built]
    assert shapes == [[64, 1176], [100, 1176], [256, 1176]]  # 16, 32 (a 5x5 square of units), 64 tokens
    ours = h.runtime(tmp_path, model_dir=QWEN2_VL_DIR, vision_encoder=["dla0"], embed_tokens=["cpu"],
                     decoder=["cpu"])
    reference = Runtime(load_config({"model": {"path": str(QWEN2_VL_DIR), "precision": "int8"},
                                     "backend": {"warmup": False, "intra_op_threads": 1}}))
    for tier in ours.manifest.tiers.values():
        square = np.full((tier.height, tier.width, 3), 90, np.uint8)
        pixels, _ = reference.preprocess(square, tier.name)
        # 11.4.1's DLA plan has FP16 pixels and features; the grid stays int64
        assert np.array_equal(ours.generator.encode(pixels), fp16_edges(pixels, reference.generator.encode))
    wide, _ = reference.preprocess(QWEN2_VL_DIR / "wide.png", "16x28x28")  # a 4x12 grid, not the tier's 8x8
    with pytest.raises(BackendError, match=r"no engine accepts input shapes \{'pixel_values': \(48, 1176\), "
                                           r"'grid_thw': \(1, 3\)\}"):
        ours.generator.encode(wide)
    # so a runtime with its encoder on a DLA takes every image at its tier's square grid
    for tier in ours.manifest.tiers.values():
        answer = ours.infer(QWEN2_VL_DIR / "wide.png", "What is in the image?", tier=tier.name, max_new_tokens=3)
        assert answer.image_tokens == (tier.height // 28) ** 2 and answer.devices["encode"] == "dla0"


def test_qwen2_vl_on_a_dla_encodes_a_batch_one_image_per_call(monkeypatch, tmp_path):
    """Flat patches [B·N, 1176] and the grid [B, 3] have no common batch axis: the family splits
    them by the grid's rows, the static plan takes one image per call, the features are
    concatenated back: a batch of 2 or 3 equals each image alone, and ONNX Runtime."""
    h.install(monkeypatch, "11.4.1")
    h.build(tmp_path, "dla0", model_dir=QWEN2_VL_DIR)
    ours = h.runtime(tmp_path, model_dir=QWEN2_VL_DIR, vision_encoder=["dla0"], embed_tokens=["cpu"],
                     decoder=["cpu"])
    reference = Runtime(load_config({"model": {"path": str(QWEN2_VL_DIR), "precision": "int8"},
                                     "backend": {"warmup": False, "intra_op_threads": 1}}))
    rng = np.random.default_rng(3)
    tier = ours.manifest.tiers["16x28x28"]
    images = [rng.integers(0, 256, (tier.height, tier.width, 3), dtype=np.uint8) for _ in range(3)]
    pixels = [ours.preprocess(image, tier.name)[0] for image in images]
    alone = [ours.generator.encode(p) for p in pixels]
    for p, features in zip(pixels, alone):
        assert features.shape == (1, 16, 64)
        assert np.array_equal(features, fp16_edges(p, reference.generator.encode))
    assert not np.array_equal(alone[0], alone[1])  # different images: an order mix-up would show
    for n in (2, 3):
        batch = np.concatenate(pixels[:n])
        got = ours.generator.encode(batch)
        assert got.shape == (n, 16, 64)
        assert np.array_equal(got, np.concatenate(alone[:n]))
        assert np.array_equal(got, fp16_edges(batch, reference.generator.encode))  # ORT takes the batch whole
    # the encode stage's path with server.encoder_batching on: one call for the three, each answered
    requests = [ours.prepare(image, "What is in the image?", tier=tier.name, max_new_tokens=2) for image in images]
    features = ours.encode(np.concatenate([r.pixel_values for r in requests]))
    assert np.array_equal(features, np.concatenate(alone))
