"""A Hugging Face ONNX model folder → ModelManifest, without a model.yaml.

The layout SmolVLM and other VLMs are published in (transformers.js / Optimum):

    config.json  preprocessor_config.json  tokenizer.json  chat_template.{jinja,json}
    generation_config.json (optional)      processor_config.json (optional)
    onnx/vision_encoder[_q4|_quantized|_int8|_fp16|…].onnx  onnx/embed_tokens[...].onnx
    onnx/decoder_model_merged[...].onnx

What model.yaml spells out by hand is read from these files; what the graphs
declare (input names, KV dtypes, int widths) is read from the sessions later.
config.json's `model_type` picks the family (edgemm.model.family's registry), and the
family reads its own part (tiers, preprocessing, image and stop tokens) through the
`hf_folder` reader it registered.
"""
from __future__ import annotations

import json
from pathlib import Path

from edgemm.errors import ModelError
from edgemm.files import read_model_file
from edgemm.model.family import family_entry
from edgemm.model.manifest_types import ModelManifest, precisions_present as present_in_folder

ONNX_FILES = {"vision_encoder": "onnx/vision_encoder.onnx", "embed_tokens": "onnx/embed_tokens.onnx",
              "decoder": "onnx/decoder_model_merged.onnx"}
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "processor_config.json",
                       "tokenizer_config.json")


def read_json(path: Path, required: bool = True) -> dict:
    if not path.is_file():
        if required:
            raise ModelError(f"{path.parent} is a Hugging Face model folder without {path.name}")
        return {}
    try:
        data = json.loads(read_model_file(path))
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: top level must be an object")
    return data


def optional_json(path: Path, *names: str) -> list[dict]:
    """The folder's JSON files `names`, in order: {} for one the folder does not have."""
    return [read_json(path / name, required=False) for name in names]


def special_token(tokenizer_config: dict, key: str, default: str) -> str:
    """A named token of tokenizer_config.json (a string, or an AddedToken's dict; at the top
    level or under extra_special_tokens), or `default` where the folder names none."""
    extra = tokenizer_config.get("extra_special_tokens")
    value = tokenizer_config.get(key, extra.get(key) if isinstance(extra, dict) else None)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else default


def eos_token_ids(*configs: dict) -> list[int]:
    """The `eos_token_id` (one id or a list) of the first of `configs` that has one (a family
    passes generation_config.json first, then config.json or its parts), integers only."""
    eos = next((c["eos_token_id"] for c in configs if "eos_token_id" in c), [])
    return [int(e) for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]


def chat_template(path: Path) -> str:
    """The folder's chat template: chat_template.jinja, else the 'chat_template' key of the JSON files."""
    for name in CHAT_TEMPLATE_FILES:
        file = path / name
        if not file.is_file():
            continue
        if name.endswith(".jinja"):
            return read_model_file(file)
        template = read_json(file).get("chat_template")
        if isinstance(template, str):
            return template
    raise ModelError(f"{path}: no chat template (looked in {', '.join(CHAT_TEMPLATE_FILES)})")


def precisions_present(path: Path) -> list[str]:
    """Precisions whose three graphs are all there, by the layout's suffixes (_int8, _q4, _fp16 …)."""
    return present_in_folder(path, ONNX_FILES)


def load_hf_manifest(path: Path) -> ModelManifest:
    config = read_json(path / "config.json")
    entry = family_entry(config.get("model_type"), f"{path / 'config.json'}: unknown model_type",
                         hf_folder=True)
    for name in (*ONNX_FILES.values(), "tokenizer.json"):
        if not (path / name).is_file():
            raise ModelError(f"{path} is a Hugging Face model folder without {name}")
    assert entry.hf_folder is not None  # family_entry(hf_folder=True) only returns such families
    own = entry.hf_folder(path, config)
    text = config.get("text_config") or config  # a flat config.json (Qwen2-VL as published) has it at the top
    return ModelManifest(
        path=path, name=path.name, family=entry.name, files={**ONNX_FILES, "tokenizer": "tokenizer.json"},
        tiers=own.tiers, default_tier=own.default_tier or list(own.tiers)[-1], preprocessing=own.preprocessing,
        special_tokens={}, image_token=own.image_token, prompt_format="", stop_tokens=own.stop_tokens,
        max_context=int(text.get("max_position_embeddings", 8192)),
        precisions=precisions_present(path) or ["fp32"], chat_template=chat_template(path),
        family_config=own.family_config)
