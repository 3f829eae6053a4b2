"""A decoder without position_ids (it computes them from the attention mask, as graphs made for
transformers.js may) is accepted, fed without them, and answers exactly as the original graph:
alone, batched with left padding, with beams and with the prompt-prefix cache."""
from __future__ import annotations

import shutil

import pytest

from edgemm.config import load_config
from edgemm.engine.contract import check_component
from edgemm.engine.runtime import Runtime
from edgemm.errors import ModelError
from edgemm.model.family import GraphInputs
from edgemm.model.scenes import make_scene
from tests.support.mask_positions import without_position_ids

ASKS = [("describe the image", 402_100), ("how many shapes ?", 402_101),
        ("what does the text say ?", 402_102), ("what color is the circle ?", 402_103)]


def fp32_runtime(folder, **sections) -> Runtime:
    cfg = {"model": {"path": str(folder), "precision": "fp32"},
           "backend": {"intra_op_threads": 1, "warmup": False}, **sections}
    return Runtime(load_config(cfg))


@pytest.fixture(scope="module")
def runtimes(model_dir, tmp_path_factory):
    """(the built-in model in fp32, the same with its decoder computing positions from the mask)"""
    folder = tmp_path_factory.mktemp("mask-positions") / "tiny-vlm"
    shutil.copytree(model_dir, folder)
    without_position_ids(model_dir / "decoder_model_merged.onnx", folder / "decoder_model_merged.onnx")
    return fp32_runtime(model_dir), fp32_runtime(folder, cache={"max_bytes": 64 << 20})


def test_the_rewritten_decoder_declares_no_position_ids(runtimes):
    original, rewritten = runtimes
    assert "position_ids" in original.generator.decoder.inputs
    assert "position_ids" not in rewritten.generator.decoder.inputs
    assert not rewritten.generator.feeds_positions


@pytest.mark.parametrize("options", [{"max_new_tokens": 16}, {"max_new_tokens": 12, "num_beams": 3},
                                     {"max_new_tokens": 10, "temperature": 0.9, "seed": 7}])
def test_a_decoder_without_position_ids_answers_as_the_original_alone(runtimes, options):
    original, rewritten = runtimes
    for prompt, seed in ASKS[:2]:
        image = make_scene(seed).image
        want = original.infer(image, prompt, **options)
        assert want.tokens  # the comparison means something
        assert rewritten.infer(image, prompt, **options).tokens == want.tokens
        # the same question again: its image prefix from the cache, then the rest of the prompt
        again = rewritten.infer(image, prompt, **options)
        assert again.tokens == want.tokens and again.prefix_reused


def test_a_decoder_without_position_ids_answers_as_the_original_batched(runtimes):
    """Prompts of different lengths, left-padded to one width, and a request joining the
    running batch: each row's positions come from its own mask."""
    original, rewritten = runtimes
    for options in ({"max_new_tokens": 14}, {"max_new_tokens": 8, "num_beams": 2}):
        answers = []
        for runtime in runtimes:
            requests = [runtime.prepare(make_scene(seed).image, prompt, **options) for prompt, seed in ASKS]
            features = [runtime.encode(r.pixel_values) for r in requests]
            answers.append([a.tokens for a in runtime.decode_batch(requests, features)])
        assert len({len(r.prompt.input_ids[0]) for r in requests}) > 1  # left padding happened
        assert answers[1] == answers[0] and all(answers[0])
    # joining between steps: the joiner's cache is padded to the running rows'
    got = []
    for runtime in runtimes:
        requests = [runtime.prepare(make_scene(seed).image, prompt, max_new_tokens=10) for prompt, seed in ASKS[:3]]
        out: dict = {}
        batch = runtime.open_batch(None, out.__setitem__)
        batch.join([(0, requests[0], runtime.encode(requests[0].pixel_values), None, None)])
        batch.step()
        batch.step()
        batch.join([(k, requests[k], runtime.encode(requests[k].pixel_values), None, None) for k in (1, 2)])
        batch.run_to_end()
        got.append([out[k].tokens for k in range(3)])
    assert got[1] == got[0]


def test_a_family_with_rotary_positions_still_requires_them():
    """M-RoPE positions ([3, B, S]) cannot come from a mask: such a family's decoder must declare them."""
    class Graph:
        def __init__(self, inputs):
            self.inputs = {name: type("Spec", (), {"shape": shape})() for name, shape in inputs.items()}
            self.outputs = dict.fromkeys(("logits", "present.0.key", "present.0.value"))
    kv = {f"past_key_values.0.{k}": ("b", 2, "p", 16) for k in ("key", "value")}
    decoder = Graph({"inputs_embeds": ("b", "s", 64), "attention_mask": ("b", "t"), **kv})
    check_component("decoder", decoder, "dec.onnx")  # the default family: positions from the mask
    with pytest.raises(ModelError, match=r"dec.onnx: decoder graph lacks input 'position_ids' .*\[3, batch, sequence\]"):
        check_component("decoder", decoder, "dec.onnx", GraphInputs(position_axes=3))
