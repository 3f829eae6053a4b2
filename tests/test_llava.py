"""The llava family (LLaVA-1.5; FastVLM as llava_qwen2): what is its own.

tests/fixtures/llava-tiny is a tiny random LlavaForConditionalGeneration (CLIP vision tower,
second-to-last layer without CLS, GELU projector, Llama text model) exported to the Hugging
Face ONNX layout, with what transformers' processor and greedy `generate` gave for a few
images and prompts (tests/fixtures/make/make_llava_fixture.py). The cases every family passes against that
reference are tests/test_family_conformance.py's.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgemm.errors import InputError, ModelError
from edgemm.model.families.llava import LlavaAdapter, center_crop, resized_size
from edgemm.model.manifest import load_manifest
from edgemm.model.resample import resize_pil
from edgemm.engine.runtime import Runtime
from tests.support.family_conformance import LLAVA, make_runtime, runtime_of

FIXTURE = LLAVA.path
CASES = LLAVA.cases


@pytest.fixture
def runtime() -> Runtime:
    return runtime_of(LLAVA)


# ---- prompt, pixels -----------------------------------------------------------------------------

def test_chat_text_is_the_processors_and_image_expands_to_n(runtime):
    source = (FIXTURE / "chat_template.jinja").read_text()
    assert "{% generation %}" in source  # transformers' tag, which edgemm's sandbox renders as nothing
    case = CASES[0]
    assert runtime.adapter.chat_text(case["prompt"]) == case["text"]
    prompt = runtime.adapter.build_prompt("hi", runtime.manifest.tiers["32x32"])
    ids = prompt.input_ids[0].tolist()
    assert ids[0] == runtime.adapter.tokenizer.token_to_id("<s>") and ids.count(ids[0]) == 1
    assert np.array_equal(prompt.image_positions, np.arange(prompt.image_start, prompt.image_start + 16))


def test_prompt_with_the_image_token_is_refused(runtime):
    with pytest.raises(InputError, match="image token"):
        runtime.adapter.build_prompt("look <image>", runtime.manifest.tiers["32x32"])


@pytest.mark.parametrize("size, resized", [((120, 160), (32, 42)), ((150, 64), (75, 32)), ((32, 32), (32, 32)),
                                           ((7, 1000), (32, 4571)), ((1000, 7), (4571, 32))])
def test_shortest_edge_resize_truncates_the_long_side(size, resized):
    assert resized_size(*size, {"shortest_edge": 32}) == resized


def test_center_crop_zero_pads_an_image_smaller_than_the_crop():
    image = np.full((3, 5, 3), 9, np.uint8)
    out = center_crop(image, 4, 4)
    assert out.shape == (4, 4, 3)
    assert (out[1:4, :, 0] == 9).all() and (out[0] == 0).all()  # one row of padding on top (ceil)


def test_a_long_strip_is_cropped_without_making_the_whole_resize(runtime, monkeypatch):
    """Shortest edge 32 makes a 2 x 5 000 000 strip 32 x 80 000 000 (7.7 GB as RGB8); only its
    centre crop is computed. A smaller strip checks the pixels against Pillow's full resize."""
    from edgemm.model.families import llava
    asked = []
    monkeypatch.setattr(llava, "resize_pil", lambda *a: asked.append(a[1:]) or resize_pil(*a))
    huge = np.zeros((2, 5_000_000, 3), np.uint8)
    assert runtime.adapter.pixels(huge, runtime.manifest.tiers["32x32"]).shape == (1, 3, 32, 32)
    assert asked == [(32, 80_000_000, 3, (0, 32), (39_999_984, 40_000_016))]
    monkeypatch.undo()
    pil = pytest.importorskip("PIL.Image")
    strip = np.random.default_rng(0).integers(0, 256, (4, 3000, 3), dtype=np.uint8)
    resized = np.asarray(pil.fromarray(strip).resize((24000, 32), 3))  # (w, h), as transformers sizes it
    crop = resized[:, (24000 - 32) // 2:][:, :32].transpose(2, 0, 1)[None]
    cfg = runtime.adapter.cfg
    expected = ((crop.astype(np.float64) * cfg["rescale_factor"]).astype(np.float32)
                - np.asarray(cfg["image_mean"], np.float32)[None, :, None, None]) \
        / np.asarray(cfg["image_std"], np.float32)[None, :, None, None]
    np.testing.assert_array_equal(runtime.adapter.pixels(strip, runtime.manifest.tiers["32x32"]), expected)


def test_stop_token_is_eos(runtime):
    assert isinstance(runtime.adapter, LlavaAdapter)
    assert {runtime.adapter.tokenizer.id_to_token(i) for i in runtime.adapter.stop_ids} == {"</s>"}


# ---- folder detection and errors --------------------------------------------------------------


@pytest.fixture
def broken(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "llava"))


@pytest.mark.parametrize("name", ["wide.png", "tall.png"])
def test_do_pad_pixels_equal_llava_image_processor(broken, name):
    path = broken / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_pad": True}))
    request = make_runtime(broken, cache={"max_bytes": 0}).prepare(broken / name, "hi")
    expected = np.load(FIXTURE / "reference_pixels.npz")[f"pad-{name}"]
    np.testing.assert_allclose(request.pixel_values, expected, rtol=0, atol=1e-6)
    plain = np.load(FIXTURE / "reference_pixels.npz")[f"case{[c['image'] for c in CASES].index(name)}"]
    assert np.abs(expected - plain).max() > 0.1  # padding really changes the pixels


def test_do_pad_refuses_a_square_bigger_than_any_image_accepted(broken):
    path = broken / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_pad": True}))
    adapter = make_runtime(broken).adapter
    with pytest.raises(InputError, match="padded to a square"):
        adapter.pixels(np.zeros((2, 6000, 3), np.uint8), load_manifest(broken).tiers["32x32"])


def fastvlm_style(folder: Path) -> Path:
    """The fixture's files as FastVLM's ONNX folder words them: model_type llava_qwen2, no
    vision_config, and transformers.js's processor_config.json (patch_size, no strategy)."""
    config = json.loads((folder / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("vision_")}
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llava_qwen2"}))
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_token": "<image>", "patch_size": 8, "num_additional_image_tokens": 0}))
    return folder


def test_a_llava_qwen2_folder_is_the_llava_family(broken):
    manifest = load_manifest(fastvlm_style(broken))
    assert manifest.family == "llava" and manifest.tiers["32x32"].image_tokens == 4 * 4
    case = CASES[1]
    result = make_runtime(broken, cache={"max_bytes": 0}).infer(broken / case["image"], case["prompt"],
                                                                max_new_tokens=LLAVA.max_new_tokens)
    assert result.tokens == case["tokens"]


def test_missing_patch_size_is_named(broken):
    fastvlm_style(broken)
    (broken / "processor_config.json").write_text(json.dumps({"image_token": "<image>"}))
    with pytest.raises(ModelError, match="needs patch_size"):
        load_manifest(broken)
