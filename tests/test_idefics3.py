"""The idefics3 family (SmolVLM): what is its own.

tests/fixtures/idefics3-tiny is a tiny random Idefics3ForConditionalGeneration exported
to the Hugging Face ONNX layout, with what transformers' processor and greedy `generate`
gave for a few images and prompts (tests/fixtures/make/make_idefics3_fixture.py). The cases every family
passes against that reference are tests/test_family_conformance.py's.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgemm.backends.base import TensorSpec
from edgemm.errors import InputError, ModelError
from edgemm.engine.generate import Generator
from edgemm.model.families.idefics3 import expand_image
from edgemm.model.resample import resize_lanczos
from edgemm.model.tiling import tile_layout
from edgemm.engine.runtime import Runtime
from tests.support.family_conformance import IDEFICS3, make_runtime, runtime_of

FIXTURE = IDEFICS3.path
CASES = IDEFICS3.cases


@pytest.fixture
def runtime() -> Runtime:
    return runtime_of(IDEFICS3)


# ---- the fixture --------------------------------------------------------------------------------

def test_fixture_has_a_stop_case_and_a_split_case():
    assert {c["finish_reason"] for c in CASES} == {"stop", "length"}
    assert max(c["tiles"] for c in CASES) > 1 and min(c["tiles"] for c in CASES) == 1


# ---- tiling and prompt expansion --------------------------------------------------------------

@pytest.mark.parametrize("size, longest_edge, grid", [
    ((120, 160), 96, (3, 3)),  # wide: 72x96 rounds up to 96x96
    ((150, 64), 96, (3, 2)),  # tall: 96x40 → 96x64
    ((150, 64), 64, (2, 1)),
    ((120, 160), 32, (0, 0)),  # one tile: the global image only
    ((2000, 100), 96, (3, 1)),
])
def test_tile_layout(size, longest_edge, grid):
    layout = tile_layout(*size, longest_edge, 32)
    assert (layout.rows, layout.cols) == grid
    assert layout.tiles == (grid[0] * grid[1] + 1 if grid[0] else 1)


def test_expand_image_as_idefics3_processor():
    img = "<image>" * 2
    assert expand_image(0, 0, 2) == f"<fake_token_around_image><global-img>{img}<fake_token_around_image>"
    assert expand_image(1, 2, 2) == (
        f"<fake_token_around_image><row_1_col_1>{img}<fake_token_around_image><row_1_col_2>{img}\n"
        f"\n<fake_token_around_image><global-img>{img}<fake_token_around_image>")


def test_image_positions_are_every_placeholder_in_order(runtime):
    prompt = runtime.adapter.build_prompt("hi", runtime.manifest.tiers["2x2"], (64, 64))
    ids = prompt.input_ids[0]
    assert len(prompt.image_positions) == 5 * 16 and np.all(ids[prompt.image_positions] == runtime.adapter.image_id)
    assert np.all(np.diff(prompt.image_positions) > 0)  # runs per tile, separated by tile tags


def test_prompt_with_the_image_token_is_refused(runtime):
    with pytest.raises(InputError, match="image token"):
        runtime.adapter.build_prompt("look <image>", runtime.manifest.tiers["global"], (32, 32))


def test_lanczos_is_bit_exact_with_pillow():
    if int(pytest.importorskip("PIL").__version__.split(".")[0]) >= 13:
        pytest.skip("Pillow 13 orders its two resize passes differently")
    from PIL import Image as pil
    rng = np.random.default_rng(0)
    for _ in range(20):
        h, w, out_h, out_w = (int(v) for v in rng.integers(1, 120, 4))
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        expected = np.asarray(pil.fromarray(rgb).resize((out_w, out_h), pil.LANCZOS))
        assert np.array_equal(resize_lanczos(rgb, out_h, out_w), expected), (h, w, out_h, out_w)


# ---- the folder: tiers, graphs ----------------------------------------------------------------

def test_scheduler_works_with_tiling_tiers():
    rt = make_runtime(FIXTURE, scheduler={"policy": "thresholds", "statistic": "edge_density",
                                          "thresholds": [0.0, 2.0]})
    assert rt.scheduler.tiers == ["global", "2x2", "3x3"]
    assert rt.infer(FIXTURE / "wide.png", "What is this?", max_new_tokens=2).tier == "2x2"


@pytest.fixture
def broken(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "idefics3"))


def test_missing_precision_variant_is_named(broken):
    (broken / "onnx" / "vision_encoder_int8.onnx").unlink()
    with pytest.raises(ModelError, match="has no int8 graph"):
        make_runtime(broken, model={"precision": "int8"})


def test_graph_with_a_wrong_tensor_name_is_refused(broken):
    path = broken / "onnx" / "vision_encoder.onnx"
    model = onnx.load(path)
    for node in model.graph.node:
        node.input[:] = ["pixels" if n == "pixel_values" else n for n in node.input]
    model.graph.input[0].name = "pixels"
    onnx.save(model, path)
    with pytest.raises(ModelError, match="lacks input 'pixel_values'"):
        make_runtime(broken)


class _Stub:
    """Just enough of a Component for Generator to read its declared tensors."""

    def __init__(self, inputs: dict[str, TensorSpec]):
        self.inputs = inputs


def test_kv_and_pixel_dtypes_come_from_the_graphs():
    f16, i32 = np.dtype(np.float16), np.dtype(np.int32)
    decoder = _Stub({"inputs_embeds": TensorSpec("inputs_embeds", f16, (1, "s", 64)),
                     "attention_mask": TensorSpec("attention_mask", i32, (1, "t")),
                     "position_ids": TensorSpec("position_ids", i32, (1, "s")),
                     **{f"past_key_values.0.{k}": TensorSpec(f"past_key_values.0.{k}", f16, ("b", 2, "p", 16))
                        for k in ("key", "value")}})
    encoder = _Stub({"pixel_values": TensorSpec("pixel_values", f16, ("b", "t", 3, 32, 32)),
                     "pixel_attention_mask": TensorSpec("pixel_attention_mask", np.dtype(bool), ("b", "t", 32, 32))})
    gen = Generator(encoder, None, decoder, 128, set())
    assert gen.empty_past(1)["past_key_values.0.key"].dtype == f16
    assert (gen.kv_dtype, gen.embed_dtype, gen.mask_dtype, gen.pixel_dtype) == (f16, f16, i32, f16)
    assert gen.pixel_mask_dtype == np.dtype(bool)
