"""FastVLM (transformers' `fast_vlm`, published as `llava_qwen2`, served by the llava family): what is its own.

tests/fixtures/fastvlm-tiny is a tiny random transformers FastVlmForConditionalGeneration: its
real vision tower type (timm's FastViT-HD, `fastvit_mci3` reparameterised, tiny widths, stride
64), the GELU projector and a Qwen2 text model, exported to the Hugging Face ONNX layout, with
what LlavaProcessor (CLIP image processor, mean 0 / std 1, patch_size 64, strategy "full") and
greedy `generate` gave for a few images and prompts (tests/fixtures/make/make_fastvlm_fixture.py). The cases
every family passes against that reference are tests/test_family_conformance.py's.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from edgemm.model.manifest import load_manifest
from edgemm.engine.runtime import Runtime
from tests.support.family_conformance import FASTVLM, runtime_of

FIXTURE = FASTVLM.path
CASES = FASTVLM.cases
TOKENS = 16  # (256 // 64) ** 2: FastViT-HD's last feature map, no CLS


@pytest.fixture
def runtime() -> Runtime:
    return runtime_of(FASTVLM)


def test_the_folder_is_fastvlm_as_published_read_by_the_llava_family():
    """transformers' fast_vlm, saved as onnx-community publishes FastVLM (published_layout.py):
    llava_qwen2, the text model's keys at the top, no vision_config."""
    config = json.loads((FIXTURE / "config.json").read_text())
    assert config["model_type"] == "llava_qwen2" and config["num_hidden_layers"] == 2
    assert "text_config" not in config and "vision_config" not in config
    manifest = load_manifest(FIXTURE)
    assert manifest.family == "llava"
    assert {n: t.image_tokens for n, t in manifest.tiers.items()} == {"256x256": TOKENS}
    assert manifest.family_config["image_mean"] == [0.0] * 3 and manifest.family_config["image_std"] == [1.0] * 3


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
