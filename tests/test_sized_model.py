"""tools/make_sized_model.py: a random model of a real shape that edgemm loads and answers
token for token as transformers does.

The test builds the SmolVLM-256M shape reduced (2 layers, text hidden 72, vocabulary 1152:
the published heads, KV heads, vision tower, tile and pixel shuffle) into a temporary
folder, in a subprocess (torch and transformers stay out of this process).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgemm.config import load_config
from edgemm.model.tokenizer import load_tokenizer
from edgemm.engine.runtime import Runtime

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the fixture extra")

TOOLS = Path(__file__).resolve().parent.parent / "tools"
REDUCED = ["--layers", "2", "--hidden", "72", "--vocab", "1152"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sized") / "smolvlm-256m-reduced"
    subprocess.run([sys.executable, str(TOOLS / "make_sized_model.py"), "smolvlm-256m", *REDUCED, "--out", str(out),
                    "--threads", "1", "--quiet"], check=True, capture_output=True)
    return out


def test_reduced_shape_keeps_the_published_structure(folder):
    config = json.loads((folder / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert (text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]) == (2, 72, 1152)  # the reductions
    assert (text["num_attention_heads"], text["num_key_value_heads"]) == (9, 3)
    assert (vision["hidden_size"], vision["image_size"], vision["patch_size"], config["scale_factor"]) == (768, 512, 16, 4)
    assert config["text_config"]["initializer_range"] == config["initializer_range"] == 0.02
    assert not config["tie_word_embeddings"]
    build = json.loads((folder / "build.json").read_text())
    assert build["shape"]["text"]["layers"] == 2 and build["parameters"] > 10_000_000


def test_tokenizer_has_the_vocabulary_size_and_the_added_tokens_at_the_end(folder):
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    assert tokenizer.get_vocab_size() == 1152
    # SmolVLM's layout shifted to this vocabulary: <image> is 49190 of 49280, so 1062 of 1152
    assert [tokenizer.token_to_id(t) for t in ("<global-img>", "<fake_token_around_image>", "<image>",
                                                "<end_of_utterance>")] == [1024, 1061, 1062, 1151]
    assert tokenizer.token_to_id("<|im_start|>") == 1
    assert tokenizer.decode(tokenizer.encode("def main() -> None:").ids) == "def main() -> None:"


def test_edgemm_answers_token_for_token_as_transformers(folder):
    reference = json.loads((folder / "reference.json").read_text())
    runtime = Runtime(load_config({"model": {"path": str(folder)},
                                   "backend": {"intra_op_threads": 1, "warmup": False}}))
    assert list(runtime.manifest.tiers) == ["global", "2x2", "4x4"]  # 512 px tiles up to size.longest_edge 2048
    request = runtime.prepare(folder / reference["image"], reference["prompt"], tier=reference["tier"])
    assert request.prompt.input_ids[0].tolist() == reference["input_ids"]
    result = runtime.infer(folder / reference["image"], reference["prompt"], tier=reference["tier"],
                           max_new_tokens=reference["max_new_tokens"])
    assert result.image_tokens == 64  # (512 / 16 / 4)² per tile
    assert len(reference["tokens"]) >= 8  # an answer long enough to tell runtimes apart
    assert result.tokens == reference["tokens"]

