"""The fake TensorRT and fake CUDA driver installed as the modules edgemm imports, and the
scenario each TensorRT release can reach (build, load, run), for the fake-module tests and
the surface check."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path

from tests.support import fake_cuda  # noqa: F401 (tests reach it as trt_harness.fake_cuda)
from tests.support.fake_tensorrt import FakeTensorRT
from edgemm.config import load_config
from edgemm.backends.tensorrt.build import BuildRequest, build_engines
from edgemm.backends.tensorrt.platform import probe, version_tuple
from edgemm.model.manifest import load_manifest
from edgemm.engine.runtime import Runtime

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-vlm"
IDEFICS3_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "idefics3-tiny"
SAMPLE = MODEL_DIR / "samples" / "scene_11.png"


@dataclass
class Fakes:
    trt: FakeTensorRT
    memory: fake_cuda.Memory
    driver: types.ModuleType


def install(monkeypatch, version: str = "10.3.0", cuda: str = "cuda-python", integrated: bool = True,
            dla_cores: int = 2, pycuda_devices: int = 1, **driver_options) -> Fakes:
    """Put the fakes where `import tensorrt` and edgemm.backends.tensorrt.cuda look for them. `cuda`:
    "cuda-python", "pycuda", or "both" (driver_options go to cuda-python; pycuda sees
    `pycuda_devices`, one by default)."""
    memory = fake_cuda.Memory()
    trt = FakeTensorRT(version, memory, dla_cores)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    if cuda in ("cuda-python", "both"):
        driver = fake_cuda.cuda_python(memory, integrated=integrated, **driver_options)
        package = types.ModuleType("cuda.bindings")
        package.__version__, package.driver = "12.9.fake", driver
        monkeypatch.setitem(sys.modules, "cuda.bindings", package)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
        if cuda == "both":
            pycuda = fake_cuda.pycuda(memory, integrated=integrated, devices=pycuda_devices)
            monkeypatch.setitem(sys.modules, "pycuda", _pycuda_package(pycuda, monkeypatch))
        else:  # not installed, whatever this machine has: a failed cuda-python falls back to pycuda
            monkeypatch.setitem(sys.modules, "pycuda", None)
            monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    else:
        driver = fake_cuda.pycuda(memory, integrated=integrated, **driver_options)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # not installed: ImportError
        monkeypatch.setitem(sys.modules, "pycuda", _pycuda_package(driver, monkeypatch))
    return Fakes(trt, memory, driver)


def _pycuda_package(driver: types.ModuleType, monkeypatch) -> types.ModuleType:
    package = types.ModuleType("pycuda")
    package.__version__, package.driver = "2024.1.fake", driver
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)
    return package


def build(out: Path, device: str = "gpu", precision: str = "int8", model_dir: Path = MODEL_DIR, **options):
    model = load_manifest(model_dir)
    request = BuildRequest(model_dir=model_dir, out=out, device=device, precision=precision, **options)
    return build_engines(request, model, probe(), echo=lambda *a, **k: None)


def built_embed(out: Path):
    """The embedding built for the GPU at int8 into `out` and loaded there: the smallest component
    a test of one engine's buffers, copies and failures needs."""
    from edgemm.backends.tensorrt.component import TensorRTBackend  # after install(): it imports the fake tensorrt
    build(out, components=["embed_tokens"])
    return TensorRTBackend.for_model(load_manifest(MODEL_DIR), out).load_component("embed_tokens", "gpu", "int8")


def runtime(engines: Path, precision: str = "int8", model_dir: Path = MODEL_DIR, **placement) -> Runtime:
    placement = {"vision_encoder": ["gpu", "cpu"], "embed_tokens": ["gpu", "cpu"], "decoder": ["gpu", "cpu"],
                 **placement}
    return Runtime(load_config({"model": {"path": str(model_dir), "precision": precision, "engines": str(engines)},
                                "placement": placement, "backend": {"warmup": False, "intra_op_threads": 1}}))


def reachable(version: str, out: Path) -> list[str]:
    """Build and run every path `version` can reach with the built-in model; returns what ran."""
    ran = []
    major = version_tuple(version)[0]
    build(out, "gpu", "int8")
    ran.append("gpu int8 build")
    if major < 11:  # the model ships no _fp16 graph, which strongly typed FP16 needs
        build(out, "gpu", "fp16")
        ran.append("gpu fp16 build")
    try:
        build(out, "dla0", "int8")
        ran.append("dla0 int8 build")
        dla = ["dla0"]
    except Exception:  # 10.8 … 11.4.0 have no DLA: refused before TensorRT is touched
        dla = []
    rt = runtime(out, vision_encoder=dla + ["gpu", "cpu"])
    answer = rt.infer(SAMPLE, "how many shapes are there ?", max_new_tokens=4, tier="low")
    ran.append(f"run on {rt.devices}: {answer.text!r}")
    return ran
