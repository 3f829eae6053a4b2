"""The internvl family (InternVL3 -hf) against its reference implementation, transformers.

tests/fixtures/internvl-tiny is a tiny random InternVLForConditionalGeneration exported
to the Hugging Face ONNX layout by tools/export_hf_vlm.py, with what transformers'
InternVLProcessor (default torchvision image processor) and greedy `generate` gave for a
few images, prompts and tile budgets (tools/make_internvl_fixture.py). Neither torch nor
transformers is needed here, except by the slow tests at the end.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgemm.config import load_config
from edgemm.errors import InputError, ModelError
from edgemm.model.families.internvl import expand_image, tile_grid, tiers
from edgemm.model.manifest import load_manifest
from edgemm.model.resample_torch import resize_bicubic_torch
from edgemm.runtime import Runtime

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "internvl-tiny"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
CASES = REFERENCE["cases"]
TOKENS_PER_TILE = 16


def make_runtime(path: Path = FIXTURE, **sections) -> Runtime:
    cfg = {"model": {"path": str(path)}, "backend": {"intra_op_threads": 1, "warmup": False}}
    for key, values in sections.items():
        cfg[key] = {**cfg.get(key, {}), **values}
    return Runtime(load_config(cfg))


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return make_runtime(cache={"max_bytes": 0})


def tier_of(case: dict) -> str:
    return f"tiles{case['max_patches']}"


def case_id(case: dict) -> str:
    return f"{case['image']}-{case['max_patches']}-{case['prompt'].split()[0]}"


# ---- token-exact conformance ------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_processor_outputs_equal_the_reference(runtime, case):
    i = CASES.index(case)
    request = runtime.prepare(FIXTURE / case["image"], case["prompt"], tier=tier_of(case))
    assert request.prompt.input_ids[0].tolist() == case["input_ids"]
    expected = np.load(FIXTURE / "reference_pixels.npz")[f"case{i}"]
    assert request.pixel_values.shape == expected.shape == (1, case["tiles"], 3, 32, 32)
    np.testing.assert_allclose(request.pixel_values, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_greedy_tokens_equal_transformers_generate(runtime, case):
    result = runtime.infer(FIXTURE / case["image"], case["prompt"], tier=tier_of(case),
                           max_new_tokens=REFERENCE["max_new_tokens"])
    assert result.tokens == case["tokens"]
    assert result.finish_reason == case["finish_reason"]
    assert result.image_tokens == case["tiles"] * TOKENS_PER_TILE
    assert result.prompt_tokens == len(case["input_ids"])


def test_fixture_covers_two_aspects_every_tier_and_a_second_question():
    assert len(CASES) >= 4
    at_six = {c["image"]: c["tiles"] for c in CASES if c["max_patches"] == 6}
    assert at_six == {"wide.png": 7, "tall.png": 3}  # 3x2 and 1x2 grids, each with the thumbnail
    assert {c["max_patches"] for c in CASES} == {1, 4, 6}
    asked = [(c["image"], c["max_patches"]) for c in CASES]
    assert any(asked.count(a) > 1 for a in asked)  # one image asked twice at one tier


def test_second_question_reuses_the_cached_image_prefix():
    """InternVL's image prefix is causal: its KV cache is reused for a new question, and the
    answer is still transformers' for that question."""
    cached = make_runtime()
    first, second = CASES[0], CASES[4]
    assert (first["image"], first["max_patches"]) == (second["image"], second["max_patches"])
    assert first["prompt"] != second["prompt"]
    a = cached.infer(FIXTURE / first["image"], first["prompt"], tier=tier_of(first),
                     max_new_tokens=REFERENCE["max_new_tokens"])
    b = cached.infer(FIXTURE / second["image"], second["prompt"], tier=tier_of(second),
                     max_new_tokens=REFERENCE["max_new_tokens"])
    assert not a.prefix_reused and b.prefix_reused
    assert a.tokens == first["tokens"] and b.tokens == second["tokens"]


def test_a_batch_of_three_gives_each_row_its_own_tokens(runtime):
    chosen = [CASES[0], CASES[1], CASES[3]]  # 7, 3 and 3 tiles: prompts of three lengths
    assert len({len(c["input_ids"]) for c in chosen}) == 3
    requests = [runtime.prepare(FIXTURE / c["image"], c["prompt"], tier=tier_of(c),
                                max_new_tokens=REFERENCE["max_new_tokens"]) for c in chosen]
    features = [runtime.encode(r.pixel_values) for r in requests]
    results = runtime.decode_batch(requests, features)
    assert [r.tokens for r in results] == [c["tokens"] for c in chosen]


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


# ---- folder detection and errors --------------------------------------------------------------

def test_folder_without_model_yaml_is_detected():
    manifest = load_manifest(FIXTURE)
    assert manifest.family == "internvl" and not (FIXTURE / "model.yaml").exists()
    assert list(manifest.tiers) == ["tiles1", "tiles4", "tiles6"] and manifest.default_tier == "tiles6"
    assert [t.image_tokens for t in manifest.tiers.values()] == [16, 5 * 16, 7 * 16]
    assert manifest.precisions == ["fp32", "int8"]


def test_tiers_follow_max_patches():
    cfg = {"min_patches": 1, "max_patches": 12, "tile": 448, "image_seq_len": 256}
    assert {n: t.image_tokens for n, t in tiers(cfg).items()} == {
        "tiles1": 256, "tiles4": 5 * 256, "tiles6": 7 * 256, "tiles12": 13 * 256}
    assert list(tiers({**cfg, "min_patches": 2, "max_patches": 4})) == ["tiles4"]


def test_scheduler_picks_the_tile_budget():
    rt = make_runtime(scheduler={"policy": "thresholds", "statistic": "edge_density", "thresholds": [0.0, 2.0]})
    assert rt.scheduler.tiers == ["tiles1", "tiles4", "tiles6"]
    result = rt.infer(FIXTURE / "wide.png", "What is this?", max_new_tokens=2)
    assert result.tier == "tiles4" and result.image_tokens == 5 * TOKENS_PER_TILE


@pytest.fixture
def broken(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "internvl"))


@pytest.mark.parametrize("missing", ["preprocessor_config.json", "tokenizer.json", "onnx/vision_encoder.onnx"])
def test_missing_file_is_named(broken, missing):
    (broken / missing).unlink()
    with pytest.raises(ModelError, match=f"without {missing}"):
        load_manifest(broken)


def test_unknown_model_type_lists_the_known_families(broken):
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "internvl_chat"}))
    with pytest.raises(ModelError, match="model_type 'internvl_chat'") as refused:
        load_manifest(broken)
    known = str(refused.value).split("known: ", 1)[1]
    assert {"idefics3", "internvl"} <= set(known.split(")")[0].split(", "))


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


@pytest.mark.parametrize("case", CASES[:4], ids=case_id)
def test_int8_variant_runs_through_the_same_family_path(runtime, case):
    """The *_int8.onnx graphs (made by tools/quantize.py from this folder) load by suffix and
    take exactly the inputs fp32 takes; their QDQ nodes are really in the graphs."""
    int8 = make_runtime(model={"precision": "int8"}, cache={"max_bytes": 0})
    for component in ("vision_encoder", "decoder_model_merged"):
        ops = {n.op_type for n in onnx.load(FIXTURE / "onnx" / f"{component}_int8.onnx").graph.node}
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    a = runtime.prepare(FIXTURE / case["image"], case["prompt"], tier=tier_of(case))
    b = int8.prepare(FIXTURE / case["image"], case["prompt"], tier=tier_of(case))
    assert b.prompt.input_ids.tolist() == a.prompt.input_ids.tolist()
    np.testing.assert_array_equal(b.pixel_values, a.pixel_values)
    result = int8.infer(FIXTURE / case["image"], case["prompt"], tier=tier_of(case), max_new_tokens=4)
    assert result.precision == "int8" and 1 <= len(result.tokens) <= 4
    assert result.image_tokens == case["tiles"] * TOKENS_PER_TILE


# ---- the exporter and the reference themselves ------------------------------------------------

NEEDS_TRANSFORMERS = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs the fixture extra")


@pytest.mark.slow
@NEEDS_TRANSFORMERS
def test_export_hf_vlm_on_a_checkpoint_folder_answers_as_the_fixture(tmp_path):
    """tools/export_hf_vlm.py, run as a user runs it on a downloaded checkpoint, makes a
    folder whose answers are transformers' (the fixture's reference) token for token."""
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "exported"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_internvl_fixture.py"), "--checkpoint-only",
                    "--checkpoint", str(checkpoint)], check=True, capture_output=True)
    subprocess.run([sys.executable, str(ROOT / "tools" / "export_hf_vlm.py"), str(checkpoint), str(out)],
                   check=True, capture_output=True)
    assert sorted(p.name for p in (out / "onnx").iterdir()) == [
        "decoder_model_merged.onnx", "embed_tokens.onnx", "vision_encoder.onnx"]
    exported = make_runtime(out, cache={"max_bytes": 0})
    for case in CASES:
        result = exported.infer(FIXTURE / case["image"], case["prompt"], tier=tier_of(case),
                                max_new_tokens=REFERENCE["max_new_tokens"])
        assert result.tokens == case["tokens"], case_id(case)


@pytest.mark.slow
@NEEDS_TRANSFORMERS
def test_export_hf_vlm_refuses_what_it_cannot_export(tmp_path):
    tool = [sys.executable, str(ROOT / "tools" / "export_hf_vlm.py")]
    done = subprocess.run([*tool, str(tmp_path), str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode != 0 and "no config.json" in done.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "config.json").write_text("{}")
    done = subprocess.run([*tool, str(tmp_path), str(tmp_path / "full")], capture_output=True, text=True)
    assert done.returncode != 0 and "not empty" in done.stderr


@pytest.mark.slow
@NEEDS_TRANSFORMERS
def test_regenerated_reference_is_the_committed_one(tmp_path):
    pytest.importorskip("torchvision.transforms.v2.functional", reason="the reference processor needs torchvision")
    tool = ROOT / "tools" / "make_internvl_fixture.py"
    subprocess.run([sys.executable, str(tool), "--out", str(tmp_path)], check=True, capture_output=True)
    fresh = json.loads((tmp_path / "reference.json").read_text())
    assert [(c["input_ids"], c["tokens"]) for c in fresh["cases"]] == [(c["input_ids"], c["tokens"]) for c in CASES]


# ---- TensorRT engine profiles (planned here; built against the fakes elsewhere) ---------------

def test_gpu_profile_covers_one_tile_to_the_richest_tier_with_its_thumbnail():
    from edgemm.engines.build import BuildRequest, plan_jobs
    from edgemm.engines.platform import Platform
    orin = Platform(tensorrt="10.3.0", gpu="Orin", compute_capability="8.7", integrated=True, dla_cores=2)
    request = BuildRequest(model_dir=FIXTURE, out=Path("unused"), max_batch=2)
    encoder = plan_jobs(request, load_manifest(FIXTURE), orin)[0]
    # [B,T,3,32,32]: 1 tile (tiles1) … 7 (tiles6: 6 tiles + the thumbnail); no pixel_attention_mask
    assert encoder.profiles == [{"pixel_values": {"min": [1, 1, 3, 32, 32], "opt": [1, 7, 3, 32, 32],
                                                  "max": [2, 7, 3, 32, 32]}}]


def test_encoder_engine_builds_and_runs_through_the_fake_tensorrt(monkeypatch, tmp_path):
    """The GPU plan of the InternVL encoder (5-D tiles, no mask) takes every tier's tile count
    for a wide and a tall image and answers what ONNX Runtime does."""
    import trt_harness as h
    fakes = h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, "gpu", model_dir=FIXTURE, components=["vision_encoder"])
    assert len(fakes.trt._built) == 1 and set(fakes.trt._built[0]["profiles"][0]) == {"pixel_values"}
    ours = h.runtime(tmp_path, model_dir=FIXTURE, vision_encoder=["gpu"], embed_tokens=["cpu"], decoder=["cpu"])
    assert ours.devices["vision_encoder"] == "gpu"
    reference = make_runtime(model={"precision": "int8"})
    tiles = []
    for image in ("wide.png", "tall.png"):
        for tier in ours.manifest.tiers:
            pixels, _ = reference.preprocess(FIXTURE / image, tier)
            assert np.array_equal(ours.generator.encode(pixels), reference.generator.encode(pixels)), (image, tier)
            tiles.append(pixels.shape[1])
    assert tiles == [1, 5, 7, 1, 3, 3]
