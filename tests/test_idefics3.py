"""The idefics3 family (SmolVLM) against its reference implementation, transformers.

tests/fixtures/idefics3-tiny is a tiny random Idefics3ForConditionalGeneration exported
to the Hugging Face ONNX layout, with what transformers' processor and greedy `generate`
gave for a few images and prompts (tools/make_idefics3_fixture.py). Neither torch nor
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

from edgemm.backends.base import TensorSpec
from edgemm.config import load_config
from edgemm.errors import InputError, ModelError
from edgemm.generate import Generator
from edgemm.model.families.idefics3 import expand_image
from edgemm.model.manifest import load_manifest
from edgemm.model.resample import resize_lanczos
from edgemm.model.tiling import tile_layout
from edgemm.runtime import Runtime

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "idefics3-tiny"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
CASES = REFERENCE["cases"]


def make_runtime(path: Path = FIXTURE, **sections) -> Runtime:
    cfg = {"model": {"path": str(path)}, "backend": {"intra_op_threads": 1, "warmup": False}}
    for key, values in sections.items():
        cfg[key] = {**cfg.get(key, {}), **values}
    return Runtime(load_config(cfg))


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return make_runtime(cache={"max_bytes": 0})


def tier_of(runtime: Runtime, case: dict) -> str:
    """The fixture records the processor's size.longest_edge; tiers are named by their tiling."""
    return next(t.name for t in runtime.manifest.tiers.values() if t.height == case["longest_edge"])


# ---- token-exact conformance ------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['image']}-{c['longest_edge']}")
def test_processor_outputs_equal_the_reference(runtime, case):
    i = CASES.index(case)
    request = runtime.prepare(FIXTURE / case["image"], case["prompt"], tier=tier_of(runtime, case))
    assert request.prompt.input_ids[0].tolist() == case["input_ids"]
    expected = np.load(FIXTURE / "reference_pixels.npz")[f"case{i}"]
    assert request.pixel_values.shape == expected.shape == (1, case["tiles"], 3, 32, 32)
    np.testing.assert_allclose(request.pixel_values, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['image']}-{c['longest_edge']}")
def test_greedy_tokens_equal_transformers_generate(runtime, case):
    result = runtime.infer(FIXTURE / case["image"], case["prompt"], tier=tier_of(runtime, case),
                           max_new_tokens=REFERENCE["max_new_tokens"])
    assert result.tokens == case["tokens"]
    assert result.finish_reason == case["finish_reason"]
    assert result.image_tokens == case["tiles"] * 16 and result.prompt_tokens == len(case["input_ids"])


def test_fixture_has_a_stop_case_and_a_split_case():
    assert {c["finish_reason"] for c in CASES} == {"stop", "length"}
    assert max(c["tiles"] for c in CASES) > 1 and min(c["tiles"] for c in CASES) == 1


def test_feature_cache_and_prefix_reuse_give_the_same_tokens():
    cached = make_runtime()
    case = CASES[0]
    first = cached.infer(FIXTURE / case["image"], case["prompt"], max_new_tokens=REFERENCE["max_new_tokens"])
    again = cached.infer(FIXTURE / case["image"], case["prompt"], max_new_tokens=REFERENCE["max_new_tokens"])
    assert first.tokens == again.tokens == case["tokens"]
    assert again.prefix_reused


def test_decode_batch_gives_each_request_its_own_tokens(runtime):
    requests = [runtime.prepare(FIXTURE / c["image"], c["prompt"], tier=tier_of(runtime, c),
                                max_new_tokens=REFERENCE["max_new_tokens"]) for c in CASES]
    features = [runtime.encode(r.pixel_values) for r in requests]
    results = runtime.decode_batch(requests, features)
    assert [r.tokens for r in results] == [c["tokens"] for c in CASES]


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


# ---- folder detection and errors --------------------------------------------------------------

def test_folder_without_model_yaml_is_detected():
    manifest = load_manifest(FIXTURE)
    assert manifest.family == "idefics3" and not (FIXTURE / "model.yaml").exists()
    assert list(manifest.tiers) == ["global", "2x2", "3x3"] and manifest.default_tier == "3x3"
    assert manifest.graph_path("decoder", "fp32") == FIXTURE / "onnx" / "decoder_model_merged.onnx"
    assert manifest.precisions == ["fp32", "int8"]  # found by the files' suffixes


def test_scheduler_works_with_tiling_tiers():
    rt = make_runtime(scheduler={"policy": "thresholds", "statistic": "edge_density", "thresholds": [0.0, 2.0]})
    assert rt.scheduler.tiers == ["global", "2x2", "3x3"]
    assert rt.infer(FIXTURE / "wide.png", "What is this?", max_new_tokens=2).tier == "2x2"


@pytest.fixture
def broken(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "idefics3"))


@pytest.mark.parametrize("missing", ["preprocessor_config.json", "tokenizer.json", "onnx/embed_tokens.onnx"])
def test_missing_file_is_named(broken, missing):
    (broken / missing).unlink()
    with pytest.raises(ModelError, match=f"without {missing}"):
        load_manifest(broken)


def test_missing_precision_variant_is_named(broken):
    (broken / "onnx" / "vision_encoder_int8.onnx").unlink()
    with pytest.raises(ModelError, match="has no int8 graph"):
        make_runtime(broken, model={"precision": "int8"})


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['image']}-{c['longest_edge']}")
def test_int8_variant_runs_through_the_same_family_path(runtime, case):
    """The *_int8.onnx graphs (made by tools/quantize.py from this folder) load by suffix and
    take exactly the inputs fp32 takes; their QDQ nodes are really in the graphs."""
    int8 = make_runtime(model={"precision": "int8"}, cache={"max_bytes": 0})
    assert int8.precision == "int8"
    for component in ("vision_encoder", "decoder_model_merged"):
        ops = {n.op_type for n in onnx.load(FIXTURE / "onnx" / f"{component}_int8.onnx").graph.node}
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    tier = tier_of(runtime, case)
    a = runtime.prepare(FIXTURE / case["image"], case["prompt"], tier=tier)
    b = int8.prepare(FIXTURE / case["image"], case["prompt"], tier=tier)
    assert b.prompt.input_ids.tolist() == a.prompt.input_ids.tolist()
    np.testing.assert_array_equal(b.pixel_values, a.pixel_values)
    result = int8.infer(FIXTURE / case["image"], case["prompt"], tier=tier, max_new_tokens=4)
    assert result.precision == "int8" and 1 <= len(result.tokens) <= 4


def test_graph_with_a_wrong_tensor_name_is_refused(broken):
    path = broken / "onnx" / "vision_encoder.onnx"
    model = onnx.load(path)
    for node in model.graph.node:
        node.input[:] = ["pixels" if n == "pixel_values" else n for n in node.input]
    model.graph.input[0].name = "pixels"
    onnx.save(model, path)
    with pytest.raises(ModelError, match="lacks input 'pixel_values'"):
        make_runtime(broken)


def test_unknown_model_type_is_refused(broken):
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no_such_vlm"}))
    with pytest.raises(ModelError, match="model_type 'no_such_vlm'"):
        load_manifest(broken)


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


# ---- the reference itself ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the fixture extra")
def test_regenerated_reference_is_the_committed_one(tmp_path):
    tool = Path(__file__).resolve().parent.parent / "tools" / "make_idefics3_fixture.py"
    subprocess.run([sys.executable, str(tool), "--out", str(tmp_path)], check=True, capture_output=True)
    fresh = json.loads((tmp_path / "reference.json").read_text())
    assert [(c["input_ids"], c["tokens"]) for c in fresh["cases"]] == [(c["input_ids"], c["tokens"]) for c in CASES]
