"""`edgemm infer`: JSON and plain output, stdin, one-line errors with exit code 2, config.

The last test runs the installed console script and needs the trained model.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgemm.cli.main import main

COUNT_PROMPT = "how many shapes are there ?"


@pytest.fixture(scope="module")
def sample(model_dir) -> Path:
    return model_dir / "samples" / "scene_12.png"


def infer(*args: str, **kwargs):
    """`edgemm infer ARGS --threads 1` in-process; stdout and stderr kept apart."""
    return CliRunner().invoke(main, ["infer", *map(str, args), "--threads", "1"], **kwargs)


def infer_json(*args, **kwargs) -> dict:
    result = infer(*args, "--json", **kwargs)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_output(sample):
    out = infer_json(sample, "--prompt", COUNT_PROMPT)
    assert {"answer", "tier", "precision", "devices", "timings_ms", "tokens"} <= set(out)
    assert out["tier"] == out["schedule"]["tier"] and out["precision"] == "q4"  # auto: the shipped q4
    assert out["precision_choice"]["decoder"].startswith("auto: q4 on cpu")
    assert out["devices"] == {"encode": "cpu", "decode": "cpu"}
    assert {"preprocess", "encode", "prefill", "decode", "total"} <= set(out["timings_ms"])
    assert isinstance(out["answer"], str) and all(isinstance(t, int) for t in out["tokens"])


PROGRESS = re.compile(r"edgemm: loading tiny-vlm \(auto\) … ready in \d+\.\d s: q4\n")  # the variant auto took


def test_plain_output_is_one_line_with_the_answer(sample):
    result = infer(sample, "--prompt", COUNT_PROMPT)
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith("\n") and result.stdout.count("\n") == 1
    assert result.stdout[:-1] == infer_json(sample, "--prompt", COUNT_PROMPT)["answer"]
    assert PROGRESS.fullmatch(result.stderr), result.stderr  # the progress line, on stderr only
    assert infer(sample, "--prompt", COUNT_PROMPT, "--quiet").stderr == ""


def test_json_stdout_is_only_the_json(sample):
    result = infer(sample, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["answer"]
    assert PROGRESS.fullmatch(result.stderr), result.stderr


def test_edgemm_alone_prints_its_help_and_exits_0():
    for args in ([], ["--help"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith("Usage: ") and "infer" in result.stdout and "serve" in result.stdout
        assert result.stderr == ""


def test_infer_help_describes_every_option_and_lists_the_tiers():
    text = " ".join(CliRunner().invoke(main, ["infer", "--help"]).stdout.split())
    assert "tiny-vlm has low, mid, high" in text
    for flag, words in (("--max-new-tokens", "Most tokens in the answer"), ("--top-p", "probabilities add up"),
                        ("--seed", "the same seed gives the same answer")):
        assert flag in text and words in text, flag


# ---- prompts the model cannot read ------------------------------------------------------------

UNREADABLE = "What is in this picture?"  # 'this' and 'picture' are not in tiny-vlm's vocabulary


def test_unknown_words_are_answered_with_a_warning_on_stderr(sample):
    result = infer(sample, "--prompt", UNREADABLE, "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("\n") == 1  # stdout is still just the answer
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("edgemm: warning: "), result.stderr
    assert "'this', 'picture'" in result.stderr and "describe the image" in result.stderr
    assert "how many shapes are there ?" in result.stderr


def test_unknown_words_in_json_and_a_known_prompt_has_none(sample):
    out = infer_json(sample, "--prompt", UNREADABLE)
    assert len(out["warnings"]) == 1 and "'picture'" in out["warnings"][0]
    assert "what does the text say ?" in out["warnings"][0]
    assert infer_json(sample, "--prompt", COUNT_PROMPT)["warnings"] == []


def test_unknown_words_refused_with_exit_2_when_configured(sample, tmp_path):
    config = tmp_path / "edgemm.yaml"
    config.write_text("limits:\n  unknown_words: refuse\n")
    result = infer(sample, "--prompt", UNREADABLE, "--config", config)
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgemm: error: "), result.stderr
    assert "'picture'" in lines[0] and "limits.unknown_words: refuse" in lines[0]
    assert infer(sample, "--prompt", COUNT_PROMPT, "--config", config).exit_code == 0


# ---- warm-up: a one-shot warms nothing but its answer, a service every tier (tests/test_warmup.py) --

@pytest.fixture
def encoded_sizes(monkeypatch) -> list[tuple[int, int]]:
    """(height, width) of every image the vision encoder runs on, in order."""
    from edgemm.engine.generate import Generator
    sizes: list[tuple[int, int]] = []
    encode = Generator.encode

    def recording(self, pixel_values):
        sizes.append(tuple(pixel_values.shape[-2:]))
        return encode(self, pixel_values)
    monkeypatch.setattr(Generator, "encode", recording)
    return sizes


def test_infer_encodes_once_its_answer_is_its_warm_up(sample, encoded_sizes, model_dir):
    from edgemm.model.manifest import load_manifest
    tiers = load_manifest(model_dir).tiers
    out = infer_json(sample, "--tier", "low")
    low = (tiers["low"].height, tiers["low"].width)
    # the answer alone: a one-shot infer does not run the load check's blank images either
    # (edgemm/engine/contract.py's check_image_tokens runs them only for a runtime that warms up)
    assert out["tier"] == "low" and encoded_sizes == [low]


def test_a_runtime_for_a_service_warms_up_every_tier(encoded_sizes, model_dir):
    from edgemm.config import load_config
    from edgemm.engine.runtime import Runtime
    runtime = Runtime(load_config({"model": {"path": str(model_dir)}, "backend": {"intra_op_threads": 1}}),
                      concurrent=True)
    assert set(encoded_sizes) == {(t.height, t.width) for t in runtime.manifest.tiers.values()}


def test_stdin(sample):
    out = infer_json("-", "--prompt", COUNT_PROMPT, input=sample.read_bytes())
    assert out["image"] == "<stdin>"
    assert out["tokens"] == infer_json(sample, "--prompt", COUNT_PROMPT)["tokens"]


def test_max_new_tokens_one(sample):
    out = infer_json(sample, "--prompt", "describe the image", "--max-new-tokens", "1")
    assert len(out["tokens"]) <= 1


def test_tier_option(sample):
    out = infer_json(sample, "--tier", "low")
    assert out["tier"] == "low" and out["image_tokens"] == 9


def test_edgemm_config_env_is_honoured(sample, tmp_path):
    config = tmp_path / "edgemm.yaml"
    config.write_text("generation:\n  tier: low\nbackend:\n  warmup: false\n")
    out = infer_json(sample, env={"EDGEMM_CONFIG": str(config)})
    assert out["tier"] == "low"
    config.write_text("limits:\n  max_prompt_chars: 3\n")
    result = infer(sample, env={"EDGEMM_CONFIG": str(config)})
    assert result.exit_code == 2 and "max_prompt_chars" in result.stderr


# ---- errors: exit code 2 and one line on stderr ------------------------------------------------

def error_case(case: str, tmp_path: Path, sample: Path) -> tuple[list[str], str]:
    """(arguments, a piece of the expected message) for each kind of bad input."""
    if case == "missing file":
        return [tmp_path / "nope.png"], "not found"
    if case == "non-image file":
        (tmp_path / "notes.png").write_text("just some text, not pixels\n")
        return [tmp_path / "notes.png"], "not a decodable image"
    if case == "empty file":
        (tmp_path / "empty.png").write_bytes(b"")
        return [tmp_path / "empty.png"], "empty"
    if case == "unknown tier":
        return [sample, "--tier", "huge"], "unknown tier 'huge'"
    if case == "bad precision":
        return [sample, "--precision", "int4"], "int4"
    if case == "model folder missing":
        return [sample, "--model", tmp_path / "no-model"], "model folder not found"
    if case == "malformed config":
        (tmp_path / "bad.yaml").write_text("generation: [tier: low\n")
        return [sample, "--config", tmp_path / "bad.yaml"], "invalid YAML"
    if case == "unknown config key":
        (tmp_path / "typo.yaml").write_text("generation:\n  max_tokens: 3\n")
        return [sample, "--config", tmp_path / "typo.yaml"], "unknown key 'generation.max_tokens'"
    raise AssertionError(case)


@pytest.mark.parametrize("case", [
    "missing file", "non-image file", "empty file", "unknown tier", "bad precision",
    "model folder missing", "malformed config", "unknown config key"])
def test_bad_input_exits_2_with_one_line(case, tmp_path, sample):
    args, expected = error_case(case, tmp_path, sample)
    result = infer(*args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # not an escaped exception
    assert "Traceback" not in result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgemm: error: "), result.stderr
    assert expected in lines[0]


# ---- the installed console script, end to end (needs the trained model) -----------------------

def test_console_script_answers_the_count(model_dir, ground_truth):
    script = Path(sys.executable).parent / "edgemm"
    assert script.is_file(), f"console script not installed next to {sys.executable}"
    name, entry = next((n, e) for n, e in ground_truth.items()
                       if any(q["prompt"] == COUNT_PROMPT for q in e["questions"]))
    answer = next(q["answer"] for q in entry["questions"] if q["prompt"] == COUNT_PROMPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEMM_")}
    done = subprocess.run([str(script), "infer", str(model_dir / "samples" / name),
                           "--prompt", COUNT_PROMPT, "--threads", "1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == answer + "\n"
