"""engines/<model>/manifest.yaml: writing, reading back, and every mismatch message."""
from __future__ import annotations

import dataclasses
import shlex

import pytest
import yaml

from edgemm.backends.tensorrt.manifest import (MANIFEST, EngineEntry, EngineManifest, read_manifest,
                                     rebuild_command, select_engines, sha256, write_manifest)
from edgemm.backends.tensorrt.platform import Platform, require_device
from edgemm.errors import EngineError

ORIN = Platform(tensorrt="10.3.0", gpu="Orin", compute_capability="8.7", integrated=True, dla_cores=2)
TIERS = ["low", "mid", "high"]


@pytest.fixture
def built(tmp_model, tmp_path):
    """A folder as `edgemm engines build` leaves it: a GPU decoder plan and DLA encoder plans."""
    folder = tmp_path / "engines" / "tiny-vlm"
    folder.mkdir(parents=True)
    manifest = EngineManifest(model="tiny-vlm", model_dir=str(tmp_model))

    def add(component, device, precision, tier, onnx_name):
        plan = folder / f"{component}.{device}.{precision}{'.' + tier if tier else ''}.plan"
        plan.write_bytes(f"plan of {component} {device} {tier}".encode())
        manifest.put(EngineEntry(
            component=component, device=device, precision=precision, tier=tier, file=plan.name,
            profiles=[{"pixel_values": {"min": [1, 3, 128, 128], "opt": [1, 3, 128, 128], "max": [1, 3, 128, 128]}}],
            tensorrt="10.3.0", compute_capability="8.7", dla_core=int(device[3:]) if tier else None,
            plan_sha256=sha256(plan), onnx=onnx_name, onnx_sha256=sha256(tmp_model / onnx_name),
            flags=["INT8", "FP16"], quantization="calibration-cache", build_seconds=1.5))

    add("decoder", "gpu", "int8", None, "decoder_model_merged_int8.onnx")
    for tier in TIERS:
        add("vision_encoder", "dla0", "int8", tier, "vision_encoder_int8.onnx")
    write_manifest(folder, manifest)
    return folder, tmp_model


def select(folder, model_dir, component="vision_encoder", device="dla0", precision="int8",
           platform=ORIN, model="tiny-vlm"):
    return select_engines(folder, model_dir, model, component, device, precision, TIERS, platform)


def message(fn, *args, **kwargs) -> str:
    with pytest.raises(EngineError) as info:
        fn(*args, **kwargs)
    text = str(info.value)
    assert "\n" not in text
    return text


def cmd(folder, model_dir, component="vision_encoder", device="dla0", precision="int8", tier=None) -> str:
    return rebuild_command(model_dir, folder, component, device, precision, tier)


def test_written_manifest_reads_back_equal(built):
    folder, model_dir = built
    manifest = read_manifest(folder, "unused")
    assert manifest.model == "tiny-vlm" and manifest.model_dir == str(model_dir)
    assert sorted(e.tier or "" for e in manifest.engines) == ["", "high", "low", "mid"]
    again = folder / "again"
    again.mkdir()
    write_manifest(again, manifest)
    assert read_manifest(again, "unused") == manifest
    raw = yaml.safe_load((folder / MANIFEST).read_text())
    assert raw["format"] == 1 and {"plan_sha256", "onnx_sha256", "tensorrt", "compute_capability",
                                   "dla_core", "flags", "build_seconds", "profiles"} <= set(raw["engines"][0])


def test_put_replaces_the_same_engine_and_keeps_the_others(built):
    folder, _ = built
    manifest = read_manifest(folder, "unused")
    entry = dataclasses.replace(manifest.find("vision_encoder", "dla0", "int8")[0], build_seconds=9.0)
    manifest.put(entry)
    assert len(manifest.engines) == 4
    assert [e.build_seconds for e in manifest.engines if e.key == entry.key] == [9.0]


def test_matching_engines_are_selected_one_per_tier_on_dla(built):
    folder, model_dir = built
    chosen = select(folder, model_dir)
    assert [e.tier for e, _ in chosen] == TIERS
    assert all(path.parent == folder and path.is_file() for _, path in chosen)
    (decoder, path), = select(folder, model_dir, "decoder", "gpu")
    assert decoder.tier is None and path.name == "decoder.gpu.int8.plan"


def test_rebuild_command_is_a_runnable_command_line(tmp_path):
    text = rebuild_command(tmp_path / "my model", "engines/x", "decoder", "gpu", "fp16")
    assert shlex.split(text) == ["edgemm", "engines", "build", str(tmp_path / "my model"), "--out", "engines/x",
                                 "--device", "gpu", "--precision", "fp16", "--components", "decoder"]
    assert text.endswith("--tiers low") is False
    assert rebuild_command("m", "o", "vision_encoder", "dla1", "int8", "low").endswith("--tiers low")


def test_missing_manifest(tmp_path, tmp_model):
    folder = tmp_path / "nothing"
    assert message(select, folder, tmp_model) == (
        f"no engine manifest {folder / MANIFEST}; build the engines with: {cmd(folder, tmp_model)}")


def test_unreadable_manifest(built):
    folder, model_dir = built
    (folder / MANIFEST).write_text("engines: [\n")
    assert message(select, folder, model_dir).startswith(f"{folder / MANIFEST} is not valid YAML (")
    (folder / MANIFEST).write_text("format: 7\nmodel: tiny-vlm\n")
    assert message(select, folder, model_dir) == (
        f"{folder / MANIFEST} has manifest format 7, this edgemm reads format 1; rebuild with: {cmd(folder, model_dir)}")


def test_a_fifo_huge_or_deep_manifest_is_refused_without_reading_it(built):
    """read_text() would block on a FIFO for ever and read a huge file whole; yaml.safe_load
    recursed into a RecursionError on deep nesting."""
    import os
    from edgemm.backends.tensorrt.manifest import MAX_MANIFEST_BYTES
    folder, model_dir = built
    path = folder / MANIFEST
    path.unlink()
    os.mkfifo(path)  # no writer: opening it for reading would wait for one
    assert message(select, folder, model_dir) == (
        f"{path}: path is a FIFO, not a regular file; rebuild with: {cmd(folder, model_dir)}")
    path.unlink()
    with open(path, "wb") as f:  # sparse: no disk used
        f.truncate(MAX_MANIFEST_BYTES + 1)
    assert message(select, folder, model_dir) == (
        f"{path}: is {MAX_MANIFEST_BYTES + 1} bytes, above the {MAX_MANIFEST_BYTES} byte limit "
        f"(for an engine manifest); rebuild with: {cmd(folder, model_dir)}")
    path.write_text("engines: " + "[" * 500 + "]" * 500 + "\n")
    assert "nests more than 64 levels deep" in message(select, folder, model_dir)


def test_other_model(built):
    folder, model_dir = built
    assert message(select, folder, model_dir, model="big-vlm") == (
        f"{folder / MANIFEST} describes model 'tiny-vlm', not 'big-vlm'; rebuild with: {cmd(folder, model_dir)}")


def test_no_engine_for_that_device_or_precision(built):
    folder, model_dir = built
    assert message(select, folder, model_dir, device="gpu") == (
        f"{folder / MANIFEST} has no int8 engine for vision_encoder on gpu; build it with: "
        f"{cmd(folder, model_dir, device='gpu')}")
    assert message(select, folder, model_dir, "decoder", "gpu", "fp16") == (
        f"{folder / MANIFEST} has no fp16 engine for decoder on gpu; build it with: "
        f"{cmd(folder, model_dir, 'decoder', 'gpu', 'fp16')}")


def test_dla_tier_missing(built):
    folder, model_dir = built
    manifest = read_manifest(folder, "unused")
    manifest.engines = [e for e in manifest.engines if e.tier != "mid"]
    write_manifest(folder, manifest)
    assert message(select, folder, model_dir) == (
        f"{folder / MANIFEST} has no dla0 engine for vision_encoder at tier(s) mid; build with: "
        f"{cmd(folder, model_dir, tier='mid')}")


def test_other_tensorrt_version(built):
    folder, model_dir = built
    newer = dataclasses.replace(ORIN, tensorrt="10.7.0")
    assert message(select, folder, model_dir, platform=newer) == (
        "engine vision_encoder.dla0.int8.low.plan was built with TensorRT 10.3.0, this is TensorRT 10.7.0; "
        f"rebuild with: {cmd(folder, model_dir)}")


def test_other_gpu(built):
    folder, model_dir = built
    thor = dataclasses.replace(ORIN, gpu="Thor", compute_capability="11.0", dla_cores=0)
    assert message(select, folder, model_dir, "decoder", "gpu", platform=thor) == (
        "engine decoder.gpu.int8.plan was built for compute capability 8.7, this GPU (Thor) has 11.0; "
        f"rebuild with: {cmd(folder, model_dir, 'decoder', 'gpu')}")


def test_dla_plan_on_a_module_without_that_core(built):
    folder, model_dir = built
    nano = dataclasses.replace(ORIN, gpu="Orin Nano", dla_cores=0)
    assert message(select, folder, model_dir, platform=nano) == (
        "engine vision_encoder.dla0.int8.low.plan runs on DLA core 0, this module (Orin Nano) has no DLA cores; "
        f"place vision_encoder on another device or rebuild with: {cmd(folder, model_dir)}")


def test_missing_plan_file(built):
    folder, model_dir = built
    (folder / "vision_encoder.dla0.int8.mid.plan").unlink()
    assert message(select, folder, model_dir) == (
        f"engine file {folder / 'vision_encoder.dla0.int8.mid.plan'} is missing; "
        f"rebuild with: {cmd(folder, model_dir, tier='mid')}")


def test_changed_plan_file(built):
    folder, model_dir = built
    (folder / "decoder.gpu.int8.plan").write_bytes(b"truncated")
    assert message(select, folder, model_dir, "decoder", "gpu") == (
        f"engine file {folder / 'decoder.gpu.int8.plan'} does not match the sha256 in {folder / MANIFEST}; "
        f"rebuild with: {cmd(folder, model_dir, 'decoder', 'gpu')}")


def test_changed_source_onnx(built):
    folder, model_dir = built
    with open(model_dir / "decoder_model_merged_int8.onnx", "ab") as f:
        f.write(b"\0")
    assert message(select, folder, model_dir, "decoder", "gpu") == (
        f"engine decoder.gpu.int8.plan was built from another {model_dir / 'decoder_model_merged_int8.onnx'} "
        f"(its sha256 changed); rebuild with: {cmd(folder, model_dir, 'decoder', 'gpu')}")


@pytest.mark.parametrize("platform, device, expected", [
    (dataclasses.replace(ORIN, gpu="Orin Nano", dla_cores=0), "dla0",
     "dla0: this module (Orin Nano) has no DLA cores (Orin Nano and Thor have none; AGX Orin and Orin NX have two); use gpu"),
    (dataclasses.replace(ORIN, dla_cores=1), "dla1", "dla1: this module (Orin) has 1 DLA core(s), dla0..dla0"),
])
def test_refuse_missing_dla_core(platform, device, expected):
    assert message(require_device, platform, device) == expected


def test_existing_dla_cores_and_gpu_pass():
    for device in ("gpu", "dla0", "dla1"):
        require_device(ORIN, device)
