"""model.yaml → ModelManifest: what a model folder holds and how to feed it.

The manifest is the model's side of the model contract (docs/ARCHITECTURE.md, "The model contract"):
file names, resolution tiers, preprocessing, special tokens and prompt format.
Every problem is reported with the folder and the key, so a user fixing a
model folder by hand knows where to look.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from edgemm.errors import ModelError
from edgemm.util.files import load_yaml, read_model_file
from edgemm.model.hf_folder import FLOAT16_MAX, MAX_IMAGE_SIDE, check_context, load_hf_manifest
# The dataclasses live in manifest_types (hf_folder and the families use them too); they
# are named here as well because this is where callers have always imported them from.
from edgemm.model.manifest_types import (COMPONENTS, PRECISIONS, ModelManifest, Preprocessing, ResolutionTier,
                                         precisions_present)
from edgemm.util.numbers import finite_number

__all__ = ["COMPONENTS", "PRECISIONS", "ModelManifest", "Preprocessing", "ResolutionTier", "load_manifest"]

# What model.yaml's preprocessing may say: the built-in family feeds RGB, stretched to the tier.
COLORS = ("rgb",)
RESIZES = ("stretch",)
# The largest max_context taken: beyond any model's context today (1M tokens), where a typo of
# a few digits more would size engine profiles and limits for a context no graph has.
MAX_CONTEXT = 1 << 20
DECODER_SIZES = ("layers", "heads", "head_dim", "hidden_size", "vocab_size")


def _require(data: dict, key: str, kind: type, where: str):
    if key not in data:
        raise ModelError(f"{where}: missing key '{key}'")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ModelError(f"{where}: '{key}' must be {kind.__name__}, got {type(value).__name__}")
    return value


def _tiers(raw: dict, where: str) -> dict[str, ResolutionTier]:
    tiers = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict):
            raise ModelError(f"{where}: tiers.{name} must be a mapping with height, width, image_tokens")
        dims = [_require(spec, k, int, f"{where}: tiers.{name}") for k in ("height", "width", "image_tokens")]
        if min(dims) <= 0:
            raise ModelError(f"{where}: tiers.{name} values must be positive")
        if max(dims[:2]) > MAX_IMAGE_SIDE:  # docs/limits.md's promise, as for a Hugging Face folder
            raise ModelError(f"{where}: tiers.{name} is {dims[0]}x{dims[1]}, more than {MAX_IMAGE_SIDE} px a side")
        tiers[str(name)] = ResolutionTier(str(name), *dims)
    if not tiers:
        raise ModelError(f"{where}: 'tiers' is empty")
    return dict(sorted(tiers.items(), key=lambda kv: kv[1].pixels))


def _normalisation(pre: dict, where: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """preprocessing.mean and .std: 3 finite numbers each, the std above 0 (YAML's .nan and .inf
    are floats, and `std <= 0` is false for NaN), and together within float16's range for
    every pixel value (x / 255 - mean) / std, as a Hugging Face folder's image_mean and image_std."""
    mean, std = pre.get("mean", [0.5] * 3), pre.get("std", [0.5] * 3)
    if not all(isinstance(v, list) and len(v) == 3 and all(finite_number(x) for x in v) for v in (mean, std)) \
            or min(std) <= 0:
        raise ModelError(f"{where}: preprocessing.mean and .std must be lists of 3 finite numbers, std > 0")
    widest = max(max(abs(m), abs(1 - m)) / s for m, s in zip(mean, std))
    if widest > FLOAT16_MAX:
        raise ModelError(f"{where}: preprocessing.mean and .std make a pixel {widest:.3g}, beyond float16's "
                         f"±{FLOAT16_MAX:g}")
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def _strings(data: dict, key: str, default: list[str], where: str) -> list[str]:
    """A list of strings that are not empty (a token, a precision): `default` where absent."""
    value = data.get(key, default)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ModelError(f"{where}: '{key}' must be a list of strings")
    return value


def load_manifest(model_dir: str | Path) -> ModelManifest:
    """model.yaml, else a Hugging Face folder (config.json + preprocessor_config.json + onnx/)."""
    path = Path(model_dir)
    yaml_path = path / "model.yaml"
    if not path.is_dir():
        raise ModelError(f"model folder not found: {path}")
    # lexists, not is_file: a model.yaml or config.json that is a link to /dev/zero is read, and
    # refused as what it is, instead of being taken for absent
    if not os.path.lexists(yaml_path) and os.path.lexists(path / "config.json"):
        return load_hf_manifest(path)
    if not os.path.lexists(yaml_path):
        raise ModelError(f"{path} is not a model folder: model.yaml not found")
    where = str(yaml_path)
    try:
        data = load_yaml(read_model_file(yaml_path))
    except yaml.YAMLError as e:
        raise ModelError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{where}: top level must be a mapping")

    files = _require(data, "files", dict, where)
    for component in (*COMPONENTS, "tokenizer"):
        _require(files, component, str, f"{where}: files")
    tiers = _tiers(_require(data, "tiers", dict, where), where)
    default_tier = data.get("default_tier", list(tiers)[-1])
    if not isinstance(default_tier, str) or default_tier not in tiers:
        raise ModelError(f"{where}: default_tier {default_tier!r} is not one of {', '.join(tiers)}")
    pre = data.get("preprocessing", {}) or {}
    if not isinstance(pre, dict):
        raise ModelError(f"{where}: 'preprocessing' must be a mapping")
    mean, std = _normalisation(pre, where)
    for key, known in (("color", COLORS), ("resize", RESIZES)):
        if not isinstance(pre.get(key, known[0]), str):
            raise ModelError(f"{where}: preprocessing.{key} must be str, got {type(pre[key]).__name__}")
        if pre.get(key, known[0]) not in known:
            raise ModelError(f"{where}: preprocessing.{key} {pre[key]!r} is not one of {', '.join(known)}")
    special = _require(data, "special_tokens", dict, where)
    for key in ("bos", "eos"):
        _require(special, key, str, f"{where}: special_tokens")
    for key in special:  # each is looked up in the tokenizer: a number there was a TypeError at load
        _require(special, key, str, f"{where}: special_tokens")
    prompt_format = _require(data, "prompt_format", str, where)
    image_token = _require(data, "image_token", str, where)
    if "{prompt}" not in prompt_format or image_token not in prompt_format:
        raise ModelError(f"{where}: prompt_format must contain {{prompt}} and the image token {image_token}")
    if image_token in special.values():  # '<bos>' is in the prompt format, but as the bos token
        named = next(key for key, token in special.items() if token == image_token)
        raise ModelError(f"{where}: image_token {image_token!r} must be a token of its own, not special_tokens.{named}")
    declared = _strings(data, "precisions", ["fp32"], where)
    unknown = [p for p in declared if p not in PRECISIONS]
    if unknown:
        raise ModelError(f"{where}: unknown precision(s) {unknown} (known: {', '.join(PRECISIONS)})")
    # what the folder holds, by the files' suffixes, as in a Hugging Face folder: a variant made
    # later (tools/quantize.py --variant q4) is usable without editing model.yaml
    precisions = precisions_present(path, files)
    max_context = _require(data, "max_context", int, where)
    if not 2 <= max_context <= MAX_CONTEXT:
        raise ModelError(f"{where}: max_context {max_context} must be an integer from 2 to {MAX_CONTEXT}")
    check_context(yaml_path, tiers, max_context, "max_context")
    return ModelManifest(
        path=path, name=str(data.get("name", path.name)), family=_require(data, "family", str, where),
        files=files, tiers=tiers, default_tier=default_tier,
        preprocessing=Preprocessing(mean, std, pre.get("color", "rgb"), pre.get("resize", "stretch")),
        special_tokens=special, image_token=image_token, prompt_format=prompt_format,
        stop_tokens=_strings(data, "stop_tokens", [special["eos"]], where),
        max_context=max_context, precisions=precisions, decoder=_decoder(data, where))


def _decoder(data: dict, where: str) -> dict:
    """model.yaml's `decoder:` sizes, for the reader (the runtime takes them from the graph): each
    one given a positive integer."""
    decoder = dict(_require(data, "decoder", dict, where) if data.get("decoder") else {})
    for key in DECODER_SIZES:
        value = decoder.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelError(f"{where}: decoder.{key} {value!r} must be a positive integer")
    return decoder
