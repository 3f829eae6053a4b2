"""A Hugging Face model folder's JSON values of the wrong type, or out of range, are a broken
folder: a one-line ModelError (exit 2) naming the file and the key, at load, for every family
(edgemm.model.hf_folder's JsonObject accessors), never an AttributeError or TypeError (exit 1),
and never a resize target or normalisation that only fails once an image is being prepared."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgemm.cli.main import main
from edgemm.errors import ModelError
from edgemm.model.family import family_for
from edgemm.model.manifest import load_manifest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAMILIES = ["idefics3-tiny", "qwen2-vl-tiny", "qwen2.5-vl-tiny", "gemma3-tiny", "internvl-tiny", "llava-tiny",
            "fastvlm-tiny"]
# (file, key, wrong value, what the message says of it): every family reads these
WRONG_TYPES = [
    ("config.json", "text_config", [1], "text_config must be an object"),
    ("preprocessor_config.json", "size", [1], "size must be an object"),
    ("preprocessor_config.json", "rescale_factor", "x", "rescale_factor must be a finite number above 0"),
    ("preprocessor_config.json", "image_mean", [1, 2], "image_mean must be 3 finite numbers"),
    ("preprocessor_config.json", "image_mean", [float("nan")] * 3, "image_mean must be 3 finite numbers"),
    ("preprocessor_config.json", "image_std", [0, 0, 0], "image_std must be 3 finite numbers above 0"),
    ("preprocessor_config.json", "image_std", "wide", "image_std must be 3 finite numbers above 0"),
    ("preprocessor_config.json", "rescale_factor", 1e308, "rescale_factor must be a finite number above 0 and at most 1"),
    ("preprocessor_config.json", "image_std", 1e300, r"image_mean and image_std make a pixel .* up to 1e\+300\), beyond"),
    ("preprocessor_config.json", "image_std", [1e-30] * 3, r"image_mean and image_std make a pixel \S+e\+\d+ .*, beyond float16"),
    ("generation_config.json", "eos_token_id", {"a": 1}, "eos_token_id must be a token id or a list of them"),
    ("generation_config.json", "eos_token_id", [2, "x"], "eos_token_id must be a token id or a list of them"),
]
# a resize target beyond the 4096 px a side the README promises, family by family
HUGE_SIZES = [
    ("gemma3-tiny", "size", {"height": 100000, "width": 100000}, "size.height must be an integer from 1 to 4096"),
    ("internvl-tiny", "size", {"height": 100000, "width": 100000}, "size.height must be an integer from 1 to 4096"),
    ("idefics3-tiny", "size", {"longest_edge": 100000}, "size.longest_edge must be an integer from 1 to 4096"),
    ("idefics3-tiny", "max_image_size", {"longest_edge": 5000}, "max_image_size.longest_edge must be"),
    ("llava-tiny", "size", {"shortest_edge": 100000}, "size.shortest_edge must be an integer from 1 to 4096"),
    ("llava-tiny", "crop_size", {"height": 20000, "width": 32}, "crop_size.height must be"),
    ("qwen2-vl-tiny", "size", {"longest_edge": 10 ** 12, "shortest_edge": 3136},
     "size.longest_edge must be an integer from 1 to 16777216"),
    ("qwen2-vl-tiny", "max_pixels", 10 ** 12, "max_pixels must be an integer from 1 to 16777216"),
]


# what one family or two read, of the wrong type
FAMILY_KEYS = [
    ("gemma3-tiny", "preprocessor_config.json", "resample", [1], "resample must be an integer of at least 0"),
    ("llava-tiny", "preprocessor_config.json", "resample", {"a": 1}, "resample must be an integer of at least 0"),
    ("llava-tiny", "processor_config.json", "image_token", [1], "image_token must be a string that is not empty"),
    ("fastvlm-tiny", "processor_config.json", "image_token", 5, "image_token must be a string that is not empty"),
    ("llava-tiny", "preprocessor_config.json", "do_pad", "yes", "do_pad must be true or false"),
    ("internvl-tiny", "preprocessor_config.json", "max_patches", True, "max_patches must be an integer of at least 1"),
    ("internvl-tiny", "config.json", "downsample_ratio", 1e308, "downsample_ratio must be a finite number above 0 and"),
    ("qwen2-vl-tiny", "preprocessor_config.json", "temporal_patch_size", 10 ** 6, "temporal_patch_size must be"),
    ("idefics3-tiny", "processor_config.json", "image_seq_len", "64", "image_seq_len must be an integer"),
]


def edited(tmp_path: Path, fixture: str, file: str, changes: dict) -> Path:
    """A copy of the fixture folder with `changes` made at the top level of `file`."""
    folder = Path(shutil.copytree(FIXTURES / fixture, tmp_path / fixture))
    data = json.loads((folder / file).read_text())
    (folder / file).write_text(json.dumps({**data, **changes}))
    return folder


def refusal(folder: Path) -> str:
    """The one-line message loading the folder (manifest and family) fails with."""
    with pytest.raises(ModelError) as refused:
        family_for(load_manifest(folder))
    message = str(refused.value)
    assert "\n" not in message and refused.value.exit_code == 2
    return message


@pytest.mark.parametrize("fixture", FAMILIES)
@pytest.mark.parametrize("file, key, value, says", WRONG_TYPES, ids=lambda v: str(v)[:20])
def test_a_wrong_typed_value_is_named_with_its_file(tmp_path, fixture, file, key, value, says):
    folder = edited(tmp_path, fixture, file, {key: value})
    assert re.match(re.escape(f"{folder / file}: ") + says, refusal(folder))


@pytest.mark.parametrize("fixture, file, key, value, says", FAMILY_KEYS, ids=lambda v: str(v)[:20])
def test_a_wrong_typed_value_of_one_family_is_named_with_its_file(tmp_path, fixture, file, key, value, says):
    folder = edited(tmp_path, fixture, file, {key: value})
    assert refusal(folder).startswith(f"{folder / file}: {says}")


# the families that read config.json's vision_config (gemma3 does not; idefics3 only without
# processor_config.json's image_seq_len)
@pytest.mark.parametrize("fixture", ["qwen2-vl-tiny", "qwen2.5-vl-tiny", "internvl-tiny", "llava-tiny", "fastvlm-tiny"])
def test_a_vision_config_that_is_no_object_is_named(tmp_path, fixture):
    folder = edited(tmp_path, fixture, "config.json", {"vision_config": [1]})
    assert refusal(folder).startswith(f"{folder / 'config.json'}: vision_config must be an object")


@pytest.mark.parametrize("fixture, key, value, says", HUGE_SIZES, ids=lambda v: str(v)[:24])
def test_a_resize_beyond_4096_px_a_side_is_refused_at_load(tmp_path, fixture, key, value, says):
    folder = edited(tmp_path, fixture, "preprocessor_config.json", {key: value})
    assert refusal(folder).startswith(f"{folder / 'preprocessor_config.json'}: {says}")


def test_internvl_tiles_beyond_a_4096_px_image_are_refused(tmp_path):
    folder = edited(tmp_path, "internvl-tiny", "preprocessor_config.json",
                    {"size": {"height": 4096, "width": 4096}, "max_patches": 2})
    assert "max_patches 2 tiles of 4096x4096 are more pixels than a 4096x4096 image" in refusal(folder)


@pytest.mark.parametrize("fixture, file, changes", [
    # a pixel budget of 1024 image tokens, the Qwen family's most, in the fixture's context of 1024
    ("qwen2-vl-tiny", "preprocessor_config.json", {"size": {"longest_edge": 4096 * 4096, "shortest_edge": 3136}}),
    ("internvl-tiny", "preprocessor_config.json", {"max_patches": 64}),
    ("gemma3-tiny", "processor_config.json", {"image_seq_length": 4096}),
])
def test_a_tier_whose_image_tokens_fill_the_context_is_refused_at_load(tmp_path, fixture, file, changes):
    message = refusal(edited(tmp_path, fixture, file, changes))
    assert "image tokens, more than the model's context of 1024" in message


def test_null_takes_the_default_as_transformers_does(tmp_path):
    folder = edited(tmp_path, "gemma3-tiny", "preprocessor_config.json", {"image_std": None})
    assert load_manifest(folder).preprocessing.std == (0.5, 0.5, 0.5)  # Gemma3ImageProcessor's default


def test_infer_exits_2_with_one_line_before_reading_the_image(tmp_path):
    folder = edited(tmp_path, "qwen2-vl-tiny", "config.json", {"vision_config": [1]})
    result = CliRunner().invoke(main, ["infer", str(folder / "wide.png"), "--model", str(folder), "--threads", "1"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"edgemm: error: {folder / 'config.json'}: vision_config must be an object (got [1])"
