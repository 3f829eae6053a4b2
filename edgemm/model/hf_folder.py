"""A Hugging Face ONNX model folder → ModelManifest, without a model.yaml.

The layout SmolVLM and other VLMs are published in (transformers.js / Optimum):

    config.json  preprocessor_config.json  tokenizer.json  chat_template.{jinja,json}
    generation_config.json (optional)      processor_config.json (optional)
    onnx/vision_encoder[_int8|_fp16].onnx  onnx/embed_tokens[...].onnx
    onnx/decoder_model_merged[...].onnx

What model.yaml spells out by hand is read from these files; what the graphs
declare (input names, KV dtypes, int widths) is read from the sessions later.
"""
from __future__ import annotations

import json
from pathlib import Path

from edgemm.errors import ModelError
from edgemm.model.manifest import PRECISIONS, ModelManifest, Preprocessing

ONNX_FILES = {"vision_encoder": "onnx/vision_encoder.onnx", "embed_tokens": "onnx/embed_tokens.onnx",
              "decoder": "onnx/decoder_model_merged.onnx"}
FAMILY_OF_MODEL_TYPE = {"idefics3": "idefics3", "smolvlm": "idefics3"}  # SmolVLM2 says "smolvlm"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "processor_config.json",
                       "tokenizer_config.json")


def read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise ModelError(f"{path.parent} is a Hugging Face model folder without {path.name}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: top level must be an object")
    return data


def chat_template(path: Path) -> str:
    """The folder's chat template: chat_template.jinja, else the 'chat_template' key of the JSON files."""
    for name in CHAT_TEMPLATE_FILES:
        file = path / name
        if not file.is_file():
            continue
        if name.endswith(".jinja"):
            return file.read_text(encoding="utf-8")
        template = read_json(file).get("chat_template")
        if isinstance(template, str):
            return template
    raise ModelError(f"{path}: no chat template (looked in {', '.join(CHAT_TEMPLATE_FILES)})")


def precisions_present(path: Path) -> list[str]:
    """Precisions whose three graphs are all there, by the _int8 / _fp16 suffix convention."""
    found = []
    for precision in PRECISIONS:
        suffix = "" if precision == "fp32" else f"_{precision}"
        if all((path / f.replace(".onnx", f"{suffix}.onnx")).is_file() for f in ONNX_FILES.values()):
            found.append(precision)
    return found


def load_hf_manifest(path: Path) -> ModelManifest:
    config = read_json(path / "config.json")
    model_type = config.get("model_type")
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if family is None:
        raise ModelError(f"{path / 'config.json'}: model_type {model_type!r} is not a family edgemm knows "
                         f"(known: {', '.join(sorted(FAMILY_OF_MODEL_TYPE))})")
    preprocessor = read_json(path / "preprocessor_config.json")
    for name in (*ONNX_FILES.values(), "tokenizer.json"):
        if not (path / name).is_file():
            raise ModelError(f"{path} is a Hugging Face model folder without {name}")
    precisions = precisions_present(path)
    from edgemm.model import idefics3  # the only tiled family so far
    family_config = idefics3.family_config(path, config, preprocessor,
                                           read_json(path / "processor_config.json", required=False),
                                           read_json(path / "generation_config.json", required=False))
    tiers = idefics3.tiers(family_config)
    text = config.get("text_config", {})
    return ModelManifest(
        path=path, name=path.name, family=family, files={**ONNX_FILES, "tokenizer": "tokenizer.json"},
        tiers=tiers, default_tier=list(tiers)[-1],
        preprocessing=Preprocessing(tuple(family_config["image_mean"]), tuple(family_config["image_std"]),
                                    "rgb", "tiles"),
        special_tokens={}, image_token=idefics3.IMAGE_TOKEN, prompt_format="",
        stop_tokens=[idefics3.END_OF_UTTERANCE], max_context=int(text.get("max_position_embeddings", 8192)),
        precisions=precisions or ["fp32"], chat_template=chat_template(path), family_config=family_config)
