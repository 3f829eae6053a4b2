"""The cases every model family passes against its reference implementation, transformers.

The families' fixtures and what their cases mean are in tests/support/family_conformance.py. Each
test here runs on every fixture (gemma3, llava, fastvlm, idefics3, internvl, qwen2_vl,
qwen2_5_vl); a family's own file tests what is its own. Neither torch nor transformers is
needed here, except by the slow tests that regenerate the fixtures.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgemm.errors import ModelError
from edgemm.model.family import adapter_for
from edgemm.model.manifest import load_manifest
from edgemm.engine.pipeline import Pipeline, Request
from tests.support.family_conformance import (FAMILIES, ROOT, FamilyFixture, answer, make_runtime, maker_command,
                                              prepare, runtime_of)

ALL = list(FAMILIES.values())
CASES = [(f, i) for f in ALL for i in range(len(f.cases))]
INT8_CASES = [(f, i) for f in ALL for i in f.int8_cases]


def fixture_id(fixture: FamilyFixture) -> str:
    return fixture.name


def case_id(which: tuple[FamilyFixture, int]) -> str:
    fixture, i = which
    return f"{fixture.name}-{i}-{fixture.case_label(fixture.cases[i])}"


def _copy(fixture: FamilyFixture, tmp_path: Path) -> Path:
    return Path(shutil.copytree(fixture.path, tmp_path / fixture.folder))


# ---- token-exact conformance ------------------------------------------------------------------

@pytest.mark.parametrize("which", CASES, ids=case_id)
def test_processor_outputs_equal_the_reference(which):
    fixture, i = which
    case, runtime = fixture.cases[i], runtime_of(fixture)
    request = prepare(runtime, fixture, case)
    assert request.prompt.input_ids[0].tolist() == case["input_ids"]
    assert request.pixel_values.shape == fixture.pixel_shape(case)
    fed = fixture.encoder_inputs(runtime, request.pixel_values)
    if fixture.grid_input:
        assert fed[fixture.grid_input].tolist() == [case["image_grid_thw"]]
    expected = fixture.reference_pixels(i)
    assert fed["pixel_values"].shape == expected.shape
    np.testing.assert_allclose(fed["pixel_values"], expected, rtol=0, atol=fixture.pixel_atol)


@pytest.mark.parametrize("which", CASES, ids=case_id)
def test_greedy_tokens_equal_transformers_generate(which):
    fixture, i = which
    case = fixture.cases[i]
    result = answer(runtime_of(fixture), fixture, case)
    assert result.tokens == case["tokens"]
    assert result.finish_reason == case["finish_reason"]
    assert result.image_tokens == fixture.image_tokens(case)
    assert result.prompt_tokens == len(case["input_ids"])


@pytest.mark.parametrize("fixture", ALL, ids=fixture_id)
def test_a_second_question_reuses_the_image_prefix_and_stays_exact(fixture):
    """With the feature cache on, a second question on an image already asked about (at its
    tier) reuses the image's prefix KV cache, and its answer is still transformers'."""
    cached = make_runtime(fixture.path)
    i, j = fixture.second_question
    first, second = fixture.cases[i], fixture.cases[j]
    assert (first["image"], fixture.tier_of(first)) == (second["image"], fixture.tier_of(second))
    assert (first["prompt"] != second["prompt"]) == (i != j)
    a, b = answer(cached, fixture, first), answer(cached, fixture, second)
    assert not a.prefix_reused and b.prefix_reused
    assert (a.tokens, b.tokens) == (first["tokens"], second["tokens"])
    assert cached.cache.stats().hits >= 2  # the features and the prefix


@pytest.mark.parametrize("fixture", ALL, ids=fixture_id)
def test_a_batch_gives_each_row_its_own_tokens(fixture):
    """Requests of different prompt lengths (left padding in play; for M-RoPE, different rope
    deltas) decode together and each row gets the tokens it gets alone, transformers'."""
    runtime = runtime_of(fixture)
    chosen = [fixture.cases[i] for i in fixture.batch]
    assert len({len(c["input_ids"]) for c in chosen}) == fixture.batch_lengths > 1
    requests = [prepare(runtime, fixture, c, max_new_tokens=fixture.max_new_tokens) for c in chosen]
    if fixture.grid_input:
        assert len({r.prompt.rope_delta for r in requests}) > 1
    results = runtime.decode_batch(requests, [runtime.encode(r.pixel_values) for r in requests])
    alone = [answer(runtime, fixture, c).tokens for c in chosen]
    assert [r.tokens for r in results] == alone == [c["tokens"] for c in chosen]
    assert [r.decode_batch for r in results] == [len(chosen)] * len(chosen)


@pytest.mark.parametrize("fixture", ALL, ids=fixture_id)
def test_pipeline_answers_every_case(fixture):
    """The path `edgemm serve` and `stream` take: prepare, encoder batches (by pixel shape),
    continuous decoding; every case gets transformers' tokens."""
    runtime = make_runtime(fixture.path, cache={"max_bytes": 0})
    with Pipeline(runtime, queue_size=8, max_batch=4, batch_timeout_ms=20) as pipeline:
        futures = [pipeline.submit(Request(fixture.path / c["image"], c["prompt"],
                                           {"tier": fixture.tier_of(c), "max_new_tokens": fixture.max_new_tokens}))
                   for c in fixture.cases]
        results = [f.result(timeout=120) for f in futures]
    assert [r.tokens for r in results] == [c["tokens"] for c in fixture.cases]
    assert pipeline.stats.failed == 0


# ---- the folder -------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ALL, ids=fixture_id)
def test_folder_without_model_yaml_is_detected(fixture):
    manifest = load_manifest(fixture.path)
    assert manifest.family == fixture.family and not (fixture.path / "model.yaml").exists()
    assert list(manifest.tiers) == list(fixture.tiers) and manifest.default_tier == fixture.default_tier
    assert [t.image_tokens for t in manifest.tiers.values()] == list(fixture.tiers.values())
    assert manifest.graph_path("decoder", "fp32") == fixture.path / "onnx" / "decoder_model_merged.onnx"
    assert manifest.precisions == fixture.precisions  # found by the files' suffixes


@pytest.mark.parametrize("missing", ["preprocessor_config.json", "tokenizer.json", "onnx/vision_encoder.onnx",
                                     "onnx/embed_tokens.onnx", "onnx/decoder_model_merged.onnx"])
@pytest.mark.parametrize("fixture", ALL, ids=fixture_id)
def test_missing_file_is_named(fixture, missing, tmp_path):
    broken = _copy(fixture, tmp_path)
    (broken / missing).unlink()
    for variant in (broken / missing).parent.glob((broken / missing).stem + "_*.onnx"):  # a graph in no precision
        variant.unlink()
    with pytest.raises(ModelError, match=f"without {missing}"):
        load_manifest(broken)


@pytest.mark.parametrize("fixture", ALL, ids=fixture_id)
def test_unknown_model_type_lists_the_known_families_in_one_line(fixture, tmp_path):
    broken = _copy(fixture, tmp_path)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": fixture.unknown_model_type}))
    with pytest.raises(ModelError, match=rf"unknown model_type '{fixture.unknown_model_type}' \(known: ") as refused:
        load_manifest(broken)
    known = str(refused.value).split("known: ", 1)[1].split(")")[0].split(", ")
    assert {"gemma3", "llava", "llava_qwen2", "idefics3", "internvl", "qwen2_vl", "qwen2_5_vl"} <= set(known)
    assert "\n" not in str(refused.value)


# the special tokens of tokenizer_config.json each family reads (the others take theirs from
# tokenizer.json by their fixed names, and ignore these keys)
TOKENIZER_CONFIG_TOKENS = {"gemma3": {"bos_token", "image_token", "boi_token", "eoi_token"},
                           "llava": {"bos_token", "eos_token", "image_token"},
                           "fastvlm": {"bos_token", "eos_token", "image_token"}}
BROKEN_TOKENS = [5, True, ["<s>"], {"special": True}, {"content": 5}]  # no string, no AddedToken with content


@pytest.mark.parametrize("fixture", ALL, ids=fixture_id)
def test_a_special_token_of_the_wrong_type_is_one_line_naming_the_file_and_key(fixture, tmp_path):
    """A number, a list, or a dict without a string content was taken for absent (the default
    token, silently); null still is, as transformers reads it."""
    folder = _copy(fixture, tmp_path)
    file = folder / "tokenizer_config.json"
    original = json.loads(file.read_text())
    reads = TOKENIZER_CONFIG_TOKENS.get(fixture.name, set())
    for key in ("bos_token", "eos_token", "pad_token", "unk_token", "image_token", "boi_token", "eoi_token"):
        for value in BROKEN_TOKENS:
            file.write_text(json.dumps({**original, key: value}))
            if key not in reads:
                adapter_for(load_manifest(folder))  # a key the family does not read: loads as before
                continue
            with pytest.raises(ModelError) as refused:
                adapter_for(load_manifest(folder))
            assert str(refused.value) == (f"{file}: {key} must be a string or an object with a string content "
                                          f"(got {json.dumps(value)})")
        if key in reads:  # null is absent: the family's default, which these fixtures' tokenizers have
            file.write_text(json.dumps({**original, key: None}))
            adapter_for(load_manifest(folder))
            file.write_text(json.dumps({**{k: v for k, v in original.items() if k != key},
                                        "extra_special_tokens": {key: 7}}))
            with pytest.raises(ModelError, match=f"extra_special_tokens.{key} must be a string or an object"):
                adapter_for(load_manifest(folder))


# preprocessor_config.json edited so that the pixels no longer fit the fixture's encoder: the
# edit, the encoder's declared pixel_values, what the family would feed, and from where
MISMATCHED_PIXELS = {
    "qwen2_vl": ({"temporal_patch_size": 1}, "num_patches, 1176", "any, 588",
                 "3 channels x temporal_patch_size 1 x patch_size 14²"),
    "gemma3": ({"size": {"height": 64, "width": 64}}, "batch_size, 3, 32, 32", "any, 3, 64, 64", "3 channels x size"),
    "llava": ({"crop_size": {"height": 64, "width": 64}}, "batch_size, 3, 32, 32", "any, 3, 64, 64",
              "3 channels x crop_size"),
    "fastvlm": ({"crop_size": {"height": 128, "width": 128}}, "batch_size, 3, 256, 256", "any, 3, 128, 128",
                "3 channels x crop_size"),
    "idefics3": ({"max_image_size": {"longest_edge": 48}}, "batch_size, num_images, 3, 32, 32", "any, any, 3, 48, 48",
                 "3 channels x max_image_size"),
    "internvl": ({"size": {"height": 64, "width": 64}}, "batch_size, num_images, 3, 32, 32", "any, any, 3, 64, 64",
                 "3 channels x size"),
}
MISMATCHED_PIXELS["qwen2_5_vl"] = MISMATCHED_PIXELS["qwen2_vl"]


@pytest.mark.parametrize("fixture", ALL, ids=fixture_id)
def test_an_encoder_sized_for_other_pixels_than_the_config_makes_is_refused_at_load(fixture, tmp_path):
    """Qwen2-VL's patch rows of 3 x temporal_patch_size x patch_size² values (a square of the
    config's size elsewhere) against an encoder that declares another static size: the first
    request failed inside onnxruntime; now the load does, naming both."""
    edit, declared, fed, source = MISMATCHED_PIXELS[fixture.name]
    folder = _copy(fixture, tmp_path)
    file = folder / "preprocessor_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **edit}))
    with pytest.raises(ModelError) as refused:
        make_runtime(folder)
    assert str(refused.value) == (f"{folder / 'onnx' / 'vision_encoder.onnx'}: vision_encoder graph declares input "
                                  f"'pixel_values' of shape [{declared}] but the model's family feeds [{fed}] "
                                  f"(preprocessor_config.json: {source})")


# ---- the int8 variant -------------------------------------------------------------------------

@pytest.mark.parametrize("which", INT8_CASES, ids=case_id)
def test_int8_variant_runs_through_the_same_family_path(which):
    """The *_int8.onnx graphs (tools/quantize.py on the folder) load by suffix and take
    exactly the inputs fp32 takes; their QDQ nodes are really in the graphs."""
    fixture, i = which
    case = fixture.cases[i]
    for component in ("vision_encoder", "decoder_model_merged"):
        ops = {n.op_type for n in onnx.load(fixture.path / "onnx" / f"{component}_int8.onnx").graph.node}
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    int8 = make_runtime(fixture.path, model={"precision": "int8"}, cache={"max_bytes": 0})
    assert int8.precision == "int8"
    a, b = prepare(runtime_of(fixture), fixture, case), prepare(int8, fixture, case)
    assert b.prompt.input_ids.tolist() == a.prompt.input_ids.tolist()
    np.testing.assert_array_equal(b.pixel_values, a.pixel_values)
    result = answer(int8, fixture, case, max_new_tokens=4)
    assert result.precision == "int8" and 1 <= len(result.tokens) <= 4
    assert result.image_tokens == fixture.image_tokens(case)


@pytest.mark.parametrize("fixture", [f for f in ALL if f.fake_tensorrt], ids=fixture_id)
def test_int8_engines_build_and_answer_as_onnxruntime_through_the_fake_tensorrt(fixture, monkeypatch, tmp_path):
    """TensorRT cannot run here: tests/support/fake_tensorrt.py builds the three int8 graphs from the
    profiles edgemm derives from their named dimensions, and its plans compute what ONNX Runtime
    computes. Every component placed on the GPU answers like the CPU, case by case."""
    from tests.support import trt_harness as h
    h.install(monkeypatch, "10.3.0")
    h.build(tmp_path, "gpu", model_dir=fixture.path)
    on_gpu = h.runtime(tmp_path, model_dir=fixture.path)
    assert on_gpu.devices == {"vision_encoder": "gpu", "embed_tokens": "gpu", "decoder": "gpu"}
    on_cpu = make_runtime(fixture.path, model={"precision": "int8"}, cache={"max_bytes": 0})
    for case in fixture.cases:
        a = answer(on_gpu, fixture, case, max_new_tokens=8)
        b = answer(on_cpu, fixture, case, max_new_tokens=8)
        assert a.devices == {"encode": "gpu", "decode": "gpu"} and a.tokens == b.tokens


# ---- the reference itself ---------------------------------------------------------------------

def _importable(names: tuple[str, ...]) -> bool:
    try:
        for name in names:
            importlib.import_module(name)
    except Exception:  # not installed, or installed against another torch
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ALL, ids=fixture_id)
def test_regenerated_reference_is_the_committed_one(fixture, tmp_path):
    if importlib.util.find_spec("transformers") is None or not _importable(fixture.tool_imports):
        pytest.skip(f"needs the fixture extra {' and '.join(fixture.tool_imports)}".rstrip())
    subprocess.run(maker_command(fixture, "--out", str(tmp_path)), check=True, capture_output=True, cwd=ROOT)
    fresh = json.loads((tmp_path / "reference.json").read_text())
    assert [(c["input_ids"], c["tokens"]) for c in fresh["cases"]] == \
        [(c["input_ids"], c["tokens"]) for c in fixture.cases]
