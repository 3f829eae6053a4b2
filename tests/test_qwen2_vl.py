"""The Qwen2-VL / Qwen2.5-VL family against its reference implementation, transformers.

tests/fixtures/qwen2-vl-tiny and qwen2.5-vl-tiny are tiny random models exported to the
Hugging Face ONNX layout (vision encoder with its grid as a real input, decoder with
[3, B, S] M-RoPE positions), with what transformers' processor, vision tower and greedy
`generate` gave for six cases each (tools/make_qwen2vl_fixture.py). Neither torch nor
transformers is needed here, except by the slow test that regenerates the fixtures.
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
import onnxruntime as ort
import pytest

from edgemm.backends.base import TensorSpec
from edgemm.config import load_config
from edgemm.errors import InputError, ModelError
from edgemm.generate import GenerationOptions
from edgemm.model.contract import check_component
from edgemm.model.families.qwen2_vl import most_image_tokens, rope_positions, smart_resize
from edgemm.model.family import GraphInputs
from edgemm.model.manifest import load_manifest
from edgemm.pipeline import Pipeline, Request
from edgemm.runtime import Runtime

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAMILIES = {"qwen2_vl": FIXTURES / "qwen2-vl-tiny", "qwen2_5_vl": FIXTURES / "qwen2.5-vl-tiny"}
GRID_INPUT = {"qwen2_vl": "grid_thw", "qwen2_5_vl": "image_grid_thw"}
REFERENCE = {family: json.loads((path / "reference.json").read_text()) for family, path in FAMILIES.items()}
CASES = [(family, i) for family in FAMILIES for i in range(len(REFERENCE[family]["cases"]))]


def case_id(value) -> str:
    family, i = value
    case = REFERENCE[family]["cases"][i]
    return f"{family}-{i}-{case['image'][:-4]}-{case['budget_tokens']}"


def make_runtime(path: Path, **sections) -> Runtime:
    cfg = {"model": {"path": str(path)}, "backend": {"intra_op_threads": 1, "warmup": False}}
    for key, values in sections.items():
        cfg[key] = {**cfg.get(key, {}), **values}
    return Runtime(load_config(cfg))


_RUNTIMES: dict[str, Runtime] = {}


def runtime_of(family: str) -> Runtime:
    """One runtime per family without the feature cache, shared by the tests that only read."""
    if family not in _RUNTIMES:
        _RUNTIMES[family] = make_runtime(FAMILIES[family], cache={"max_bytes": 0})
    return _RUNTIMES[family]


def tier(case: dict) -> str:
    return f"{case['budget_tokens']}x28x28"


def max_new(family: str) -> int:
    return REFERENCE[family]["max_new_tokens"]


# ---- token-exact conformance ------------------------------------------------------------------

@pytest.mark.parametrize("which", CASES, ids=case_id)
def test_processor_outputs_equal_the_reference(which):
    family, i = which
    case, rt = REFERENCE[family]["cases"][i], runtime_of(family)
    request = rt.prepare(FAMILIES[family] / case["image"], case["prompt"], tier=tier(case))
    assert request.prompt.input_ids[0].tolist() == case["input_ids"]
    _, h, w = case["image_grid_thw"]
    assert request.pixel_values.shape == (1, h // 2, w // 2, 4, 1176)  # the grid is in the shape
    feeds = rt.adapter.encoder_feeds(request.pixel_values)
    assert feeds[GRID_INPUT[family]].tolist() == [case["image_grid_thw"]]
    expected = np.load(FAMILIES[family] / "reference_arrays.npz")[f"case{i}_pixels"]
    np.testing.assert_allclose(feeds["pixel_values"], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("which", CASES, ids=case_id)
def test_greedy_tokens_equal_transformers_generate(which):
    family, i = which
    case = REFERENCE[family]["cases"][i]
    result = runtime_of(family).infer(FAMILIES[family] / case["image"], case["prompt"], tier=tier(case),
                                      max_new_tokens=max_new(family))
    assert result.tokens == case["tokens"]
    assert result.finish_reason == case["finish_reason"]
    _, h, w = case["image_grid_thw"]
    assert result.image_tokens == h * w // 4 and result.prompt_tokens == len(case["input_ids"])


def test_fixture_covers_the_cases_the_issue_names():
    for family, reference in REFERENCE.items():
        cases = reference["cases"]
        shapes = {c["image"] for c in cases}
        assert {"square.png", "wide.png", "tall.png"} <= shapes
        assert len({c["budget_tokens"] for c in cases}) >= 2
        # a second question on an image already asked about, at the same budget
        asked = [(c["image"], c["budget_tokens"]) for c in cases]
        assert len(asked) > len(set(asked))
        assert list(reference["trace_grid"][1:]) not in [c["image_grid_thw"][1:] for c in cases]


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_encoder_takes_any_grid(family):
    """The trap: a traced export freezes the grid. This one was traced on another grid than any
    case's; the wide and tall cases have the same patch count and different grids, and each
    gets the features of transformers' own vision tower."""
    path = FAMILIES[family]
    arrays = np.load(path / "reference_arrays.npz")
    session = ort.InferenceSession(str(path / "onnx" / "vision_encoder.onnx"), providers=["CPUExecutionProvider"])
    cases = REFERENCE[family]["cases"]
    wide, tall = (next(i for i, c in enumerate(cases) if c["image"] == name and c["budget_tokens"] == 64)
                  for name in ("wide.png", "tall.png"))
    assert cases[wide]["image_grid_thw"][1:] == cases[tall]["image_grid_thw"][:0:-1]
    got = {}
    for i in range(len(cases)):
        grid = np.array([cases[i]["image_grid_thw"]], np.int64)
        got[i] = session.run(None, {"pixel_values": arrays[f"case{i}_pixels"], GRID_INPUT[family]: grid})[0]
        np.testing.assert_allclose(got[i], arrays[f"case{i}_features"], rtol=0, atol=1e-4)
    # the same patches read with the other grid are other features: the grid is really used
    swapped = session.run(None, {"pixel_values": arrays[f"case{wide}_pixels"],
                                 GRID_INPUT[family]: np.array([cases[tall]["image_grid_thw"]], np.int64)})[0]
    assert np.abs(swapped - got[wide]).max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_second_question_on_a_cached_image_reuses_its_prefix(family):
    rt = make_runtime(FAMILIES[family])
    cases = REFERENCE[family]["cases"]
    first, second = cases[0], cases[5]
    assert (first["image"], first["budget_tokens"]) == (second["image"], second["budget_tokens"])
    a = rt.infer(FAMILIES[family] / first["image"], first["prompt"], tier=tier(first), max_new_tokens=max_new(family))
    b = rt.infer(FAMILIES[family] / second["image"], second["prompt"], tier=tier(second),
                 max_new_tokens=max_new(family))
    assert (a.tokens, b.tokens) == (first["tokens"], second["tokens"])
    assert b.prefix_reused and not a.prefix_reused
    assert rt.cache.stats().hits >= 2  # the features and the prefix


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_four_gives_each_request_its_own_tokens(family):
    """Four different requests (three shapes, two budgets, so four prompt lengths and rope
    deltas) decode together: each row's positions are padded and offset per row."""
    rt, cases = runtime_of(family), REFERENCE[family]["cases"][:4]
    assert len({len(c["input_ids"]) for c in cases}) == 4
    requests = [rt.prepare(FAMILIES[family] / c["image"], c["prompt"], tier=tier(c), max_new_tokens=max_new(family))
                for c in cases]
    assert len({r.prompt.rope_delta for r in requests}) > 1
    results = rt.decode_batch(requests, [rt.encode(r.pixel_values) for r in requests])
    assert [r.tokens for r in results] == [c["tokens"] for c in cases]
    assert all(r.decode_batch == 4 for r in results)


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_joining_a_running_batch_get_their_own_tokens(family):
    rt, cases = runtime_of(family), REFERENCE[family]["cases"]
    order = [1, 4, 3]
    requests = {i: rt.prepare(FAMILIES[family] / cases[i]["image"], cases[i]["prompt"], tier=tier(cases[i]),
                              max_new_tokens=max_new(family)) for i in order}
    done: dict = {}
    batch = rt.open_batch(None, done.__setitem__)
    batch.join([(1, requests[1], rt.encode(requests[1].pixel_values), None, None)])
    for _ in range(3):
        batch.step()
    batch.join([(i, requests[i], rt.encode(requests[i].pixel_values), None, None) for i in order[1:]])
    batch.run_to_end()
    assert {i: r.tokens for i, r in done.items()} == {i: cases[i]["tokens"] for i in order}


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_rows_keep_their_positions(family):
    """A beam search's rows are reordered every step: alone or next to other requests, and
    greedy once the gate collapses it at once, it gives the same tokens."""
    rt, cases = runtime_of(family), REFERENCE[family]["cases"]
    beams = dict(num_beams=3, beam_gate=1.0, max_new_tokens=6)
    alone = rt.infer(FAMILIES[family] / cases[1]["image"], cases[1]["prompt"], tier=tier(cases[1]), **beams)
    requests = [rt.prepare(FAMILIES[family] / c["image"], c["prompt"], tier=tier(c), **options) for c, options in
                ((cases[1], beams), (cases[0], dict(max_new_tokens=max_new(family))))]
    together = rt.decode_batch(requests, [rt.encode(r.pixel_values) for r in requests])
    assert together[0].tokens == alone.tokens and together[1].tokens == cases[0]["tokens"]
    collapsed = rt.infer(FAMILIES[family] / cases[1]["image"], cases[1]["prompt"], tier=tier(cases[1]),
                         num_beams=3, beam_gate=0.0, max_new_tokens=max_new(family))
    assert collapsed.tokens == cases[1]["tokens"]


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_variant_runs_through_the_same_family_path(family):
    """The *_int8.onnx graphs (tools/quantize.py on this folder) load by suffix, take the same
    pixels, grid and positions, and have QDQ nodes."""
    path = FAMILIES[family]
    for component in ("vision_encoder", "decoder_model_merged"):
        ops = {n.op_type for n in onnx.load(path / "onnx" / f"{component}_int8.onnx").graph.node}
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    int8 = make_runtime(path, model={"precision": "int8"}, cache={"max_bytes": 0})
    for case in REFERENCE[family]["cases"][1:4]:  # two grids of one patch count, and another budget
        result = int8.infer(path / case["image"], case["prompt"], tier=tier(case), max_new_tokens=4)
        _, h, w = case["image_grid_thw"]
        assert result.precision == "int8" and result.image_tokens == h * w // 4 and 1 <= len(result.tokens) <= 4


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_batches_by_grid_and_answers_every_case(family):
    """The path `edgemm serve` and `stream` take: images of one grid share an encoder call,
    others wait for the next (the pixel shape is the grid), decoding is continuous."""
    rt = make_runtime(FAMILIES[family], cache={"max_bytes": 0})
    cases = REFERENCE[family]["cases"]
    with Pipeline(rt, queue_size=8, max_batch=4, batch_timeout_ms=20) as pipeline:
        futures = [pipeline.submit(Request(FAMILIES[family] / c["image"], c["prompt"],
                                           {"tier": tier(c), "max_new_tokens": max_new(family)})) for c in cases]
        results = [f.result(timeout=120) for f in futures]
    assert [r.tokens for r in results] == [c["tokens"] for c in cases]
    assert pipeline.stats.failed == 0


# ---- the family's parts -----------------------------------------------------------------------

def test_tiers_are_pixel_budgets_from_the_folder():
    manifest = load_manifest(FAMILIES["qwen2_vl"])
    assert manifest.family == "qwen2_vl" and load_manifest(FAMILIES["qwen2_5_vl"]).family == "qwen2_vl"
    assert list(manifest.tiers) == ["16x28x28", "32x28x28", "64x28x28"] and manifest.default_tier == "64x28x28"
    assert [t.image_tokens for t in manifest.tiers.values()] == [16, 32, 64]


@pytest.mark.parametrize("size, budget, expected", [
    ((301, 297), 64, (224, 196)),  # shrunk under the budget, multiples of 28
    ((157, 419), 16, (56, 168)),
    ((20, 20), 64, (56, 56)),  # grown to min_pixels
    ((28, 28 * 150), 64, (28, 2716)),  # long and thin: one unit high, the width what the budget leaves
])
def test_smart_resize(size, budget, expected):
    assert smart_resize(*size, 28, 4 * 28 * 28, budget * 28 * 28) == expected


@pytest.mark.parametrize("min_pixels", [4 * 28 * 28, 16 * 28 * 28])
def test_most_image_tokens_bounds_every_aspect_and_is_reached(min_pixels):
    """Over small images (grown to min_pixels, rounded up) and large ones (shrunk, the short side
    held at one unit) of every aspect ratio up to 200:1: never more, and as many are reached."""
    cfg = {"patch_size": 14, "merge_size": 2, "min_pixels": min_pixels}
    sizes = [(h, w) for h in range(1, 21) for w in range(h, 200 * h + 1)]
    sizes += [(h, round(h * r)) for h in range(100, 3000, 271) for r in (1, 1.7, 4, 16.5, 64, 150, 199.99, 200)]
    for budget in (16, 64):
        seen = max((a // 28) * (b // 28) for a, b in
                   (smart_resize(h, w, 28, min(min_pixels, budget * 784), budget * 784) for h, w in sizes))
        assert seen == most_image_tokens(cfg, budget) > budget
    assert most_image_tokens({**cfg, "min_pixels": 4 * 784}, 64) == 113  # 25x5000 px at the 64-token budget


def test_smart_resize_refuses_extreme_aspect_ratios():
    with pytest.raises(InputError, match="aspect ratio"):
        smart_resize(10, 2010, 28, 3136, 64 * 784)


def test_a_request_with_an_extreme_image_is_refused_before_the_encoder():
    rt = runtime_of("qwen2_vl")
    with pytest.raises(InputError, match="aspect ratios up to 200:1"):
        rt.prepare(np.zeros((2, 500, 3), np.uint8), "What is in the image?")
    one_pixel = rt.infer(np.zeros((1, 1, 3), np.uint8), "What is in the image?", max_new_tokens=1)
    assert one_pixel.image_tokens == 4  # grown to min_pixels (56x56), as transformers does


def test_rope_positions_as_get_rope_index():
    """Text, then a 2x3 image (merged tokens), then text: transformers' get_rope_index."""
    image = 9
    ids = np.array([[1, 2, *([image] * 6), 3, 4]])
    positions, delta = rope_positions(ids, image, 2, 3)
    assert positions[:, 0].tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
                                        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                                        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]
    assert delta == 6 + 1 - 10


def test_prompt_with_a_vision_token_is_refused():
    rt = runtime_of("qwen2_vl")
    with pytest.raises(InputError, match="vision token"):
        rt.adapter.build_prompt("look <|image_pad|>", rt.manifest.tiers["16x28x28"], (100, 100))


# ---- graphs the family cannot feed ------------------------------------------------------------

@pytest.fixture
def broken(tmp_path) -> Path:
    return Path(shutil.copytree(FAMILIES["qwen2_vl"], tmp_path / "qwen2-vl"))


def test_encoder_without_the_grid_input_is_refused(broken):
    """An export that dropped the grid (the traced trap) declares pixel_values alone."""
    shutil.copy(FIXTURES / "idefics3-tiny" / "onnx" / "vision_encoder.onnx", broken / "onnx" / "vision_encoder.onnx")
    with pytest.raises(ModelError, match="lacks input 'grid_thw'.*family feeds it"):
        make_runtime(broken)


def test_decoder_with_one_dimensional_positions_is_refused(broken):
    shutil.copy(FIXTURES / "idefics3-tiny" / "onnx" / "decoder_model_merged.onnx",
                broken / "onnx" / "decoder_model_merged.onnx")
    with pytest.raises(ModelError, match=r"'position_ids' of shape \[batch_size, sequence_length\].*\[3, batch"):
        make_runtime(broken)


class _Graph:
    def __init__(self, inputs: dict[str, tuple], outputs: tuple[str, ...]):
        self.inputs = {name: TensorSpec(name, np.dtype(np.int64), shape) for name, shape in inputs.items()}
        self.outputs = dict.fromkeys(outputs)


def _frozen_copy(folder: Path, grid: list[int]) -> None:
    """The trap, made by hand: the encoder declares its grid but computes with `grid` (a constant)."""
    path = folder / "onnx" / "vision_encoder.onnx"
    model = onnx.load(path)
    frozen = onnx.helper.make_node("Constant", [], ["frozen_grid"],
                                   value=onnx.numpy_helper.from_array(np.array([grid], np.int64)))
    for node in model.graph.node:
        node.input[:] = ["frozen_grid" if n == "grid_thw" else n for n in node.input]
    model.graph.node.insert(0, frozen)
    onnx.save(model, path)


def test_check_grid_export_tells_a_frozen_grid_from_a_real_input(broken, tmp_path):
    tool = [sys.executable, str(Path(__file__).resolve().parent.parent / "tools" / "check_grid_export.py")]
    for family, path in FAMILIES.items():
        run = subprocess.run([*tool, str(path), "--precision", "int8"], capture_output=True, text=True)
        assert run.returncode == 0 and "the grid is an input" in run.stdout, run.stdout + run.stderr
    _frozen_copy(broken, [1, 16, 8])  # frozen at one of the two grids the tool tries
    run = subprocess.run([*tool, str(broken)], capture_output=True, text=True)
    assert run.returncode == 1 and "the grid is FROZEN: grids [1, 16, 8] and [1, 8, 16] give the same" in run.stdout
    # why it matters: frozen at the tall case's grid, the wide case (same patch count) loads, runs
    # without an error and answers other tokens; names alone cannot show the trap
    tall_grid = shutil.copytree(FAMILIES["qwen2_vl"], tmp_path / "frozen-tall")
    _frozen_copy(tall_grid, [1, 26, 8])
    case = REFERENCE["qwen2_vl"]["cases"][1]  # wide: 8x26
    frozen = make_runtime(tall_grid, cache={"max_bytes": 0})
    assert frozen.infer(tall_grid / case["image"], case["prompt"], tier=tier(case),
                        max_new_tokens=max_new("qwen2_vl")).tokens != case["tokens"]
    assert subprocess.run([*tool, str(tall_grid)], capture_output=True).returncode == 1


def test_contract_names_what_no_family_feeds():
    encoder = _Graph({"pixel_values": ("n", 1176), "grid_thw": ("i", 3)}, ("image_features",))
    check_component("vision_encoder", encoder, "enc.onnx", GraphInputs(encoder=("grid_thw",), position_axes=3))
    with pytest.raises(ModelError, match="inputs the runtime does not know how to feed: grid_thw"):
        check_component("vision_encoder", encoder, "enc.onnx")  # a family that feeds no grid
    kv = {f"past_key_values.0.{k}": ("b", 2, "p", 16) for k in ("key", "value")}
    decoder = _Graph({"inputs_embeds": ("b", "s", 64), "attention_mask": ("b", "t"),
                      "position_ids": (3, "b", "s"), **kv}, ("logits", "present.0.key", "present.0.value"))
    check_component("decoder", decoder, "dec.onnx", GraphInputs(position_axes=3))
    with pytest.raises(ModelError, match=r"'position_ids' of shape \[3, b, s\] but the model's family feeds \[batch"):
        check_component("decoder", decoder, "dec.onnx")


def test_a_flat_config_as_published_gives_its_context(broken):
    """Qwen2-VL-2B-Instruct's config.json has the text model's keys at the top, no text_config."""
    config = json.loads((broken / "config.json").read_text())
    text = config.pop("text_config")
    (broken / "config.json").write_text(json.dumps({**text, **config, "max_position_embeddings": 777}))
    assert load_manifest(broken).max_context == 777


def test_unknown_model_type_lists_the_known_families(broken):
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "qwen9_vl"}))
    with pytest.raises(ModelError, match=r"unknown model_type 'qwen9_vl' \(known: .*qwen2_5_vl.*qwen2_vl") as e:
        load_manifest(broken)
    assert "\n" not in str(e.value)


def test_the_options_a_request_takes_are_the_usual_ones():
    rt = runtime_of("qwen2_5_vl")
    request = rt.prepare(FAMILIES["qwen2_5_vl"] / "wide.png", "hi", max_new_tokens=3, temperature=0.7, seed=5)
    assert request.options == GenerationOptions(max_new_tokens=3, temperature=0.7, seed=5)
    first = rt.answer(request)
    assert rt.answer(request).tokens == first.tokens and len(first.tokens) <= 3  # seeded sampling repeats


# ---- the reference itself ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the fixture extra")
@pytest.mark.parametrize("family", FAMILIES)
def test_regenerated_reference_is_the_committed_one(tmp_path, family):
    tool = Path(__file__).resolve().parent.parent / "tools" / "make_qwen2vl_fixture.py"
    subprocess.run([sys.executable, str(tool), "--family", family, "--out", str(tmp_path)], check=True,
                   capture_output=True)
    fresh = json.loads((tmp_path / "reference.json").read_text())
    assert [(c["input_ids"], c["tokens"]) for c in fresh["cases"]] == \
        [(c["input_ids"], c["tokens"]) for c in REFERENCE[family]["cases"]]
