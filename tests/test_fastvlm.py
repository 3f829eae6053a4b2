"""FastVLM (transformers' `fast_vlm`, served by the llava family) against its reference implementation.

tests/fixtures/fastvlm-tiny is a tiny random transformers FastVlmForConditionalGeneration: its
real vision tower type (timm's FastViT-HD, `fastvit_mci3` reparameterised, tiny widths, stride
64), the GELU projector and a Qwen2 text model, exported to the Hugging Face ONNX layout, with
what LlavaProcessor (CLIP image processor, mean 0 / std 1, patch_size 64, strategy "full") and
greedy `generate` gave for a few images and prompts (tools/make_fastvlm_fixture.py). Neither
torch, transformers nor timm is needed here, except by the slow test that regenerates it.
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgemm.config import load_config
from edgemm.model.manifest import load_manifest
from edgemm.runtime import Runtime

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "fastvlm-tiny"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
CASES = REFERENCE["cases"]
MAX_NEW = REFERENCE["max_new_tokens"]
TOKENS = 16  # (256 // 64) ** 2: FastViT-HD's last feature map, no CLS


def make_runtime(**sections) -> Runtime:
    cfg = {"model": {"path": str(FIXTURE)}, "backend": {"intra_op_threads": 1, "warmup": False}}
    cfg.update(sections)
    return Runtime(load_config(cfg))


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    return make_runtime(cache={"max_bytes": 0})


def case_id(case: dict) -> str:
    return f"{case['image']}-{case['prompt'].split()[0]}"


def test_the_folder_is_transformers_fast_vlm_read_by_the_llava_family():
    assert json.loads((FIXTURE / "config.json").read_text())["model_type"] == "fast_vlm"
    manifest = load_manifest(FIXTURE)
    assert manifest.family == "llava"
    assert {n: t.image_tokens for n, t in manifest.tiers.items()} == {"256x256": TOKENS}
    assert manifest.family_config["image_mean"] == [0.0] * 3 and manifest.family_config["image_std"] == [1.0] * 3


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_processor_outputs_equal_the_reference(runtime, case):
    request = runtime.prepare(FIXTURE / case["image"], case["prompt"])
    assert request.prompt.input_ids[0].tolist() == case["input_ids"]
    expected = np.load(FIXTURE / "reference_pixels.npz")[f"case{CASES.index(case)}"]
    assert request.pixel_values.shape == expected.shape == (1, 3, 256, 256)
    np.testing.assert_allclose(request.pixel_values, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_greedy_tokens_equal_transformers_generate(runtime, case):
    result = runtime.infer(FIXTURE / case["image"], case["prompt"], max_new_tokens=MAX_NEW)
    assert result.tokens == case["tokens"]
    assert result.finish_reason == case["finish_reason"]
    assert result.image_tokens == TOKENS and result.prompt_tokens == len(case["input_ids"])


def test_a_second_question_reuses_the_image_prefix_and_stays_exact():
    cached = make_runtime()
    first, second = CASES[0], CASES[2]
    assert first["image"] == second["image"] and first["prompt"] != second["prompt"]
    a = cached.infer(FIXTURE / first["image"], first["prompt"], max_new_tokens=MAX_NEW)
    b = cached.infer(FIXTURE / second["image"], second["prompt"], max_new_tokens=MAX_NEW)
    assert not a.prefix_reused and b.prefix_reused
    assert (a.tokens, b.tokens) == (first["tokens"], second["tokens"])


def test_a_batch_of_three_gives_each_row_its_own_tokens(runtime):
    chosen = CASES[1:4]
    requests = [runtime.prepare(FIXTURE / c["image"], c["prompt"], max_new_tokens=MAX_NEW) for c in chosen]
    results = runtime.decode_batch(requests, [runtime.encode(r.pixel_values) for r in requests])
    alone = [runtime.infer(FIXTURE / c["image"], c["prompt"], max_new_tokens=MAX_NEW).tokens for c in chosen]
    assert [r.tokens for r in results] == alone == [c["tokens"] for c in chosen]
    assert [r.decode_batch for r in results] == [3, 3, 3]
    assert len({len(c["input_ids"]) for c in chosen}) > 1  # rows of different lengths: left padding in play


def test_chat_text_is_the_processors_qwen2_template(runtime):
    assert "{% generation %}" in (FIXTURE / "chat_template.jinja").read_text()
    for case in CASES:
        assert runtime.adapter.chat_text(case["prompt"]) == case["text"]
    assert CASES[0]["text"].startswith("<|im_start|>system\n") and "<image>\n" in CASES[0]["text"]
    prompt = runtime.adapter.build_prompt("hi", runtime.manifest.tiers["256x256"])
    ids = prompt.input_ids[0].tolist()
    assert ids[0] == runtime.adapter.tokenizer.token_to_id("<|im_start|>")  # Qwen2: no BOS
    assert np.array_equal(prompt.image_positions, np.arange(prompt.image_start, prompt.image_start + TOKENS))


def test_stop_token_is_im_end(runtime):
    assert runtime.adapter.stop_ids == {runtime.adapter.tokenizer.token_to_id("<|im_end|>")}
    assert any(c["finish_reason"] == "stop" for c in CASES)


def _timm_imports() -> bool:
    try:
        for name in ("timm", "transformers"):
            importlib.import_module(name)
    except Exception:  # timm needs torchvision, whose wheel needs a matching torch
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _timm_imports(), reason="needs the fixture extra and timm")
def test_regenerated_reference_is_the_committed_one(tmp_path):
    tool = Path(__file__).resolve().parent.parent / "tools" / "make_fastvlm_fixture.py"
    subprocess.run([sys.executable, str(tool), "--out", str(tmp_path)], check=True, capture_output=True)
    fresh = json.loads((tmp_path / "reference.json").read_text())
    assert [(c["input_ids"], c["tokens"]) for c in fresh["cases"]] == [(c["input_ids"], c["tokens"]) for c in CASES]
