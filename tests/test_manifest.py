"""A broken model folder is refused with one clear line that says what and where."""
from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest
import yaml
from click.testing import CliRunner
from onnx import TensorProto, helper

from edgemm.cli.main import main
from edgemm.config import load_config
from edgemm.errors import InputError, ModelError
from edgemm.model.family import adapter_for
from edgemm.model.manifest import load_manifest
from edgemm.engine.runtime import Runtime


def load_runtime(model_dir, precision: str = "fp32") -> Runtime:
    return Runtime(load_config({"model": {"path": str(model_dir), "precision": precision},
                                "backend": {"intra_op_threads": 1, "warmup": False}}))


def refused(error_type, call, *args) -> str:
    """The message `call(*args)` fails with; it must be one line."""
    with pytest.raises(error_type) as info:
        call(*args)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def edit_yaml(model_dir, change) -> None:
    path = model_dir / "model.yaml"
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_the_copy_loads(tmp_model):
    assert load_runtime(tmp_model).manifest.path == tmp_model


def test_missing_model_folder(tmp_path):
    missing = tmp_path / "no-such-model"
    message = refused(ModelError, load_manifest, missing)
    assert "model folder not found" in message and str(missing) in message
    assert "model folder not found" in refused(ModelError, load_runtime, missing)


def test_folder_without_model_yaml(tmp_model):
    (tmp_model / "model.yaml").unlink()
    message = refused(ModelError, load_manifest, tmp_model)
    assert "model.yaml not found" in message and str(tmp_model) in message


def test_model_yaml_bad_yaml(tmp_model):
    (tmp_model / "model.yaml").write_text("name: tiny-vlm\ntiers: [low, {unclosed\n")
    message = refused(ModelError, load_manifest, tmp_model)
    assert "model.yaml" in message and "not valid YAML" in message


def test_model_yaml_not_a_mapping(tmp_model):
    (tmp_model / "model.yaml").write_text("- just\n- a list\n")
    assert "top level must be a mapping" in refused(ModelError, load_manifest, tmp_model)


@pytest.mark.parametrize("section, key", [("files", "decoder"), (None, "max_context"),
                                          ("special_tokens", "eos"), (None, "tiers")])
def test_missing_key_is_named(tmp_model, section, key):
    edit_yaml(tmp_model, lambda d: (d[section] if section else d).pop(key))
    message = refused(ModelError, load_manifest, tmp_model)
    assert f"missing key '{key}'" in message and "model.yaml" in message
    if section:
        assert section in message


NAN, INF = float("nan"), float("inf")  # YAML's .nan and .inf, as yaml.safe_dump writes them


@pytest.mark.parametrize("section, key, value, said", [
    # NaN passed `min(std) <= 0` (false for NaN), and every pixel of every request was NaN
    ("preprocessing", "std", [0.5, NAN, 0.5], "preprocessing.mean and .std must be lists of 3 finite numbers, std > 0"),
    ("preprocessing", "std", [INF, 0.5, 0.5], "preprocessing.mean and .std must be lists of 3 finite numbers, std > 0"),
    ("preprocessing", "mean", [NAN, 0.5, 0.5], "preprocessing.mean and .std must be lists of 3 finite numbers, std > 0"),
    ("preprocessing", "mean", [0.5, 0.5, -INF], "preprocessing.mean and .std must be lists of 3 finite numbers, std > 0"),
    ("preprocessing", "mean", [True, 0.5, 0.5], "preprocessing.mean and .std must be lists of 3 finite numbers, std > 0"),
    ("preprocessing", "std", [1e-9, 0.5, 0.5], "preprocessing.mean and .std make a pixel 5e+08, beyond float16's ±65504"),
    ("preprocessing", "color", 5, "preprocessing.color must be str, got int"),
    # each of these was a traceback (AttributeError, TypeError) instead of a line naming the key
    (None, "preprocessing", [1, 2], "'preprocessing' must be a mapping"),
    (None, "stop_tokens", 5, "'stop_tokens' must be a list of strings"),
    (None, "stop_tokens", [5], "'stop_tokens' must be a list of strings"),
    (None, "precisions", 5, "'precisions' must be a list of strings"),
    (None, "decoder", [1, 2], "'decoder' must be dict, got list"),
    (None, "default_tier", [1], "default_tier [1] is not one of low, mid, high"),
    ("special_tokens", "unk", 5, "special_tokens: 'unk' must be str, got int"),
    # each of these was taken, and the model answered as if it were fine (or ran out of memory)
    ("preprocessing", "color", "xyz", "preprocessing.color 'xyz' is not one of rgb"),
    ("preprocessing", "resize", "bogus", "preprocessing.resize 'bogus' is not one of stretch"),
    ("decoder", "layers", -1, "decoder.layers -1 must be a positive integer"),
    ("decoder", "vocab_size", 0, "decoder.vocab_size 0 must be a positive integer"),
    ("decoder", "heads", "4", "decoder.heads '4' must be a positive integer"),
    (None, "image_token", "<bos>", "image_token '<bos>' must be a token of its own, not special_tokens.bos"),
    (None, "max_context", 10 ** 12, "max_context 1000000000000 must be an integer from 2 to 1048576"),
    (None, "max_context", 1, "max_context 1 must be an integer from 2 to 1048576"),
])
def test_a_bad_value_in_model_yaml_is_one_line_naming_the_key(tmp_model, section, key, value, said):
    edit_yaml(tmp_model, lambda d: (d[section] if section else d).update({key: value}))
    assert refused(ModelError, load_manifest, tmp_model) == f"{tmp_model / 'model.yaml'}: {said}"


@pytest.mark.parametrize("image_tokens", [320, 100_000_000])
def test_a_tiers_image_tokens_must_leave_room_in_max_context_as_in_a_hugging_face_folder(tmp_model, image_tokens):
    # 100 000 000 was a MemoryError (exit 1): the prompt's placeholders were made before any check
    edit_yaml(tmp_model, lambda d: d["tiers"]["high"].update(image_tokens=image_tokens))
    assert refused(ModelError, load_manifest, tmp_model) == (
        f"{tmp_model / 'model.yaml'}: tier high gives {image_tokens} image tokens, more than the model's context "
        "of 320 (max_context) holds")
    edit_yaml(tmp_model, lambda d: d["tiers"]["high"].update(image_tokens=319))
    assert load_manifest(tmp_model).tiers["high"].image_tokens == 319


@pytest.mark.parametrize("key, value, said", [
    ("special_tokens", {"bos": "<bos>", "eos": "<eos>", "pad": "nosuch"}, "special_tokens.pad 'nosuch' is not in the "
                                                                         "tokenizer"),
    ("prompt_format", "<bos> <image> <image> {prompt} <answer>", "prompt_format gives the image token <image> 2 "
                                                                 "times, not once"),
])
def test_a_model_yaml_token_the_tokenizer_does_not_make_is_refused_at_load(tmp_model, key, value, said):
    edit_yaml(tmp_model, lambda d: d.update({key: value}))
    assert refused(ModelError, lambda: adapter_for(load_manifest(tmp_model))) == f"{tmp_model / 'model.yaml'}: {said}"


def test_a_bad_model_yaml_value_is_exit_2_from_the_cli_not_an_answer(tmp_model):
    edit_yaml(tmp_model, lambda d: d["special_tokens"].update(pad="nosuch"))
    result = CliRunner().invoke(main, ["infer", str(tmp_model / "samples" / "scene_11.png"), "--model", str(tmp_model)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1] == (f"edgemm: error: {tmp_model / 'model.yaml'}: special_tokens.pad "
                                                      "'nosuch' is not in the tokenizer")


def test_a_nan_std_is_exit_2_from_the_cli(tmp_model):
    edit_yaml(tmp_model, lambda d: d["preprocessing"].update(std=[NAN] * 3))
    result = CliRunner().invoke(main, ["infer", str(tmp_model / "samples" / "scene_11.png"), "--model", str(tmp_model)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"edgemm: error: {tmp_model / 'model.yaml'}: preprocessing.mean "
                                                  "and .std must be lists of 3 finite numbers, std > 0"]


def test_unknown_family(tmp_model):
    edit_yaml(tmp_model, lambda d: d.update(family="llava-next"))
    manifest = load_manifest(tmp_model)
    message = refused(ModelError, adapter_for, manifest)
    assert "unknown family 'llava-next'" in message and "tiny-vlm" in message
    assert "unknown family" in refused(ModelError, load_runtime, tmp_model)


def test_unknown_tier_lists_tiers(model_dir):
    message = refused(InputError, load_manifest(model_dir).tier, "huge")
    assert "'huge'" in message and "low, mid, high" in message


def test_default_tier_must_exist(tmp_model):
    edit_yaml(tmp_model, lambda d: d.update(default_tier="ultra"))
    assert "default_tier 'ultra'" in refused(ModelError, load_manifest, tmp_model)


def test_missing_int8_variant_points_to_quantize(tmp_model):
    (tmp_model / "decoder_model_merged_int8.onnx").unlink()
    load_runtime(tmp_model, "fp32")  # fp32 does not need it
    message = refused(ModelError, load_runtime, tmp_model, "int8")
    assert "decoder" in message and "int8" in message and "tools/quantize.py" in message


def fake_decoder(path, embeds_name: str) -> None:
    """A decoder-shaped graph whose embeddings input is called `embeds_name`."""
    def value(name, elem, shape):
        return helper.make_tensor_value_info(name, elem, shape)
    kv = ["batch", 4, "past", 48]
    inputs = [value(embeds_name, TensorProto.FLOAT, ["batch", "seq", 192]),
              value("attention_mask", TensorProto.INT64, ["batch", "total"]),
              value("position_ids", TensorProto.INT64, ["batch", "seq"]),
              value("past_key_values.0.key", TensorProto.FLOAT, kv),
              value("past_key_values.0.value", TensorProto.FLOAT, kv)]
    outputs = [value("logits", TensorProto.FLOAT, ["batch", "seq", 192]),
               value("present.0.key", TensorProto.FLOAT, kv),
               value("present.0.value", TensorProto.FLOAT, kv)]
    nodes = [helper.make_node("Identity", [embeds_name], ["logits"]),
             helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"]),
             helper.make_node("Identity", ["past_key_values.0.value"], ["present.0.value"])]
    model = helper.make_model(helper.make_graph(nodes, "decoder", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def test_fake_decoder_with_contract_names_loads(tmp_model):
    """The control for the next test: the stand-in graph itself is acceptable."""
    fake_decoder(tmp_model / "decoder_model_merged.onnx", "inputs_embeds")
    assert load_runtime(tmp_model).generator.layers == 1


def test_decoder_lacking_a_contract_input(tmp_model):
    fake_decoder(tmp_model / "decoder_model_merged.onnx", "input_embeds")
    message = refused(ModelError, load_runtime, tmp_model)
    assert "'inputs_embeds'" in message and "decoder_model_merged.onnx" in message
    assert "input_embeds" in message.replace("'inputs_embeds'", "")  # says what it has instead


def test_corrupt_onnx_file(tmp_model):
    (tmp_model / "vision_encoder.onnx").write_bytes(b"this is not a protobuf \x00\xff" * 10)
    message = refused(ModelError, load_runtime, tmp_model)
    assert "vision_encoder" in message and "vision_encoder.onnx" in message


def test_truncated_onnx_file(tmp_model):
    path = tmp_model / "decoder_model_merged.onnx"
    path.write_bytes(path.read_bytes()[:50_000])
    assert "decoder_model_merged.onnx" in refused(ModelError, load_runtime, tmp_model)


def test_a_tier_beyond_4096_px_a_side_is_refused(tmp_model):
    edit_yaml(tmp_model, lambda d: d["tiers"][next(iter(d["tiers"]))].update(height=100000))
    assert "more than 4096 px a side" in refused(ModelError, load_manifest, tmp_model)


@pytest.mark.parametrize("fixture, name", [
    ("gemma3-tiny", "onnx/vision_encoder.onnx"), ("gemma3-tiny", "config.json"),
    ("gemma3-tiny", "generation_config.json"),  # optional: still not to be taken for absent
    ("qwen2-vl-tiny", "chat_template.jinja"), ("qwen2-vl-tiny", "tokenizer.json"), (None, "model.yaml"),
])
def test_a_model_file_linked_to_dev_zero_is_named_as_what_it_is(tmp_path, model_dir, fixture, name):
    source = model_dir if fixture is None else Path(__file__).parent / "fixtures" / fixture
    folder = Path(shutil.copytree(source, tmp_path / "model"))
    (folder / name).unlink()
    (folder / name).symlink_to("/dev/zero")
    message = refused(ModelError, lambda: adapter_for(load_manifest(folder)))
    assert message == f"{folder / name}: path is a character device, not a regular file"


def test_a_graph_linked_to_dev_zero_is_named_when_its_precision_is_asked_for(tmp_model):
    (tmp_model / "vision_encoder.onnx").unlink()
    (tmp_model / "vision_encoder.onnx").symlink_to("/dev/zero")
    message = refused(ModelError, load_manifest(tmp_model).graph_path, "vision_encoder", "fp32")
    assert message == f"{tmp_model / 'vision_encoder.onnx'}: path is a character device, not a regular file"
