"""The gemma3 family (Gemma 3 with vision): what is its own.

tests/fixtures/gemma3-tiny is a tiny random Gemma3ForConditionalGeneration exported to the
Hugging Face ONNX layout, with what transformers' processor and greedy `generate` gave for a
few images and prompts (tests/fixtures/make/make_gemma3_fixture.py), `generate` run without token_type_ids
(the causal attention a 2-D mask expresses; see edgemm/model/families/gemma3.py). Its text
model has sliding-window layers with a window shorter than every prompt. The cases every
family passes against that reference are tests/test_family_conformance.py's.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgemm.errors import InputError, ModelError
from edgemm.model.families.gemma3 import Gemma3Adapter, expand_image
from edgemm.model.manifest import load_manifest
from edgemm.model import resample as resample_module
from edgemm.model.resample import resize_pil
from edgemm.engine.runtime import Runtime
from tests.support.family_conformance import GEMMA3, answer, make_runtime, runtime_of

FIXTURE = GEMMA3.path
REFERENCE = GEMMA3.reference
CASES = GEMMA3.cases


@pytest.fixture
def runtime() -> Runtime:
    return runtime_of(GEMMA3)


# ---- the fixture, the image prefix ------------------------------------------------------------

def test_fixture_covers_two_aspects_stops_and_the_sliding_window():
    assert {c["finish_reason"] for c in CASES} == {"stop", "length"}
    assert len({c["image"] for c in CASES}) == 2
    window = json.loads((FIXTURE / "config.json").read_text())["text_config"]["sliding_window"]
    assert all(len(c["input_ids"]) > window for c in CASES)  # the window really cuts in
    assert REFERENCE["token_type_ids"] is False


def test_a_family_that_says_its_prefix_is_not_causal_is_never_reused(monkeypatch):
    monkeypatch.setattr(Gemma3Adapter, "reuses_image_prefix", False)
    cached = make_runtime(FIXTURE)
    first, second = (CASES[i] for i in GEMMA3.second_question)
    a, b = answer(cached, GEMMA3, first), answer(cached, GEMMA3, second)
    assert not a.prefix_reused and not b.prefix_reused
    assert (a.tokens, b.tokens) == (first["tokens"], second["tokens"])


# ---- prompt, pixels -----------------------------------------------------------------------------

def test_expand_image_as_gemma3_processor(runtime):
    cfg = runtime.adapter.cfg
    assert expand_image(cfg) == "\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n"
    prompt = runtime.adapter.build_prompt("hi", runtime.manifest.tiers["32x32"])
    ids = prompt.input_ids[0]
    assert ids.tolist().count(runtime.adapter.tokenizer.token_to_id("<bos>")) == 1  # the template's, not a second
    assert np.array_equal(prompt.image_positions, np.arange(prompt.image_start, prompt.image_start + 16))


@pytest.mark.parametrize("token", ["<start_of_image>", "<image_soft_token>", "<end_of_image>"])
def test_prompt_with_an_image_token_is_refused(runtime, token):
    with pytest.raises(InputError, match="image token"):
        runtime.adapter.build_prompt(f"look {token}", runtime.manifest.tiers["32x32"])


@pytest.mark.parametrize("chunk", [40, resample_module.COEFFICIENTS_PER_CHUNK])
@pytest.mark.parametrize("resample", [1, 2, 3])
def test_pillow_filters_are_bit_exact_whole_and_windowed(resample, chunk, monkeypatch):
    """Pillow's own resize, also for strips (over 100 times taller than wide: Pillow 12 runs
    the vertical pass first), for a window of the result alone, and with the weights made
    a few outputs at a time (`chunk` entries: more taps than outputs per chunk)."""
    if int(pytest.importorskip("PIL").__version__.split(".")[0]) >= 13:
        pytest.skip("Pillow 13 orders its two resize passes differently")
    from PIL import Image as pil
    monkeypatch.setattr(resample_module, "COEFFICIENTS_PER_CHUNK", chunk)
    rng = np.random.default_rng(resample)
    for i in range(24):
        h, w = (int(v) for v in rng.integers(1, 400, 2))
        h, w = (h, int(rng.integers(1, 4))) if i % 3 == 0 else (int(rng.integers(1, 4)), w) if i % 3 == 1 else (h, w)
        out_h, out_w = (int(v) for v in rng.integers(1, 40, 2))
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        expected = np.asarray(pil.fromarray(rgb).resize((out_w, out_h), resample))
        assert np.array_equal(resize_pil(rgb, out_h, out_w, resample), expected), (h, w, out_h, out_w)
        top, left = int(rng.integers(0, out_h)), int(rng.integers(0, out_w))
        rows, cols = (top, int(rng.integers(top + 1, out_h + 1))), (left, int(rng.integers(left + 1, out_w + 1)))
        window = resize_pil(rgb, out_h, out_w, resample, rows, cols)
        assert np.array_equal(window, expected[rows[0]:rows[1], cols[0]:cols[1]]), (h, w, out_h, out_w, rows, cols)


def test_a_strip_of_many_megapixels_is_resized_in_bounded_pieces(monkeypatch):
    """A 1 x 4 000 000 strip shrunk to 32 px: 250 000 bilinear taps per output. The weights are
    made COEFFICIENTS_PER_CHUNK at a time, never all 32 x 250 000 at once."""
    made = []
    real = resample_module._coefficients
    monkeypatch.setattr(resample_module, "_coefficients", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    strip = np.zeros((1, 4_000_000, 3), np.uint8)
    strip[:, ::2] = 200
    out = resize_pil(strip, 32, 32, 2)
    assert out.shape == (32, 32, 3) and np.abs(out.astype(int) - 100).max() <= 1
    assert max(w.size for _, w in made) <= resample_module.COEFFICIENTS_PER_CHUNK


# ---- special tokens, refusals -----------------------------------------------------------------

def test_stop_tokens_are_end_of_turn_and_eos(runtime):
    assert isinstance(runtime.adapter, Gemma3Adapter)
    names = {runtime.adapter.tokenizer.id_to_token(i) for i in runtime.adapter.stop_ids}
    assert names == {"<end_of_turn>", "<eos>"}


@pytest.fixture
def broken(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "gemma3"))


def test_pan_and_scan_is_refused_in_one_line(broken):
    path = broken / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_pan_and_scan": True}))
    with pytest.raises(ModelError, match="do_pan_and_scan true is not supported"):
        load_manifest(broken)
