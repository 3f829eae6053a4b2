"""The Qwen2-VL / Qwen2.5-VL family: what is its own.

tests/fixtures/qwen2-vl-tiny and qwen2.5-vl-tiny are tiny random models exported to the
Hugging Face ONNX layout (vision encoder with its grid as a real input, decoder with
[3, B, S] M-RoPE positions), with what transformers' processor, vision tower and greedy
`generate` gave for six cases each (tests/fixtures/make/make_qwen2vl_fixture.py). The cases every family
passes against that reference are tests/test_family_conformance.py's.
"""
from __future__ import annotations

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
from edgemm.errors import InputError, ModelError
from edgemm.engine.generate import GenerationOptions
from edgemm.engine.contract import check_component
from edgemm.model.families.qwen2_vl import most_image_tokens, rope_positions, smart_resize
from edgemm.model.family import GraphInputs
from edgemm.model.manifest import load_manifest
from tests.support.family_conformance import FIXTURES, QWEN2_5_VL, QWEN2_VL, TOOLS, answer, make_runtime, prepare, runtime_of

QWEN = [QWEN2_VL, QWEN2_5_VL]
BOTH = pytest.mark.parametrize("family", QWEN, ids=lambda f: f.name)


# ---- the fixtures, grids and batches ----------------------------------------------------------

def test_fixture_covers_the_cases_the_issue_names():
    for family in QWEN:
        reference, cases = family.reference, family.cases
        shapes = {c["image"] for c in cases}
        assert {"square.png", "wide.png", "tall.png"} <= shapes
        assert len({c["budget_tokens"] for c in cases}) >= 2
        # a second question on an image already asked about, at the same budget
        asked = [(c["image"], c["budget_tokens"]) for c in cases]
        assert len(asked) > len(set(asked))
        assert list(reference["trace_grid"][1:]) not in [c["image_grid_thw"][1:] for c in cases]


@BOTH
def test_vision_encoder_takes_any_grid(family):
    """The trap: a traced export freezes the grid. This one was traced on another grid than any
    case's; the wide and tall cases have the same patch count and different grids, and each
    gets the features of transformers' own vision tower."""
    path = family.path
    arrays = np.load(path / "reference_arrays.npz")
    session = ort.InferenceSession(str(path / "onnx" / "vision_encoder.onnx"), providers=["CPUExecutionProvider"])
    cases = family.cases
    wide, tall = (next(i for i, c in enumerate(cases) if c["image"] == name and c["budget_tokens"] == 64)
                  for name in ("wide.png", "tall.png"))
    assert cases[wide]["image_grid_thw"][1:] == cases[tall]["image_grid_thw"][:0:-1]
    got = {}
    for i in range(len(cases)):
        grid = np.array([cases[i]["image_grid_thw"]], np.int64)
        got[i] = session.run(None, {"pixel_values": arrays[f"case{i}_pixels"], family.grid_input: grid})[0]
        np.testing.assert_allclose(got[i], arrays[f"case{i}_features"], rtol=0, atol=1e-4)
    # the same patches read with the other grid are other features: the grid is really used
    swapped = session.run(None, {"pixel_values": arrays[f"case{wide}_pixels"],
                                 family.grid_input: np.array([cases[tall]["image_grid_thw"]], np.int64)})[0]
    assert np.abs(swapped - got[wide]).max() > 1e-2


@BOTH
def test_requests_joining_a_running_batch_get_their_own_tokens(family):
    rt, cases = runtime_of(family), family.cases
    order = [1, 4, 3]
    requests = {i: prepare(rt, family, cases[i], max_new_tokens=family.max_new_tokens) for i in order}
    done: dict = {}
    batch = rt.open_batch(None, done.__setitem__)
    batch.join([(1, requests[1], rt.encode(requests[1].pixel_values), None, None)])
    for _ in range(3):
        batch.step()
    batch.join([(i, requests[i], rt.encode(requests[i].pixel_values), None, None) for i in order[1:]])
    batch.run_to_end()
    assert {i: r.tokens for i, r in done.items()} == {i: cases[i]["tokens"] for i in order}


@BOTH
def test_beam_search_rows_keep_their_positions(family):
    """A beam search's rows are reordered every step: alone or next to other requests, and
    greedy once the gate collapses it at once, it gives the same tokens."""
    rt, cases = runtime_of(family), family.cases
    beams = dict(num_beams=3, beam_gate=1.0, max_new_tokens=6)
    alone = answer(rt, family, cases[1], **beams)
    requests = [prepare(rt, family, c, **options) for c, options in
                ((cases[1], beams), (cases[0], dict(max_new_tokens=family.max_new_tokens)))]
    together = rt.decode_batch(requests, [rt.encode(r.pixel_values) for r in requests])
    assert together[0].tokens == alone.tokens and together[1].tokens == cases[0]["tokens"]
    collapsed = answer(rt, family, cases[1], num_beams=3, beam_gate=0.0)
    assert collapsed.tokens == cases[1]["tokens"]


# ---- the family's parts -----------------------------------------------------------------------


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
    rt = runtime_of(QWEN2_VL)
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
    rt = runtime_of(QWEN2_VL)
    with pytest.raises(InputError, match="vision token"):
        rt.adapter.build_prompt("look <|image_pad|>", rt.manifest.tiers["16x28x28"], (100, 100))


# ---- graphs the family cannot feed ------------------------------------------------------------

@pytest.fixture
def broken(tmp_path) -> Path:
    return Path(shutil.copytree(QWEN2_VL.path, tmp_path / "qwen2-vl"))


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
    tool = [sys.executable, str(TOOLS / "dev" / "check_grid_export.py")]
    for family in QWEN:
        run = subprocess.run([*tool, str(family.path), "--precision", "int8"], capture_output=True, text=True)
        assert run.returncode == 0 and "the grid is an input" in run.stdout, run.stdout + run.stderr
    _frozen_copy(broken, [1, 16, 8])  # frozen at one of the two grids the tool tries
    run = subprocess.run([*tool, str(broken)], capture_output=True, text=True)
    assert run.returncode == 1 and "the grid is FROZEN: grids [1, 16, 8] and [1, 8, 16] give the same" in run.stdout
    # why it matters: frozen at the tall case's grid, the wide case (same patch count) loads, runs
    # without an error and answers other tokens; names alone cannot show the trap
    tall_grid = shutil.copytree(QWEN2_VL.path, tmp_path / "frozen-tall")
    _frozen_copy(tall_grid, [1, 26, 8])
    case = QWEN2_VL.cases[1]  # wide: 8x26
    frozen = make_runtime(tall_grid, cache={"max_bytes": 0})
    assert frozen.infer(tall_grid / case["image"], case["prompt"], tier=QWEN2_VL.tier_of(case),
                        max_new_tokens=QWEN2_VL.max_new_tokens).tokens != case["tokens"]
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
    """Qwen2-VL-2B-Instruct's config.json (and so the fixture's) has the text model's keys at the
    top, no text_config; transformers 5 saves them nested, and then those count."""
    config = json.loads((broken / "config.json").read_text())
    assert "text_config" not in config and config["num_hidden_layers"] == 2
    (broken / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 777}))
    assert load_manifest(broken).max_context == 777
    nested = {**config, "text_config": {"max_position_embeddings": 778}}
    (broken / "config.json").write_text(json.dumps(nested))
    assert load_manifest(broken).max_context == 778


def test_the_options_a_request_takes_are_the_usual_ones():
    rt = runtime_of(QWEN2_5_VL)
    request = rt.prepare(QWEN2_5_VL.path / "wide.png", "hi", max_new_tokens=3, temperature=0.7, seed=5)
    assert request.options == GenerationOptions(max_new_tokens=3, temperature=0.7, seed=5)
    first = rt.answer(request)
    assert rt.answer(request).tokens == first.tokens and len(first.tokens) <= 3  # seeded sampling repeats
