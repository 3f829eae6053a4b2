"""The image tokens each tier's prompt holds are checked against what the vision encoder gives,
when the folder loads: a contradiction is one ModelError line naming both numbers, the tier and
the keys, and `serve` and `infer` exit 2 before any image is prepared."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml
from click.testing import CliRunner

from edgemm.cli.main import main
from edgemm.engine.contract import check_image_tokens
from edgemm.errors import ModelError
from tests.support.family_conformance import FAMILIES, FIXTURES, make_runtime


def edit_json(path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.fixture
def llava_17(tmp_path):
    """LLaVA-tiny as transformers.js reads it: 17 image tokens (vision_feature_select_strategy
    'full', from config.json) where the encoder gives 16."""
    folder = shutil.copytree(FIXTURES / "llava-tiny", tmp_path / "llava-17")
    edit_json(folder / "processor_config.json", lambda d: d.pop("vision_feature_select_strategy"))
    edit_json(folder / "config.json", lambda d: d.update(vision_feature_select_strategy="full"))
    return folder


def refusal(folder, **sections) -> str:
    with pytest.raises(ModelError) as info:
        make_runtime(folder, **sections)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_fixture_loads_and_agrees_with_its_encoder(name):
    runtime = make_runtime(FAMILIES[name].path)
    calls = check_image_tokens(runtime.adapter, runtime.manifest, runtime.models.loaded.vision_encoder,
                               runtime.generator.encode)
    assert calls <= len(runtime.manifest.tiers)  # one blank per shape at most, none where the graph says


def test_the_built_in_model_agrees_with_its_encoder(make_runtime):
    runtime = make_runtime()
    assert check_image_tokens(runtime.adapter, runtime.manifest, runtime.models.loaded.vision_encoder,
                              runtime.generator.encode) == len(runtime.manifest.tiers)  # its N is not fixed


def test_a_llava_folder_whose_strategy_adds_a_token_is_refused_at_load(llava_17):
    message = refusal(llava_17)
    assert "tier 32x32" in message and "holds 17 image tokens" in message and "gives 16" in message
    assert "vision_feature_select_strategy 'full' (config.json)" in message
    assert "num_additional_image_tokens 1" in message


def test_a_llava_folder_with_an_extra_token_is_refused_at_load(tmp_path):
    folder = shutil.copytree(FIXTURES / "llava-tiny", tmp_path / "llava")
    edit_json(folder / "processor_config.json", lambda d: d.update(num_additional_image_tokens=2))
    message = refusal(folder)
    assert "holds 17 image tokens" in message and "num_additional_image_tokens 2 (processor_config.json)" in message


def test_a_tiled_family_is_checked_per_tile(tmp_path):
    """SmolVLM's image_seq_len is per tile; its encoder's count is not fixed in the graph, so a
    blank tile runs once and every tier's count follows from its tiles."""
    folder = shutil.copytree(FIXTURES / "idefics3-tiny", tmp_path / "idefics3")
    seq_len = json.loads((folder / "processor_config.json").read_text())["image_seq_len"]
    edit_json(folder / "processor_config.json", lambda d: d.update(image_seq_len=seq_len + 1))
    message = refusal(folder)
    assert f"tier global: the prompt holds {seq_len + 1} image tokens" in message
    assert f"gives {seq_len}" in message and "image_seq_len" in message and "processor_config.json" in message


def test_a_one_shot_infer_runs_no_blank_image_and_its_request_fails_in_one_line(tmp_path):
    """`edgemm infer` pays no blank encode for the check where the graph does not fix the
    count (a whole tile at real size): the contradiction fails its one request instead, exit 2."""
    folder = shutil.copytree(FIXTURES / "idefics3-tiny", tmp_path / "idefics3")
    edit_json(folder / "processor_config.json", lambda d: d.update(image_seq_len=d["image_seq_len"] + 1))
    result = CliRunner().invoke(main, ["infer", str(folder / "wide.png"), "--prompt", "what is it?",
                                       "--model", str(folder), "--quiet"])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "image placeholders" in result.stderr


def test_a_model_yaml_tier_that_contradicts_the_encoder_is_refused(tmp_model):
    path = tmp_model / "model.yaml"
    data = yaml.safe_load(path.read_text())
    data["tiers"]["mid"]["image_tokens"] = 35
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    message = refusal(tmp_model)
    assert "tier mid: the prompt holds 35 image tokens (model.yaml: the tier's image_tokens)" in message
    assert "gives 36 (image_features of a blank 192x192 image)" in message


def test_infer_exits_2_before_any_image_is_prepared(llava_17, monkeypatch):
    from edgemm.engine.preparation import Preparation

    def prepare(*args, **kwargs):
        raise AssertionError("an image was prepared")
    monkeypatch.setattr(Preparation, "prepare", prepare)
    result = CliRunner().invoke(main, ["infer", str(llava_17 / "wide.png"), "--prompt", "what is it?",
                                       "--model", str(llava_17), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "holds 17 image tokens" in result.stderr and "gives 16" in result.stderr


def test_serve_refuses_to_start_on_a_llava_folder_contradicting_its_encoder(llava_17):
    folder = tempfile.mkdtemp(prefix="edgemm-", dir="/tmp")  # a UNIX socket's path is short
    try:
        config = os.path.join(folder, "edgemm.yaml")
        with open(config, "w") as f:  # warm-up off: the load check alone must refuse
            yaml.safe_dump({"backend": {"intra_op_threads": 1, "warmup": "none"}}, f)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EDGEMM_", "LISTEN_", "NOTIFY_"))}
        result = subprocess.run([sys.executable, "-m", "edgemm.cli.main", "serve", "--config", config,
                                 "--socket", os.path.join(folder, "edgemm.sock"), "--model", str(llava_17)],
                                env=env, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith("edgemm: error: ") and "holds 17 image tokens" in last and "gives 16" in last
    assert "Traceback" not in result.stderr

