"""transformers.js (4.3.x, pinned: tests/support/transformers_js/) runs every fixture folder it supports as it is.

The published ONNX folders are made for transformers.js: a fixture it cannot run is not in
the published layout. For each fixture it supports:

- given edgemm's pixel values and prompt ids, transformers.js's greedy tokens are edgemm's, in
  fp32 and in the folder's int8 graphs (its own image resizing differs from transformers' by up
  to 3.1 normalised units, so the pixels are transformers', which edgemm's equal);
- and in every precision variant transformers.js's own recipe makes (fp16, quantized, int8,
  uint8, q4, q4f16, bnb4: tests/fixtures/make/published_variants.py), in a copy of the folder
  laid out as onnx-community publishes it, but for two near ties (VARIANT_NEAR_TIES);
- through the folder's own processor and chat template, as a user of transformers.js runs it,
  the prompt ids are transformers' (the reference's): processor_class, the chat template's
  place and the image tokens' expansion are as transformers.js reads them.

InternVL is not among them: transformers.js 4.3.2 has no `internvl` model type.
Skipped, saying why, where node or npm is missing, unless EDGEMM_REQUIRE_TRANSFORMERS_JS is set
(as .ci/run does): then that is a failure.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from tests.support.family_conformance import FAMILIES, FamilyFixture, answer, make_runtime, prepare, runtime_of
from tests.fixtures.make.published_layout import PROCESSOR_CLASSES, publish
from tests.fixtures.make.published_variants import MODES, make_variants
from tests.support.published_folders import graphs_folder
from edgemm.model.quantization import graph_kind
from tests.support.transformers_js import harness

SUPPORTED = [FAMILIES[name] for name in ("llava", "fastvlm", "gemma3", "idefics3", "qwen2_vl", "qwen2_5_vl")]
# The int8 decoders' logits are quantized too (the QDQ recipe's DequantizeLinear is their last op),
# so two of them tie or lie one step apart. gemma3's do at a greedy choice: case 0's second token
# ties exactly (116 and 197), case 1's eighth is one step (0.055) ahead, and onnxruntime-node 1.30
# (transformers.js's) and onnxruntime 1.32 (edgemm's here) take different ones
INT8_NEAR_TIES = {"gemma3"}
INT8 = [f for f in SUPPORTED if "int8" in f.precisions and f.name not in INT8_NEAR_TIES]
# transformers.js 4.3.2's LlavaProcessor adds num_additional_image_tokens without dropping the CLS
# token for vision_feature_select_strategy "default": 17 image tokens where the encoder gives 16
# (transformers and edgemm: 16), so a LLaVA-1.5 folder fails there as published (issue 32, item 4)
PROCESSOR_MISCOUNTS = {"llava"}
AS_USER = [f for f in SUPPORTED if f.name not in PROCESSOR_MISCOUNTS]


@dataclass(frozen=True)
class NearTie:
    """Where the two runtimes take different tokens of a near tie, and which each takes."""
    case: int
    step: int  # the index of the first new token that differs
    edgemm: int
    transformers_js: int


# Both run the same graph file with the same inputs; edgemm's top two logits at `step` lie a
# fraction of float16's resolution apart there, and onnxruntime-node 1.30 (transformers.js's)
# and onnxruntime 1.32 (edgemm's here) round the float16 kernels' sums differently:
# - fastvlm fp16, case 0, the seventh token: 167 leads 132 by 0.0002 (transformers.js's 132 is
#   also fp32's token there);
# - qwen2.5-vl q4f16, case 5, the fifth token: 86 leads 12 by 0.0117, three float16 steps of
#   the logits (MatMulNBits over float16).
# Every other case of those two, and every case of the other 40 folder-variant pairs, agrees.
VARIANT_NEAR_TIES = {("fastvlm", "fp16"): NearTie(case=0, step=6, edgemm=167, transformers_js=132),
                     ("qwen2_5_vl", "q4f16"): NearTie(case=5, step=4, edgemm=86, transformers_js=12)}
# What the recipe makes of a decoder, by edgemm's reading of its operators: `_int8` and its two
# siblings are dynamic int8, as on the hub, not the committed fixtures' QDQ
DECODER_KINDS = {"fp16": "fp16", "quantized": "dynamic-int8", "int8": "dynamic-int8", "uint8": "dynamic-int8",
                 "q4": "4bit", "q4f16": "q4f16", "bnb4": "bnb4"}


@pytest.fixture(scope="module")
def transformers_js():
    try:
        harness.install()
    except harness.Unavailable as e:
        if os.environ.get("EDGEMM_REQUIRE_TRANSFORMERS_JS"):  # CI: a check that cannot run is a failure
            pytest.fail(f"transformers.js unavailable (EDGEMM_REQUIRE_TRANSFORMERS_JS is set): {e}")
        pytest.skip(f"transformers.js unavailable: {e}")
    return harness


def generate_inputs(runtime, fixture: FamilyFixture, case: dict) -> dict[str, np.ndarray]:
    """What transformers.js's generate() takes for edgemm's prepared request: its prompt ids and
    pixel values as edgemm's encoder gets them (Qwen2-VL's patches and grid; a tiled family's
    pixel_attention_mask, all ones as edgemm feeds it)."""
    prepared = prepare(runtime, fixture, case)
    ids = prepared.prompt.input_ids.astype(np.int64)
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids),
              **fixture.encoder_inputs(runtime, prepared.pixel_values)}
    if fixture.grid_input:  # transformers.js's name for either family's grid
        inputs["image_grid_thw"] = inputs.pop(fixture.grid_input)
    pixels = prepared.pixel_values
    if pixels.ndim == 5:
        inputs["pixel_attention_mask"] = np.ones(pixels.shape[:2] + pixels.shape[-2:], bool)
    return inputs


def assert_same_tokens(fixture: FamilyFixture, runtime, precision: str, transformers_js, cases: list[int],
                       folder: Path | None = None, tie: NearTie | None = None) -> None:
    """transformers.js on `folder` (the fixture's own by default) gives `runtime`'s tokens for each
    case, given its pixels and ids; at `tie`, each runtime's own token of the tie."""
    inputs = [generate_inputs(runtime, fixture, fixture.cases[i]) for i in cases]
    theirs = transformers_js.run_given(folder or fixture.path, inputs, fixture.max_new_tokens,
                                       dtype=harness.DTYPES[precision])
    for i, generated in zip(cases, theirs):
        ours = answer(runtime, fixture, fixture.cases[i])
        if tie is not None and tie.case == i:
            both = (ours.tokens[:tie.step + 1], generated.tokens[:tie.step + 1])
            assert both == (ours.tokens[:tie.step] + [tie.edgemm], ours.tokens[:tie.step] + [tie.transformers_js]), \
                f"{fixture.name} case {i} ({precision}): the near tie changed: edgemm {ours.tokens}, " \
                f"transformers.js {generated.tokens}"
            continue
        # transformers.js lists the stop token that ended its answer; edgemm's tokens leave it out
        expected_end = len(ours.tokens) + (ours.finish_reason == "stop")
        assert generated.tokens[:len(ours.tokens)] == ours.tokens and len(generated.tokens) == expected_end, \
            f"{fixture.name} case {i} ({precision}): transformers.js {generated.tokens}, edgemm {ours.tokens} " \
            f"({ours.finish_reason})"


@pytest.mark.parametrize("fixture", SUPPORTED, ids=lambda f: f.name)
def test_transformers_js_gives_edgemms_tokens_for_edgemms_pixels_and_ids(fixture, transformers_js):
    assert_same_tokens(fixture, runtime_of(fixture), "fp32", transformers_js, list(range(len(fixture.cases))))


@pytest.mark.parametrize("fixture", INT8, ids=lambda f: f.name)
def test_the_int8_graphs_give_the_same_tokens_in_both(fixture, transformers_js):
    """transformers.js's dtype "int8" takes the same *_int8.onnx files edgemm's precision int8 does."""
    int8 = make_runtime(fixture.path, model={"precision": "int8"}, cache={"max_bytes": 0})
    assert_same_tokens(fixture, int8, "int8", transformers_js, list(fixture.int8_cases))


_PUBLISHED: dict[str, Path] = {}


@pytest.fixture(scope="session")
def with_variants(tmp_path_factory):
    """A fixture folder's copy holding its fp32 graphs (not the committed `_int8`, edgemm's QDQ) and
    every variant transformers.js's recipe makes, named as onnx-community names them; made once
    per folder (about 0.3 s), when a test first asks for it."""
    def folder_of(fixture: FamilyFixture) -> Path:
        if fixture.name not in _PUBLISHED:
            copy = tmp_path_factory.mktemp("published") / fixture.path.name
            shutil.copytree(fixture.path, copy, ignore=lambda _, names: [n for n in names if n.endswith("_int8.onnx")])
            make_variants(copy)
            _PUBLISHED[fixture.name] = copy
        return _PUBLISHED[fixture.name]
    return folder_of


# The variants are compared on onnxruntime >= 1.24 only: 1.23, the newest for Python 3.10 (JetPack
# 6's), has no ConvInteger for int8 weights and fails to load the recipe's fp16 graphs (its
# SimplifiedLayerNormFusion meets the converter's casts), and its dynamic int8 kernels round
# otherwise than onnxruntime-node 1.30's. There edgemm refuses such a graph in one line (exit 2).
RECENT_ONNXRUNTIME = tuple(int(part) for part in onnxruntime.__version__.split(".")[:2]) >= (1, 24)


@pytest.mark.skipif(not RECENT_ONNXRUNTIME, reason=f"onnxruntime {onnxruntime.__version__} < 1.24: "
                    "the published variants are compared on a newer one (see RECENT_ONNXRUNTIME)")
@pytest.mark.parametrize("precision", MODES)
@pytest.mark.parametrize("fixture", SUPPORTED, ids=lambda f: f.name)
def test_every_published_variant_gives_the_same_tokens_in_both(fixture, precision, with_variants, transformers_js):
    """`--precision <variant>` in edgemm and dtype <variant> in transformers.js take the same files
    of a folder whose variants transformers.js's own recipe made; every case, one load each."""
    folder = with_variants(fixture)
    assert graph_kind(graphs_folder(folder) / f"decoder_model_merged_{precision}.onnx") == DECODER_KINDS[precision]
    runtime = make_runtime(folder, model={"precision": precision}, cache={"max_bytes": 0})
    assert runtime.precision == precision
    assert_same_tokens(fixture, runtime, precision, transformers_js, list(range(len(fixture.cases))), folder=folder,
                       tie=VARIANT_NEAR_TIES.get((fixture.name, precision)))


def own_processor_cases(fixture: FamilyFixture) -> tuple[list[dict], list[tuple]]:
    """The cases recorded with the folder's own processor settings (its largest tier), and their questions."""
    cases = [case for case in fixture.cases if fixture.tier_of(case) in (None, fixture.default_tier)]
    return cases, [(fixture.path / case["image"], case["prompt"]) for case in cases]


@pytest.mark.parametrize("fixture", AS_USER, ids=lambda f: f.name)
def test_the_folder_runs_as_published_through_its_own_processor_and_template(fixture, transformers_js):
    """No file changed, none added: transformers.js's AutoProcessor, the tokenizer's chat template,
    generate(). Its prompt ids are transformers' (the tokens are not compared: its resizing differs)."""
    cases, questions = own_processor_cases(fixture)
    answers = transformers_js.run_as_user(fixture.path, questions, max_new_tokens=2)
    assert cases and len(answers) == len(cases)
    for case, generated in zip(cases, answers):
        assert generated.input_ids == case["input_ids"], f"{fixture.name}: {case['image']} {case['prompt']!r}"
        assert 1 <= len(generated.tokens) <= 2


@pytest.mark.parametrize("fixture", [FAMILIES[name] for name in sorted(PROCESSOR_MISCOUNTS)], ids=lambda f: f.name)
def test_transformers_js_miscounts_llavas_image_tokens(fixture, transformers_js):
    """The one folder transformers.js does not run through its processor, and why; when a release
    counts as transformers does, this fails and the folder joins the test above."""
    _, questions = own_processor_cases(fixture)
    with pytest.raises(RuntimeError, match="Number of tokens and features do not match: tokens: 17, features 16"):
        transformers_js.run_as_user(fixture.path, questions[:1], max_new_tokens=2)


@pytest.mark.parametrize("fixture", FAMILIES.values(), ids=lambda f: f.name)
def test_every_fixture_is_in_the_published_layout(fixture, tmp_path):
    """What the fixture makers' last step (published_layout.publish) writes is what the folder
    holds: publishing it again changes no byte, and its two chat templates are one text."""
    names = ("config.json", "preprocessor_config.json", "tokenizer_config.json", "chat_template.jinja")
    for name in names:
        shutil.copy(fixture.path / name, tmp_path / name)
    publish(tmp_path)
    for name in names:
        assert (tmp_path / name).read_bytes() == (fixture.path / name).read_bytes(), name
    tokenizer_config = json.loads((fixture.path / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == (fixture.path / "chat_template.jinja").read_text()
    preprocessor = json.loads((fixture.path / "preprocessor_config.json").read_text())
    model_type = json.loads((fixture.path / "config.json").read_text())["model_type"]
    assert preprocessor["processor_class"] == PROCESSOR_CLASSES[model_type]
