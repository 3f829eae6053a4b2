"""The surface check: every tensorrt name edgemm's paths touch on a release, as recorded on the
fake while those paths run, exists in that release's real bindings with the fake's parameter
names and enum values (tests/support/trt_surface.py fetches them from PyPI into a cache:
$EDGEMM_TRT_BINDINGS, else ~/.cache/edgemm-trt-bindings). Skipped, with the reason, where
PyPI or a C compiler is unavailable, unless EDGEMM_REQUIRE_TRT_SURFACE is set (as .ci/run does):
then that is a failure, so CI cannot go green without the check."""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from tests.support import fake_tensorrt
from tests.support import trt_harness as h
from tests.support import trt_surface

ROOT = Path(__file__).resolve().parent.parent

CACHE = Path(os.environ.get("EDGEMM_TRT_BINDINGS") or Path.home() / ".cache" / "edgemm-trt-bindings")
# the fake release each real one is checked for: DLA returned in 11.4.1, newer than PyPI's newest 11.4.0
SCENARIOS = {"8.6.1": ["8.6.1"], "10.3.0": ["10.3.0"], "10.16.1.11": ["10.16.1.11"],
             "11.4.0.106": ["11.4.0.106", "11.4.1"]}


@pytest.fixture(scope="module")
def real_surfaces():
    surfaces = {}
    for version in trt_surface.VERSIONS:
        try:
            surfaces[version] = trt_surface.real_surface(version, CACHE)
        except trt_surface.Unavailable as e:
            if os.environ.get("EDGEMM_REQUIRE_TRT_SURFACE"):  # CI: a check that cannot run is a failure
                pytest.fail(f"real TensorRT bindings unavailable (EDGEMM_REQUIRE_TRT_SURFACE is set): {e}")
            pytest.skip(f"real TensorRT bindings unavailable: {e}")
    return surfaces


def _used_on(monkeypatch, tmp_path, version: str) -> tuple[set, list[str]]:
    fake_tensorrt.used.clear()
    h.install(monkeypatch, version)
    ran = h.reachable(version, tmp_path)
    return set(fake_tensorrt.used), ran


@pytest.mark.parametrize("real_version", list(SCENARIOS))
def test_every_name_the_paths_use_exists_in_the_real_bindings(real_surfaces, monkeypatch, tmp_path, real_version):
    real = real_surfaces[real_version]
    assert real["version"] == real_version
    for fake_version in SCENARIOS[real_version]:
        used, ran = _used_on(monkeypatch, tmp_path / fake_version, fake_version)
        fake = trt_surface.surface(h.FakeTensorRT(fake_version))
        assert ("IExecutionContext", "execute_async_v3") in used and ("Builder", "build_serialized_network") in used
        if fake_version == "11.4.1":  # the DLA build's parser flag is among what the real 11.x must have
            assert ("OnnxParserFlag", "ADJUST_FOR_DLA") in used
        assert trt_surface.missing(used, real, fake) == [], ran


def test_the_check_catches_a_removed_or_renamed_api(real_surfaces):
    real = real_surfaces["11.4.0.106"]
    assert trt_surface.missing({("BuilderFlag", "FP16"), ("NetworkDefinitionCreationFlag", "EXPLICIT_BATCH"),
                                ("", "IInt8EntropyCalibrator2"), ("ICudaEngine", "get_binding_shape")}, real) == [
        "tensorrt.IInt8EntropyCalibrator2 does not exist", "tensorrt.BuilderFlag.FP16 does not exist",
        "tensorrt.ICudaEngine.get_binding_shape does not exist",
        "tensorrt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH does not exist"]
    fake = trt_surface.surface(h.FakeTensorRT("11.4.0"))
    fake["classes"]["IExecutionContext"]["members"]["set_tensor_address"] = [["tensor", "memory"]]
    fake["classes"]["NetworkDefinitionCreationFlag"]["enum"]["STRONGLY_TYPED"] = 1
    assert trt_surface.missing({("IExecutionContext", "set_tensor_address"),
                                ("NetworkDefinitionCreationFlag", "STRONGLY_TYPED")}, real, fake) == [
        "tensorrt.IExecutionContext.set_tensor_address(tensor, memory): the real one takes (name, memory)",
        "tensorrt.NetworkDefinitionCreationFlag.STRONGLY_TYPED is 0, the fake says 1"]


def test_unreachable_pypi_is_unavailable_not_a_failure(tmp_path, monkeypatch):
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on the discard port
    with pytest.raises(trt_surface.Unavailable, match=r"^pip download tensorrt-bindings==8\.6\.1 failed: "):
        trt_surface.fetch("8.6.1", tmp_path)


def test_every_trt_name_in_the_code_is_in_the_fake():
    """Names on paths no scenario reaches are still spelled as some release spells them."""
    fakes = [h.FakeTensorRT(v) for v in ("8.6.1", "10.3.0", "10.16.1.11", "11.4.1")]
    sources = ["edgemm/backends/tensorrt/component.py", "edgemm/backends/tensorrt/build.py", "edgemm/backends/tensorrt/platform.py"]
    names = set()
    for source in sources:
        names |= set(re.findall(r"\btrt\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?", (ROOT / source).read_text()))
    assert len(names) > 15
    for name, member in sorted(names):
        owners = [getattr(f, name) for f in fakes if hasattr(f, name)]
        assert owners, f"trt.{name} is not in the fake"
        if member and not member.startswith("_"):
            assert any(hasattr(o, member) for o in owners), f"trt.{name}.{member} is not in the fake"


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None, reason="no TensorRT installed here (Jetson only)")
def test_the_installed_tensorrt_has_what_its_release_uses(monkeypatch, tmp_path):
    import tensorrt
    real = trt_surface.surface(tensorrt)
    version = ".".join(real["version"].split(".")[:3])
    used, ran = _used_on(monkeypatch, tmp_path, version)
    assert trt_surface.missing(used, real) == [], ran
