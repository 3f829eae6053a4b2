"""`edgemm status` and `edgemm doctor` on fake Jetson roots (and status against a running daemon)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import pytest
from click.testing import CliRunner
from tests.support.fake_jetson import agx_orin, orin_nano, orin_nx
from test_server import running, sock_path

import edgemm.cli.doctor
from edgemm.cli.main import main

LINE = re.compile(r"^(ok|warn|fail) +[^:]+: \S.*$")


def invoke(*args: str, config: dict | None = None, tmp_path=None):
    if config is not None:
        path = tmp_path / "edgemm.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        args = (*args, "--config", str(path))
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def socket_config(tmp_path) -> dict:
    return {"server": {"socket": str(tmp_path / "run" / "edgemm.sock")}}


# ---- status --------------------------------------------------------------------------------------


def test_status_json_without_a_daemon(tmp_path, socket_config):
    orin_nx(tmp_path / "root")
    result = invoke("status", "--json", "--root", str(tmp_path / "root"), config=socket_config, tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["daemon"] == "not running"
    assert report["telemetry"]["total_w"] == 5.0 and report["telemetry"]["nvpmodel"] == "MAXN (0)"
    assert report["placement"]["stages"] == {"vision_encoder": "cpu", "embed_tokens": "cpu", "decoder": "cpu"}
    assert report["offload"] == {"enabled": False, "breaker": "off"}
    assert report["components"] is None and report["queue"] is None


def test_status_text_on_a_hot_agx(tmp_path, socket_config):
    jetson = agx_orin(tmp_path / "root")
    jetson.set_temp("tj-thermal", 88)
    config = {**socket_config, "placement": {"vision_encoder": ["gpu", "dla0"]}}
    result = invoke("status", "--root", str(tmp_path / "root"), config=config, tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    assert "vision_encoder=dla0" in result.output and "hot: tj-thermal at 88.0 °C" in result.output
    assert "10.00 W (VDD_GPU_SOC 4.00" in result.output and "power mode  15W (2)" in result.output


def test_status_on_a_machine_without_sensors(tmp_path, socket_config):
    result = invoke("status", "--root", str(tmp_path), config=socket_config, tmp_path=tmp_path)
    assert result.exit_code == 0
    assert "power       absent" in result.output and "thermal     absent" in result.output
    assert "gpu load    absent" in result.output and "no thermal readings" in result.output


def test_status_never_shows_the_key(tmp_path, socket_config):
    key = tmp_path / "key"
    key.write_text("sk-status-SECRET")
    key.chmod(0o644)
    config = {**socket_config, "offload": {"enabled": True, "url": "https://user:pw@llm.example/v1",
                                           "model": "m", "api_key_file": str(key)}}
    result = invoke("status", "--json", "--root", str(tmp_path), config=config, tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    offload = json.loads(result.output)["offload"]
    assert offload["endpoint"] == "llm.example" and offload["key"].startswith("problem: offload.api_key_file")
    assert "sk-status-SECRET" not in result.output and "pw" not in result.output
    key.chmod(0o600)
    report = json.loads(invoke("status", "--json", config=config, tmp_path=tmp_path).output)
    assert report["offload"]["key"] == "set"


def test_status_asks_the_running_daemon(runtime, tmp_path):
    orin_nx(tmp_path)
    with running(runtime, {"power": {"root": str(tmp_path)}}) as daemon:
        result = CliRunner().invoke(main, ["status", "--json", "--socket", sock_path(daemon)])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["daemon"] == "serving" and report["model"] == "tiny-vlm"
        assert report["components"]["decoder"]["device"] == "cpu"
        assert report["queue"]["limit"] == 8 and report["telemetry"]["total_w"] == 5.0
        assert report["scheduler"] == {"policy": "calibrated", "reason": "scheduler.policy auto: model tiny-vlm "
                                                                          "ships its calibration (scheduler.yaml)"}
        text = CliRunner().invoke(main, ["status", "--socket", sock_path(daemon)]).output
        assert "serving tiny-vlm (q4)" in text and "queue       0 in flight of 8" in text
        assert report["queue"]["continuous_batching"] == "auto"
        decoder = report["queue"]["decoder_batch"]
        assert f"decoder up to {decoder} requests, continuous_batching auto" in text


# ---- doctor --------------------------------------------------------------------------------------


def test_doctor_on_an_orin_nx(tmp_path, socket_config):
    orin_nx(tmp_path / "root").add_camera("video0")
    (tmp_path / "run").mkdir()
    result = invoke("doctor", "--root", str(tmp_path / "root"), "--engines", str(tmp_path / "engines"),
                    config=socket_config, tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(LINE.match(line) for line in lines), lines
    checks = {line.split(":")[0].split(None, 1)[1]: line.split(None, 1)[0] for line in lines}
    for name in ("python", "dla", "power rails", "thermal zones", "GPU load", "power mode", "camera",
                 "socket directory"):
        assert checks[name] == "ok", (name, result.output)
    assert {"tensorrt", "cuda", "cuda binding", "opencv gstreamer", "engines"} <= set(checks)
    assert "ok    dla: 2 cores" in lines


def test_doctor_without_opencv_reports_every_check_and_fails_only_opencv(tmp_path, socket_config):
    """cv2 made unimportable (sys.modules["cv2"] = None, in a fresh process): the doctor
    still runs every check; the OpenCV one fails with what to install, and nothing else
    changes level (README "Set-up")."""
    orin_nx(tmp_path / "root").add_camera("video0")
    (tmp_path / "run").mkdir()
    config = tmp_path / "edgemm.yaml"
    config.write_text(json.dumps(socket_config))
    args = ["doctor", "--json", "--root", str(tmp_path / "root"), "--engines", str(tmp_path / "engines"),
            "--config", str(config)]
    without = subprocess.run([sys.executable, "-c", "import sys; sys.modules['cv2'] = None\n"
                              "from edgemm.cli.main import main; main()", *args],
                             capture_output=True, text=True, timeout=120, check=False)
    assert without.returncode == 3, without.stderr
    checks = {c["name"]: c for c in json.loads(without.stdout)}
    assert checks["opencv"]["level"] == "fail"
    assert "OpenCV (cv2) is not installed" in checks["opencv"]["detail"]
    assert "pip install 'edgemm[opencv]'" in checks["opencv"]["detail"]
    result = invoke(*args)
    with_cv2 = {c["name"]: c["level"] for c in json.loads(result.output)}
    assert [n for n in with_cv2 if n != "opencv gstreamer"] == [n for n in checks if n != "opencv"]
    assert {n: c["level"] for n, c in checks.items() if n != "opencv"} == \
        {n: level for n, level in with_cv2.items() if n != "opencv gstreamer"}
    assert [c["level"] for c in checks.values()].count("fail") == 1


def test_doctor_fails_when_placement_needs_a_dla_the_module_lacks(tmp_path, socket_config):
    orin_nano(tmp_path / "root")
    config = {**socket_config, "placement": {"vision_encoder": ["dla0", "gpu"]}}
    result = invoke("doctor", "--root", str(tmp_path / "root"), config=config, tmp_path=tmp_path)
    assert result.exit_code == 3
    assert "fail  dla: placement lists dla0 but this module has 0 DLA cores" in result.output


def test_doctor_reports_unreadable_telemetry(tmp_path, socket_config):
    jetson = orin_nx(tmp_path / "root")
    temp = jetson.zone_file("gpu-thermal")
    temp.unlink()
    temp.mkdir()  # unreadable even for root
    result = invoke("doctor", "--json", "--root", str(tmp_path / "root"), config=socket_config, tmp_path=tmp_path)
    assert result.exit_code == 3
    checks = {c["name"]: c for c in json.loads(result.output)}
    assert checks["thermal zones"]["level"] == "fail" and str(temp) in checks["thermal zones"]["detail"]


def test_doctor_without_a_jetson_only_warns(tmp_path, socket_config):
    result = invoke("doctor", "--root", str(tmp_path), config=socket_config, tmp_path=tmp_path)
    assert result.exit_code == 0, result.output
    assert "warn  power rails: none found" in result.output
    assert "warn  socket directory:" in result.output and "warn  cameras:" in result.output


def test_doctor_compares_engines_with_the_running_tensorrt(tmp_path, socket_config, monkeypatch):
    (tmp_path / "engines/tiny-vlm").mkdir(parents=True)
    # the layout edgemm/backends/tensorrt/manifest.py writes: the TensorRT version is per engine
    (tmp_path / "engines/tiny-vlm/manifest.yaml").write_text(
        "model: tiny-vlm\nengines:\n- {component: decoder, device: gpu, tensorrt: 8.6.2}\n"
        "- {component: vision_encoder, device: dla0, tensorrt: 8.6.2}\n")
    real = edgemm.cli.doctor.module_version
    monkeypatch.setattr(edgemm.cli.doctor, "module_version", lambda name: "10.3.0" if name == "tensorrt" else real(name))
    result = invoke("doctor", "--root", str(tmp_path), "--engines", str(tmp_path / "engines"),
                    config=socket_config, tmp_path=tmp_path)
    assert result.exit_code == 3
    assert "ok    tensorrt: 10.3.0" in result.output
    assert "fail  engines: TensorRT here is 10.3.0; rebuild with tools/build_engines.py: tiny-vlm (built with 8.6.2)" \
        in result.output


def test_doctor_camera_permission(tmp_path, socket_config, monkeypatch):
    orin_nx(tmp_path / "root").add_camera("video0")
    monkeypatch.setattr(edgemm.cli.doctor.os, "access", lambda path, mode: "video" not in str(path))
    result = invoke("doctor", "--root", str(tmp_path / "root"), config=socket_config, tmp_path=tmp_path)
    assert result.exit_code == 3 and "fail  camera: /dev/video0: permission denied" in result.output


# ---- doctor: what placement needs ---------------------------------------------------------------

README_PLACEMENT = {"model": {"precision": "int8"},
                    "placement": {"vision_encoder": ["dla0", "gpu", "cpu"], "embed_tokens": ["gpu", "cpu"],
                                  "decoder": ["gpu", "cpu"]}}


def doctor_checks(tmp_path, config: dict, *args: str) -> tuple[int, dict]:
    result = invoke("doctor", "--json", "--root", str(tmp_path / "root"), *args, config=config, tmp_path=tmp_path)
    return result.exit_code, {c["name"]: c for c in json.loads(result.output)}


@pytest.mark.skipif(edgemm.cli.doctor.module_version("tensorrt") is not None, reason="TensorRT is installed here")
def test_doctor_fails_a_dla_and_gpu_placement_without_tensorrt(tmp_path, socket_config):
    agx_orin(tmp_path / "root")  # two DLA cores: only TensorRT, CUDA, the device and the engines are missing
    code, checks = doctor_checks(tmp_path, {**socket_config, **README_PLACEMENT})
    assert code == 3
    assert checks["dla"]["level"] == "ok"
    assert checks["tensorrt"]["level"] == "fail" and "placement lists dla0, gpu" in checks["tensorrt"]["detail"]
    assert checks["engines"]["level"] == "fail"
    assert "vision_encoder on dla0" in checks["engines"]["detail"] and "decoder on gpu" in checks["engines"]["detail"]
    assert "edgemm engines build" in checks["engines"]["detail"]
    # the same machine with the default placement (cpu everywhere) needs none of it
    code, checks = doctor_checks(tmp_path, socket_config)
    assert code == 0 and checks["tensorrt"]["level"] == "warn" and checks["engines"]["level"] == "warn"


def test_doctor_finds_the_engines_placement_needs(tmp_path, socket_config, monkeypatch):
    agx_orin(tmp_path / "root")
    folder = tmp_path / "engines"
    folder.mkdir()
    entries = [{"component": c, "device": d, "precision": "int8", "tier": t, "tensorrt": "10.3.0"}
               for c, d, t in (("embed_tokens", "gpu", None), ("decoder", "gpu", None),
                               ("vision_encoder", "gpu", None), ("vision_encoder", "dla0", "low"),
                               ("vision_encoder", "dla0", "mid"))]
    (folder / "manifest.yaml").write_text(json.dumps({"model": "tiny-vlm", "engines": entries}))
    real = edgemm.cli.doctor.module_version
    monkeypatch.setattr(edgemm.cli.doctor, "module_version", lambda name: "10.3.0" if name == "tensorrt" else real(name))
    config = {**socket_config, **README_PLACEMENT, "model": {"precision": "int8", "engines": str(folder)}}
    code, checks = doctor_checks(tmp_path, config)
    assert checks["engines"]["level"] == "fail"  # DLA plans are one per tier: high is missing
    assert "vision_encoder on dla0 (tiers high)" in checks["engines"]["detail"]
    assert "--tiers high" in checks["engines"]["detail"]
    entries.append({**entries[-1], "tier": "high"})
    (folder / "manifest.yaml").write_text(json.dumps({"model": "tiny-vlm", "engines": entries}))
    code, checks = doctor_checks(tmp_path, config)
    assert checks["engines"]["level"] == "ok", checks["engines"]
    fp32 = {**config, "model": {"precision": "fp32", "engines": str(folder)}}
    assert "TensorRT engines are int8 or fp16" in doctor_checks(tmp_path, fp32)[1]["engines"]["detail"]


def test_doctor_starts_cuda_as_the_runtime_does(tmp_path, socket_config, monkeypatch):
    from tests.support import trt_harness
    (tmp_path / "root").mkdir()
    gpu = {**socket_config, "placement": {"decoder": ["gpu", "cpu"]}}
    # both bindings installed, pycuda sees no device: the runtime uses cuda-python, which does
    monkeypatch.setattr(edgemm.cli.doctor.ctypes.util, "find_library", lambda name: None)  # no toolkit either
    trt_harness.install(monkeypatch, "10.3.0", cuda="both", pycuda_devices=0)
    code, checks = doctor_checks(tmp_path, gpu)
    assert checks["cuda"]["level"] == "ok" and checks["cuda"]["detail"].startswith(
        "GPU 0 Orin (compute 8.7, integrated) through cuda-python 12.9.fake"), checks["cuda"]
    assert checks["cuda binding"] == {"name": "cuda binding", "level": "ok",
                                      "detail": "cuda-python 12.9.fake started CUDA"}
    # a cuda-python that cannot start the driver: the runtime falls back to pycuda, and so does doctor
    trt_harness.install(monkeypatch, "10.3.0", cuda="both",
                        fail={"cuInit": trt_harness.fake_cuda.CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH})
    checks = doctor_checks(tmp_path, gpu)[1]
    assert checks["cuda"]["level"] == "ok" and "through pycuda 2024.1.fake" in checks["cuda"]["detail"]
    # neither starts it: the runtime's one line, both reasons
    trt_harness.install(monkeypatch, "10.3.0", cuda="both", pycuda_devices=0,
                        fail={"cuInit": trt_harness.fake_cuda.CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH})
    code, checks = doctor_checks(tmp_path, gpu)
    assert code == 3 and checks["cuda"] == {"name": "cuda", "level": "fail", "detail": (
        "no device initialised: cuda-python 12.9.fake: CUDA cuInit failed: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH "
        "(system driver mismatch); pycuda: CUDA (pycuda) init failed: cuInit failed: no CUDA-capable device is "
        "detected (needed for gpu/dla placement and providers cuda/tensorrt)")}
    assert checks["cuda binding"] == {"name": "cuda binding", "level": "fail", "detail": (
        "cuda-python 12.9.fake, pycuda 2024.1.fake installed, but neither started CUDA (the cuda line says why; "
        "placement lists gpu)")}


def test_doctor_cuda_says_whether_a_device_initialised(tmp_path, socket_config, monkeypatch):
    (tmp_path / "root").mkdir()
    gpu = {**socket_config, "placement": {"decoder": ["gpu", "cpu"]}}
    # this machine has no GPU: whatever CUDA libraries are installed, no device initialises
    code, checks = doctor_checks(tmp_path, gpu)
    assert checks["cuda"]["level"] == "fail" and code == 3, checks["cuda"]
    assert "no device initialised" in checks["cuda"]["detail"] or "to initialise a device" in checks["cuda"]["detail"]
    # what pycuda's driver says without a device is the line's reason
    driver = types.ModuleType("pycuda.driver")

    class Error(Exception):
        pass

    def init():
        raise Error("cuInit failed: no CUDA-capable device is detected")
    driver.Error, driver.init = Error, init
    package = types.ModuleType("pycuda")
    package.driver = driver
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)
    checks = doctor_checks(tmp_path, gpu)[1]
    assert checks["cuda"] == {"name": "cuda", "level": "fail", "detail": checks["cuda"]["detail"]}
    assert checks["cuda"]["detail"].startswith("no device initialised: ")  # after cuda-python's reason, if installed
    assert "CUDA (pycuda) init failed: cuInit failed: no CUDA-capable device" in checks["cuda"]["detail"]
    assert doctor_checks(tmp_path, socket_config)[1]["cuda"]["level"] == "warn"  # cpu placement: not needed
