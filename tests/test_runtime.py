"""edgemm.engine.runtime.Runtime: results, tiers, precision, limits, and accuracy of the built-in model.

The two accuracy tests need the trained model in models/tiny-vlm/; they fail on the
untrained placeholder.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from edgemm.errors import InputError
from edgemm.engine.runtime import InferenceResult
from edgemm.model.scenes import make_scene, normalise_answer, questions_for

SAMPLES = Path(__file__).resolve().parent.parent / "models" / "tiny-vlm" / "samples"
SAMPLE_NAMES = sorted(json.loads((SAMPLES / "ground_truth.json").read_text()))
PROMPT = "how many shapes are there ?"
SMOKE_SEEDS = range(400_000, 400_050)
SMOKE_MIN_ACCURACY = {"count": 0.90, "colour": 0.90, "describe": 0.80, "read": 0.75}


@pytest.fixture(scope="module")
def sample(model_dir) -> Path:
    return model_dir / "samples" / "scene_12.png"


@pytest.fixture(scope="module")
def top_tier(runtime) -> str:
    return list(runtime.manifest.tiers)[-1]  # tiers are ordered cheapest to richest


def test_infer_returns_a_complete_result(runtime, sample, top_tier):
    result = runtime.infer(sample, PROMPT, tier=top_tier)
    assert isinstance(result, InferenceResult)
    assert result.tier == top_tier == runtime.manifest.default_tier
    assert result.precision == "q4" and result.model == "tiny-vlm"  # auto: the shipped q4 on a CPU
    assert result.devices == {"encode": "cpu", "decode": "cpu"}
    assert {"preprocess", "encode", "prefill", "decode", "total"} <= set(result.timings_ms)
    assert all(isinstance(v, float) for v in result.timings_ms.values())
    assert result.image_tokens == runtime.manifest.tiers[top_tier].image_tokens
    # "<bos> <image> {prompt} <answer>": the image expands to N, each word is one token
    assert result.prompt_tokens == result.image_tokens + len(PROMPT.split()) + 2
    assert result.finish_reason in ("stop", "length")
    assert result.text == runtime.adapter.decode(result.tokens)
    assert json.loads(json.dumps(result.to_dict()))["tier"] == top_tier


def test_image_as_bytes_or_array_gives_the_same_answer(runtime, sample):
    by_path = runtime.infer(sample, PROMPT).tokens
    assert runtime.infer(sample.read_bytes(), PROMPT).tokens == by_path
    assert runtime.infer(make_scene(12, text_probability=0.5).image, PROMPT).tokens == by_path


def test_tier_selection_changes_image_tokens(runtime, sample):
    results = {name: runtime.infer(sample, PROMPT, tier=name) for name in runtime.manifest.tiers}
    for name, result in results.items():
        assert result.tier == name
        assert result.image_tokens == runtime.manifest.tiers[name].image_tokens
        assert result.prompt_tokens - result.image_tokens == len(PROMPT.split()) + 2
    assert [r.image_tokens for r in results.values()] == [9, 36, 64]


def test_configured_tier_is_the_default(make_runtime, sample):
    assert make_runtime(generation={"tier": "low"}).infer(sample, PROMPT).tier == "low"


def test_int8_precision_loads(make_runtime, runtime, sample):
    int8 = make_runtime(model={"precision": "int8"})
    assert int8.precision == "int8"
    assert {c.precision for c in int8.components.all()} == {"int8"}
    result = int8.infer(sample, PROMPT)
    assert result.precision == "int8" and result.tier == runtime.infer(sample, PROMPT).tier
    pixels, _ = runtime.preprocess(sample)
    fp32, quantized = runtime.generator.encode(pixels), int8.generator.encode(pixels)
    assert fp32.shape == quantized.shape
    assert not np.array_equal(fp32, quantized)  # a different (quantized) graph really ran


def test_image_byte_limit(make_runtime, sample):
    size = sample.stat().st_size
    limited = make_runtime(limits={"max_image_bytes": size - 1})
    for image in (sample, str(sample), sample.read_bytes()):
        with pytest.raises(InputError, match="max_image_bytes"):
            limited.infer(image, PROMPT)
    assert make_runtime(limits={"max_image_bytes": size}).infer(sample, PROMPT).tier in limited.manifest.tiers


def test_prompt_char_limit(make_runtime, sample):
    limited = make_runtime(limits={"max_prompt_chars": 16})
    with pytest.raises(InputError, match="max_prompt_chars"):
        limited.infer(sample, "how many shapes ?")  # 17 characters
    limited.infer(sample, "count the shapes")  # exactly 16


def test_unknown_tier(runtime, sample):
    with pytest.raises(InputError, match=r"unknown tier 'huge'.*low, mid, high"):
        runtime.infer(sample, PROMPT, tier="huge")


def test_bad_generation_option_is_an_input_error(runtime, sample):
    with pytest.raises(InputError, match="top_p"):
        runtime.infer(sample, PROMPT, top_p=0)


def test_generation_options_are_checked_once_per_set_of_values(runtime, sample):
    """Preparation keeps each checked set of options: equal values share one, but a value that
    only compares equal to an accepted one (True == 1, 2.0 == 2) is still checked, and one that
    does not hash gets the validator's message, not a TypeError."""
    first, again = runtime.prepare(sample, PROMPT, seed=1), runtime.prepare(sample, PROMPT, seed=1)
    assert first.options is again.options and first.options.seed == 1
    assert runtime.prepare(sample, PROMPT, seed=2).options.seed == 2
    runtime.prepare(sample, PROMPT, max_new_tokens=2)
    for bad, field in (({"seed": True}, "seed"), ({"max_new_tokens": 2.0}, "max_new_tokens"),
                       ({"max_new_tokens": [2]}, "max_new_tokens"), ({"top_p": {}}, "top_p")):
        with pytest.raises(InputError, match=f"'{field}' must be a"):
            runtime.prepare(sample, PROMPT, **bad)


# ---- accuracy (needs the trained model) ----------------------------------------------------

@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_sample_answers_match_ground_truth(runtime, ground_truth, model_dir, top_tier, name):
    wrong = []
    for q in ground_truth[name]["questions"]:
        answer = runtime.infer(model_dir / "samples" / name, q["prompt"], tier=top_tier).text
        if normalise_answer(answer) != normalise_answer(q["answer"]):
            wrong.append(f"{q['prompt']!r}: got {answer!r}, want {q['answer']!r}")
    assert not wrong, "\n".join(wrong)


def test_smoke_accuracy_on_generated_scenes(runtime, top_tier):
    right, total = defaultdict(int), defaultdict(int)
    for seed in SMOKE_SEEDS:
        scene = make_scene(seed)
        for q in questions_for(scene):
            answer = runtime.infer(scene.image, q.prompt, tier=top_tier).text
            right[q.task] += normalise_answer(answer) == normalise_answer(q.answer)
            total[q.task] += 1
    accuracy = {task: right[task] / total[task] for task in total}
    assert set(accuracy) == set(SMOKE_MIN_ACCURACY)
    low = {task: f"{accuracy[task]:.0%} < {floor:.0%}"
           for task, floor in SMOKE_MIN_ACCURACY.items() if accuracy[task] < floor}
    assert not low, f"accuracy per task {accuracy}; below the floor: {low}"


def test_concurrent_stages_split_the_cores_and_do_not_spin(make_runtime, monkeypatch):
    import edgemm.engine.loading
    import edgemm.engine.runtime as runtime_module
    monkeypatch.setattr(edgemm.engine.loading, "usable_cpus", lambda: 6)
    cfg = make_runtime().config
    cfg.backend.intra_op_threads = 0
    pipelined = runtime_module.Runtime(cfg, concurrent=True)
    options = pipelined.components.decoder.session.get_session_options()
    assert options.intra_op_num_threads == 3
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    alone = runtime_module.Runtime(cfg)  # edgemm infer: onnxruntime's own choice, spinning allowed
    options = alone.components.decoder.session.get_session_options()
    assert options.intra_op_num_threads == 0
    cfg.backend.intra_op_threads = 2  # an explicit count is kept, the spinning still goes
    options = runtime_module.Runtime(cfg, concurrent=True).components.vision_encoder.session.get_session_options()
    assert options.intra_op_num_threads == 2
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_prompt_ids_are_built_once_and_shared_read_only(runtime):
    low, high = runtime.manifest.tiers["low"], runtime.manifest.tiers["high"]
    first = runtime.prompt_ids("how many shapes are there ?", high, (256, 256))
    assert runtime.prompt_ids("how many shapes are there ?", high, (256, 256)) is first
    assert not first.input_ids.flags.writeable and not first.image_positions.flags.writeable
    other = runtime.prompt_ids("how many shapes are there ?", low, (256, 256))
    assert other is not first and other.image_tokens == low.image_tokens
    fresh = runtime.adapter.build_prompt("how many shapes are there ?", high, (256, 256))
    assert (fresh.input_ids == first.input_ids).all()


def test_an_onnxruntime_component_can_shrink_its_arena_after_one_run(runtime):
    encoder = runtime.generator.encoder
    pixels, _ = runtime.preprocess(np.zeros((64, 64, 3), np.uint8), "low")
    plain = encoder.run({"pixel_values": pixels})["image_features"]
    encoder.release_memory()
    assert encoder.shrink_next is True
    shrunk = encoder.run({"pixel_values": pixels})["image_features"]
    assert encoder.shrink_next is False  # for that one run only
    np.testing.assert_array_equal(plain, shrunk)
