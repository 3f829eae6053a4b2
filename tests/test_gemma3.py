"""The gemma3 family (Gemma 3 with vision) against its reference implementation, transformers.

tests/fixtures/gemma3-tiny is a tiny random Gemma3ForConditionalGeneration exported to the
Hugging Face ONNX layout, with what transformers' processor and greedy `generate` gave for a
few images and prompts (tools/make_gemma3_fixture.py), `generate` run without token_type_ids
(the causal attention a 2-D mask expresses; see edgemm/model/families/gemma3.py). Its text
model has sliding-window layers with a window shorter than every prompt. Neither torch nor
transformers is needed here, except by the slow test that regenerates the fixture.
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
from edgemm.model.families.gemma3 import Gemma3Adapter, expand_image
from edgemm.model.manifest import load_manifest
from edgemm.model import resample as resample_module
from edgemm.model.resample import resize_pil
from edgemm.runtime import Runtime

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "gemma3-tiny"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
CASES = REFERENCE["cases"]
MAX_NEW = REFERENCE["max_new_tokens"]


def make_runtime(path: Path = FIXTURE, **sections) -> Runtime:
    cfg = {"model": {"path": str(path)}, "backend": {"intra_op_threads": 1, "warmup": False}}
    for key, values in sections.items():
        cfg[key] = {**cfg.get(key, {}), **values}
    return Runtime(load_config(cfg))


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return make_runtime(cache={"max_bytes": 0})


def case_id(case: dict) -> str:
    return f"{case['image']}-{case['prompt'].split()[0]}"


# ---- token-exact conformance ------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_processor_outputs_equal_the_reference(runtime, case):
    request = runtime.prepare(FIXTURE / case["image"], case["prompt"])
    assert request.prompt.input_ids[0].tolist() == case["input_ids"]
    expected = np.load(FIXTURE / "reference_pixels.npz")[f"case{CASES.index(case)}"]
    assert request.pixel_values.shape == expected.shape == (1, 3, 32, 32)
    np.testing.assert_allclose(request.pixel_values, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_greedy_tokens_equal_transformers_generate(runtime, case):
    result = runtime.infer(FIXTURE / case["image"], case["prompt"], max_new_tokens=MAX_NEW)
    assert result.tokens == case["tokens"]
    assert result.finish_reason == case["finish_reason"]
    assert result.image_tokens == 16 and result.prompt_tokens == len(case["input_ids"])


def test_fixture_covers_two_aspects_stops_and_the_sliding_window():
    assert {c["finish_reason"] for c in CASES} == {"stop", "length"}
    assert len({c["image"] for c in CASES}) == 2
    window = json.loads((FIXTURE / "config.json").read_text())["text_config"]["sliding_window"]
    assert all(len(c["input_ids"]) > window for c in CASES)  # the window really cuts in
    assert REFERENCE["token_type_ids"] is False


def test_a_second_question_reuses_the_image_prefix_and_stays_exact():
    cached = make_runtime()
    first, second = CASES[0], CASES[2]
    assert first["image"] == second["image"] and first["prompt"] != second["prompt"]
    a = cached.infer(FIXTURE / first["image"], first["prompt"], max_new_tokens=MAX_NEW)
    b = cached.infer(FIXTURE / second["image"], second["prompt"], max_new_tokens=MAX_NEW)
    assert not a.prefix_reused and b.prefix_reused
    assert (a.tokens, b.tokens) == (first["tokens"], second["tokens"])


def test_a_family_that_says_its_prefix_is_not_causal_is_never_reused(monkeypatch):
    monkeypatch.setattr(Gemma3Adapter, "reuses_image_prefix", False)
    cached = make_runtime()
    first, second = CASES[0], CASES[2]
    a = cached.infer(FIXTURE / first["image"], first["prompt"], max_new_tokens=MAX_NEW)
    b = cached.infer(FIXTURE / second["image"], second["prompt"], max_new_tokens=MAX_NEW)
    assert not a.prefix_reused and not b.prefix_reused
    assert (a.tokens, b.tokens) == (first["tokens"], second["tokens"])


def test_a_batch_of_three_gives_each_row_its_own_tokens(runtime):
    chosen = CASES[1:4]
    requests = [runtime.prepare(FIXTURE / c["image"], c["prompt"], max_new_tokens=MAX_NEW) for c in chosen]
    results = runtime.decode_batch(requests, [runtime.encode(r.pixel_values) for r in requests])
    alone = [runtime.infer(FIXTURE / c["image"], c["prompt"], max_new_tokens=MAX_NEW).tokens for c in chosen]
    assert [r.tokens for r in results] == alone == [c["tokens"] for c in chosen]
    assert [r.decode_batch for r in results] == [3, 3, 3]
    assert len({len(c["input_ids"]) for c in chosen}) > 1  # rows of different lengths: left padding in play


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


# ---- folder detection and errors --------------------------------------------------------------

def test_folder_without_model_yaml_is_detected():
    manifest = load_manifest(FIXTURE)
    assert manifest.family == "gemma3" and not (FIXTURE / "model.yaml").exists()
    assert list(manifest.tiers) == ["32x32"] and manifest.tiers["32x32"].image_tokens == 16
    assert manifest.precisions == ["fp32", "int8"]


def test_stop_tokens_are_end_of_turn_and_eos(runtime):
    assert isinstance(runtime.adapter, Gemma3Adapter)
    names = {runtime.adapter.tokenizer.id_to_token(i) for i in runtime.adapter.stop_ids}
    assert names == {"<end_of_turn>", "<eos>"}


@pytest.fixture
def broken(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "gemma3"))


@pytest.mark.parametrize("missing", ["preprocessor_config.json", "tokenizer.json", "onnx/decoder_model_merged.onnx",
                                     "onnx/vision_encoder.onnx"])
def test_missing_file_is_named(broken, missing):
    (broken / missing).unlink()
    with pytest.raises(ModelError, match=f"without {missing}"):
        load_manifest(broken)


def test_pan_and_scan_is_refused_in_one_line(broken):
    path = broken / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_pan_and_scan": True}))
    with pytest.raises(ModelError, match="do_pan_and_scan true is not supported"):
        load_manifest(broken)


def test_unknown_model_type_lists_the_known_families(broken):
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_vlm"}))
    with pytest.raises(ModelError, match="model_type 'no_such_vlm'") as e:
        load_manifest(broken)
    assert all(name in str(e.value) for name in ("gemma3", "llava", "llava_qwen2", "idefics3"))


@pytest.mark.parametrize("case", CASES[:2], ids=case_id)
def test_int8_variant_runs_through_the_same_family_path(runtime, case):
    """The *_int8.onnx graphs (tools/quantize.py on this folder) load by suffix and take
    exactly the inputs fp32 takes; their QDQ nodes are really in the graphs."""
    int8 = make_runtime(model={"precision": "int8"}, cache={"max_bytes": 0})
    for component in ("vision_encoder", "decoder_model_merged"):
        ops = {n.op_type for n in onnx.load(FIXTURE / "onnx" / f"{component}_int8.onnx").graph.node}
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    a = runtime.prepare(FIXTURE / case["image"], case["prompt"])
    b = int8.prepare(FIXTURE / case["image"], case["prompt"])
    assert b.prompt.input_ids.tolist() == a.prompt.input_ids.tolist()
    np.testing.assert_array_equal(b.pixel_values, a.pixel_values)
    result = int8.infer(FIXTURE / case["image"], case["prompt"], max_new_tokens=4)
    assert result.precision == "int8" and 1 <= len(result.tokens) <= 4


def test_int8_engines_build_and_answer_as_onnxruntime_through_the_fake_tensorrt(monkeypatch, tmp_path):
    """TensorRT cannot run here: tests/fake_tensorrt.py builds the three Gemma 3 int8 graphs from the
    profiles edgemm derives from their named dimensions, and its plans compute what ONNX Runtime
    computes. Every component placed on the GPU answers like the CPU, case by case."""
    import trt_harness as h
    h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, "gpu", model_dir=FIXTURE)
    on_gpu = h.runtime(tmp_path, model_dir=FIXTURE)
    assert on_gpu.devices == {"vision_encoder": "gpu", "embed_tokens": "gpu", "decoder": "gpu"}
    on_cpu = make_runtime(model={"precision": "int8"}, cache={"max_bytes": 0})
    for case in CASES:
        a = on_gpu.infer(FIXTURE / case["image"], case["prompt"], max_new_tokens=8)
        b = on_cpu.infer(FIXTURE / case["image"], case["prompt"], max_new_tokens=8)
        assert a.devices == {"encode": "gpu", "decode": "gpu"} and a.tokens == b.tokens


# ---- the reference itself ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the fixture extra")
def test_regenerated_reference_is_the_committed_one(tmp_path):
    tool = Path(__file__).resolve().parent.parent / "tools" / "make_gemma3_fixture.py"
    subprocess.run([sys.executable, str(tool), "--out", str(tmp_path)], check=True, capture_output=True)
    fresh = json.loads((tmp_path / "reference.json").read_text())
    assert [(c["input_ids"], c["tokens"]) for c in fresh["cases"]] == [(c["input_ids"], c["tokens"]) for c in CASES]
