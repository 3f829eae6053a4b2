"""The internvl family (InternVL3 -hf): what is its own, and the exporter that made its fixture.

tests/fixtures/internvl-tiny is a tiny random InternVLForConditionalGeneration exported
to the Hugging Face ONNX layout by tools/export_hf_vlm.py, with what transformers'
InternVLProcessor (default torchvision image processor) and greedy `generate` gave for a
few images, prompts and tile budgets (tests/fixtures/make/make_internvl_fixture.py). The cases every
family passes against that reference are tests/test_family_conformance.py's. Neither torch
nor transformers is needed here, except by the slow tests of the exporter.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgemm.errors import InputError, ModelError
from edgemm.model.families.internvl import expand_image, tile_grid, tiers
from edgemm.model.manifest import load_manifest
from edgemm.model.resample_torch import resize_bicubic_torch
from edgemm.engine.runtime import Runtime
from tests.support.family_conformance import INTERNVL, ROOT, TOOLS, answer, make_runtime, maker_command, runtime_of

FIXTURE = INTERNVL.path
CASES = INTERNVL.cases
TOKENS_PER_TILE = 16


@pytest.fixture
def runtime() -> Runtime:
    return runtime_of(INTERNVL)


# ---- the fixture --------------------------------------------------------------------------------

def test_fixture_covers_two_aspects_every_tier_and_a_second_question():
    assert len(CASES) >= 4
    at_six = {c["image"]: c["tiles"] for c in CASES if c["max_patches"] == 6}
    assert at_six == {"wide.png": 7, "tall.png": 3}  # 3x2 and 1x2 grids, each with the thumbnail
    assert {c["max_patches"] for c in CASES} == {1, 4, 6}
    asked = [(c["image"], c["max_patches"]) for c in CASES]
    assert any(asked.count(a) > 1 for a in asked)  # one image asked twice at one tier


# ---- tiling, prompt expansion, resize -----------------------------------------------------------

@pytest.mark.parametrize("size, budget, grid", [
    ((120, 160), 6, (3, 2)),  # wide 4:3 → 3 columns, 2 rows
    ((120, 160), 4, (2, 2)),  # ties 1x1 on aspect; the bigger grid wins while the image covers half
    ((150, 64), 6, (1, 2)),
    ((120, 160), 1, (1, 1)),
    ((10, 10), 4, (1, 1)),  # a tie again, but 2x2 tiles would be over twice the image: stays 1x1
    ((100, 1000), 12, (10, 1)),
])
def test_tile_grid_as_get_optimal_tiled_canvas(size, budget, grid):
    assert tile_grid(*size, (32, 32), 1, budget) == grid


def test_expand_image_as_internvl_processor():
    assert expand_image(3, 2) == "<img>" + "<IMG_CONTEXT>" * 6 + "</img>"


def test_image_positions_are_every_placeholder_in_order(runtime):
    prompt = runtime.adapter.build_prompt("hi", runtime.manifest.tiers["tiles4"], (64, 64))
    ids = prompt.input_ids[0]
    assert len(prompt.image_positions) == 5 * TOKENS_PER_TILE  # 2x2 + thumbnail
    assert np.all(ids[prompt.image_positions] == runtime.adapter.image_id)
    assert np.all(np.diff(prompt.image_positions) == 1)  # one run between <img> and </img>


@pytest.mark.parametrize("token", ["<IMG_CONTEXT>", "<img>", "</img>"])
def test_prompt_with_an_image_token_is_refused(runtime, token):
    with pytest.raises(InputError, match="image token"):
        runtime.adapter.build_prompt(f"look {token}", runtime.manifest.tiers["tiles1"], (32, 32))


def test_stop_tokens_end_the_answer_and_are_not_shown(runtime):
    im_end = runtime.adapter.tokenizer.token_to_id("<|im_end|>")
    assert im_end in runtime.adapter.stop_ids
    text_ids = CASES[0]["tokens"][:3]
    assert runtime.adapter.decode([*text_ids, im_end]) == runtime.adapter.decode(text_ids)


def test_bicubic_is_bit_exact_with_torch_antialiased_uint8():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for i in range(40):
        h, w, out_h, out_w = (int(v) for v in rng.integers(1, 150, 4))
        if i % 2:  # shrinking a lot: wide antialiasing supports (not to 1x1: torch's AVX kernel asserts there)
            out_h, out_w = int(rng.integers(1, 12)), int(rng.integers(2, 12))
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        x = torch.from_numpy(rgb).permute(2, 0, 1)[None].contiguous()
        expected = torch.nn.functional.interpolate(x, size=[out_h, out_w], mode="bicubic", antialias=True,
                                                   align_corners=False)[0].permute(1, 2, 0).numpy()
        assert np.array_equal(resize_bicubic_torch(rgb, out_h, out_w), expected), (h, w, out_h, out_w)


def test_torch_bicubic_gives_the_same_pixels_a_block_of_lines_at_a_time(monkeypatch):
    """resample_torch runs edgemm.model.resample's blocked tap loop: one output line per block,
    or every line in one, the pixels are the same (the block boundaries add nothing)."""
    from edgemm.model import resample
    rng = np.random.default_rng(4)
    images = [(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), oh, ow)
              for h, w, oh, ow in ((37, 300, 90, 448), (200, 150, 7, 3), (5, 600, 448, 448))]
    whole = [resize_bicubic_torch(rgb, oh, ow) for rgb, oh, ow in images]
    monkeypatch.setattr(resample, "CHUNK_BYTES", 1)
    assert all(np.array_equal(resize_bicubic_torch(rgb, oh, ow), w) for (rgb, oh, ow), w in zip(images, whole))
    monkeypatch.setattr(resample, "CHUNK_BYTES", 1 << 40)
    assert all(np.array_equal(resize_bicubic_torch(rgb, oh, ow), w) for (rgb, oh, ow), w in zip(images, whole))


def test_torch_bicubic_weights_are_made_once_per_size_cut_to_the_taps_used_and_read_only():
    """A camera's frames share one size: the second resize reuses the first one's weights,
    which nothing may change in place; taps past every output's window (weight 0) are cut."""
    from edgemm.model import resample_torch
    first, weights, bits = resample_torch._coefficients(1920, 1792)
    assert resample_torch._coefficients(1920, 1792)[1] is weights
    assert weights.shape[1] == 5 and not weights.flags.writeable and not first.flags.writeable
    assert resample_torch._coefficients(640, 1792)[1].shape[1] == 4  # an enlargement: 4 of torch's 5 taps


# ---- tiers, refusals ----------------------------------------------------------------------------

def test_tiers_follow_max_patches():
    cfg = {"min_patches": 1, "max_patches": 12, "tile": 448, "image_seq_len": 256}
    assert {n: t.image_tokens for n, t in tiers(cfg).items()} == {
        "tiles1": 256, "tiles4": 5 * 256, "tiles6": 7 * 256, "tiles12": 13 * 256}
    assert list(tiers({**cfg, "min_patches": 2, "max_patches": 4})) == ["tiles4"]


def test_scheduler_picks_the_tile_budget():
    rt = make_runtime(FIXTURE, scheduler={"policy": "thresholds", "statistic": "edge_density",
                                          "thresholds": [0.0, 2.0]})
    assert rt.scheduler.tiers == ["tiles1", "tiles4", "tiles6"]
    result = rt.infer(FIXTURE / "wide.png", "What is this?", max_new_tokens=2)
    assert result.tier == "tiles4" and result.image_tokens == 5 * TOKENS_PER_TILE


@pytest.fixture
def broken(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "internvl"))


@pytest.mark.parametrize("change, message", [
    ({"resample": 2}, "resample 2 is not supported"),
    ({"size": {"height": 32}}, "size.height and size.width"),
    ({"size": {"height": 32, "width": 64}}, "square tiles"),
    ({"min_patches": 7}, "min_patches and max_patches"),
    ({"max_patches": 10 ** 6}, "max <= 64"),
])
def test_unsupported_preprocessing_is_refused(broken, change, message):
    path = broken / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ModelError, match=message):
        load_manifest(broken)


def test_image_seq_length_that_does_not_fit_the_vision_config_is_refused(broken):
    path = broken / "processor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "image_seq_length": 17}))
    with pytest.raises(ModelError, match="image_seq_length 17"):
        load_manifest(broken)


# ---- the exporter ----------------------------------------------------------------------------

NEEDS_TRANSFORMERS = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs the fixture extra")


@pytest.mark.slow
@NEEDS_TRANSFORMERS
def test_export_hf_vlm_on_a_checkpoint_folder_answers_as_the_fixture(tmp_path):
    """tools/export_hf_vlm.py, run as a user runs it on a downloaded checkpoint, makes a
    folder whose answers are transformers' (the fixture's reference) token for token."""
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "exported"
    subprocess.run(maker_command(INTERNVL, "--checkpoint-only", "--checkpoint", str(checkpoint)),
                   check=True, capture_output=True, cwd=ROOT)
    subprocess.run([sys.executable, str(TOOLS / "export_hf_vlm.py"), str(checkpoint), str(out)],
                   check=True, capture_output=True)
    assert sorted(p.name for p in (out / "onnx").iterdir()) == [
        "decoder_model_merged.onnx", "embed_tokens.onnx", "vision_encoder.onnx"]
    exported = make_runtime(out, cache={"max_bytes": 0})
    for case in CASES:
        assert answer(exported, INTERNVL, case).tokens == case["tokens"], INTERNVL.case_label(case)


@pytest.mark.slow
@NEEDS_TRANSFORMERS
def test_export_hf_vlm_refuses_what_it_cannot_export(tmp_path):
    tool = [sys.executable, str(TOOLS / "export_hf_vlm.py")]
    done = subprocess.run([*tool, str(tmp_path), str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode != 0 and "no config.json" in done.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "config.json").write_text("{}")
    done = subprocess.run([*tool, str(tmp_path), str(tmp_path / "full")], capture_output=True, text=True)
    assert done.returncode != 0 and "not empty" in done.stderr


# ---- TensorRT engine profiles (planned here; built against the fakes elsewhere) ---------------

def test_gpu_profile_covers_one_tile_to_the_richest_tier_with_its_thumbnail():
    from edgemm.backends.tensorrt.build import BuildRequest, plan_jobs
    from edgemm.backends.tensorrt.platform import Platform
    orin = Platform(tensorrt="10.3.0", gpu="Orin", compute_capability="8.7", integrated=True, dla_cores=2)
    request = BuildRequest(model_dir=FIXTURE, out=Path("unused"), max_batch=2)
    encoder = plan_jobs(request, load_manifest(FIXTURE), orin)[0]
    # [B,T,3,32,32]: 1 tile (tiles1) … 7 (tiles6: 6 tiles + the thumbnail); no pixel_attention_mask
    assert encoder.profiles == [{"pixel_values": {"min": [1, 1, 3, 32, 32], "opt": [1, 7, 3, 32, 32],
                                                  "max": [2, 7, 3, 32, 32]}}]


def test_encoder_engine_builds_and_runs_through_the_fake_tensorrt(monkeypatch, tmp_path):
    """The GPU plan of the InternVL encoder (5-D tiles, no mask) takes every tier's tile count
    for a wide and a tall image and answers what ONNX Runtime does."""
    from tests.support import trt_harness as h
    fakes = h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, "gpu", model_dir=FIXTURE, components=["vision_encoder"])
    assert len(fakes.trt._built) == 1 and set(fakes.trt._built[0]["profiles"][0]) == {"pixel_values"}
    ours = h.runtime(tmp_path, model_dir=FIXTURE, vision_encoder=["gpu"], embed_tokens=["cpu"], decoder=["cpu"])
    assert ours.devices["vision_encoder"] == "gpu"
    reference = make_runtime(FIXTURE, model={"precision": "int8"})
    tiles = []
    for image in ("wide.png", "tall.png"):
        for tier in ours.manifest.tiers:
            pixels, _ = reference.preprocess(FIXTURE / image, tier)
            assert np.array_equal(ours.generator.encode(pixels), reference.generator.encode(pixels)), (image, tier)
            tiles.append(pixels.shape[1])
    assert tiles == [1, 5, 7, 1, 3, 3]
