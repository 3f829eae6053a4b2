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
from edgemm.util.files import read_model_file, regular_file_present
from edgemm.model.family import family_entry
from edgemm.model.manifest_types import (PRECISIONS, ModelManifest, ResolutionTier, describe_graphs,
                                         precisions_present as present_in_folder, variant_file)
from edgemm.util.numbers import finite_number

ONNX_FILES = {"vision_encoder": "onnx/vision_encoder.onnx", "embed_tokens": "onnx/embed_tokens.onnx",
              "decoder": "onnx/decoder_model_merged.onnx"}
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "processor_config.json",
                       "tokenizer_config.json")
# docs/limits.md's promise: the model never sees more than 4096 px a side, so no folder may ask
# for a resize beyond it (a 100000x100000 target would need 28 GiB before any check ran)
MAX_IMAGE_SIDE = 4096
MAX_IMAGE_PIXELS = MAX_IMAGE_SIDE * MAX_IMAGE_SIDE
FLOAT16_MAX = 65504.0  # the largest normalised pixel value an fp16 graph can take


class JsonObject(dict):
    """A JSON object of a model folder's file that knows where it is (the file, and the keys
    above it). Its typed accessors are how the families read values: a value of the wrong
    type or out of range is a one-line ModelError naming the file and the key
    ("DIR/config.json: text_config must be an object"), the exit code of a broken folder.
    An absent key or a JSON null takes the default."""

    def __init__(self, data: dict, file: Path, prefix: str = ""):
        super().__init__(data)
        self.file = file
        self.prefix = prefix

    def __contains__(self, key: object) -> bool:
        """A key holding null is absent, for `in` as for the accessors: it takes the default."""
        return dict.get(self, key) is not None

    def refuse(self, key: str, needs: str, value: object = None) -> ModelError:
        got = f" (got {json.dumps(value)[:60]})" if value is not None else ""
        return ModelError(f"{self.file}: {self.prefix}{key} must be {needs}{got}")

    def _value(self, key: str, default: object, needs: str) -> object:
        value = self.get(key)
        if value is None:
            if default is None:
                raise ModelError(f"{self.file}: needs {self.prefix}{key}, {needs}")
            return default
        return value

    def object(self, key: str) -> JsonObject:
        """The object under `key` ({} where absent)."""
        value = self.get(key)
        if value is not None and not isinstance(value, dict):
            raise self.refuse(key, "an object", value)
        return JsonObject(value or {}, self.file, f"{self.prefix}{key}.")

    def integer(self, key: str, default: int | None = None, least: int = 1, most: int | None = None) -> int:
        """An integer from `least` to `most`; without a default the key is required."""
        bounds = f"an integer from {least} to {most}" if most is not None else f"an integer of at least {least}"
        value = self._value(key, default, bounds)
        if not isinstance(value, int) or isinstance(value, bool) or value < least or (most is not None and value > most):
            raise self.refuse(key, bounds, value)
        return value

    def side(self, key: str, default: int | None = None) -> int:
        """An image side in pixels that the folder resizes to: 1 … MAX_IMAGE_SIDE."""
        return self.integer(key, default, most=MAX_IMAGE_SIDE)

    def number(self, key: str, default: float | None = None, positive: bool = False,
               most: float | None = None) -> float:
        """A finite number (above 0 if `positive`, at most `most`)."""
        needs = "a finite number" + (" above 0" if positive else "") + (f" and at most {most:g}" if most else "")
        value = self._value(key, default, needs)
        if not finite_number(value) or (positive and value <= 0) or (most is not None and value > most):
            raise self.refuse(key, needs, value)
        return float(value)

    def string(self, key: str, default: str) -> str:
        """A string that is not empty."""
        value = self._value(key, default, "a string")
        if not isinstance(value, str) or not value:
            raise self.refuse(key, "a string that is not empty", value)
        return value

    def numbers(self, key: str, default: list[float], count: int, positive: bool = False) -> list[float]:
        """`count` finite numbers (above 0 if `positive`); one number stands for all of them, as
        transformers' image processors read an image_mean of one value."""
        needs = f"{count} finite numbers{' above 0' if positive else ''}"
        value = self._value(key, default, needs)
        values = [value] * count if finite_number(value) else value
        if not (isinstance(values, list) and len(values) == count
                and all(finite_number(v) and (v > 0 or not positive) for v in values)):
            raise self.refuse(key, needs, value)
        return [float(v) for v in values]

    def flag(self, key: str, default: bool) -> bool:
        """true or false."""
        value = self._value(key, default, "true or false")
        if not isinstance(value, bool):
            raise self.refuse(key, "true or false", value)
        return value


def present(file: Path) -> bool:
    """Whether the folder has `file` (a regular file); a ModelError saying what is there instead
    for anything else (a link to /dev/zero, a FIFO, a folder)."""
    return regular_file_present(file, lambda detail: ModelError(f"{file}: {detail}"))


def read_json(path: Path, required: bool = True) -> JsonObject:
    if not present(path):
        if required:
            raise ModelError(f"{path.parent} is a Hugging Face model folder without {path.name}")
        return JsonObject({}, path)
    try:
        data = json.loads(read_model_file(path))
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: top level must be an object")
    return JsonObject(data, path)


def optional_json(path: Path, *names: str) -> list[JsonObject]:
    """The folder's JSON files `names`, in order: {} for one the folder does not have."""
    return [read_json(path / name, required=False) for name in names]


def pixel_normalisation(preprocessor: JsonObject, mean: list[float], std: list[float],
                        rescaled: bool = True) -> dict[str, float | list[float]]:
    """preprocessor_config.json's rescale_factor, image_mean and image_std (`mean`, `std` where
    absent) as a family_config's keys, checked: a factor in (0, 1], three finite numbers each,
    the std above 0, and together within float16's range for every pixel value (what an fp16
    graph takes; beyond it a pixel is inf and the answer non-finite logits). `rescaled`: False
    where the family leaves the 0…255 values unscaled (do_rescale false)."""
    values = {"rescale_factor": preprocessor.number("rescale_factor", 1 / 255, positive=True, most=1),
              "image_mean": preprocessor.numbers("image_mean", mean, 3),
              "image_std": preprocessor.numbers("image_std", std, 3, positive=True)}
    brightest = 255 * (values["rescale_factor"] if rescaled else 1)
    widest = max(max(abs(m), abs(brightest - m)) / s for m, s in zip(values["image_mean"], values["image_std"]))
    largest = max(abs(v) for v in (*values["image_mean"], *values["image_std"]))
    if widest > FLOAT16_MAX or largest > FLOAT16_MAX:
        raise ModelError(f"{preprocessor.file}: image_mean and image_std make a pixel {widest:.3g} (and are up to "
                         f"{largest:.3g}), beyond float16's ±{FLOAT16_MAX:g}")
    return values


def special_token(tokenizer_config: JsonObject, key: str, default: str) -> str:
    """A named token of tokenizer_config.json (a string, or an AddedToken's dict; at the top
    level or under extra_special_tokens), or `default` where the folder names none (absent,
    null or ""). Anything else (a number, a list, a dict without a string `content`) is a
    broken folder: a ModelError naming the file and the key, as transformers refuses it too."""
    extra = tokenizer_config.get("extra_special_tokens")
    where, value = key, tokenizer_config.get(key)
    if value is None and isinstance(extra, dict):  # a list there names no token by key
        where, value = f"extra_special_tokens.{key}", extra.get(key)
    token = value.get("content") if isinstance(value, dict) else value
    if not isinstance(token, str) and (token is not None or isinstance(value, dict)):
        raise tokenizer_config.refuse(where, "a string or an object with a string content", value)
    return token or default


def eos_token_ids(*configs: JsonObject) -> list[int]:
    """The `eos_token_id` (one id or a list) of the first of `configs` that has one (a family
    passes generation_config.json first, then config.json or its parts); anything but token
    ids is a ModelError naming the file."""
    config = next((c for c in configs if c.get("eos_token_id") is not None), None)
    if config is None:
        return []
    eos = config["eos_token_id"]
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
        raise config.refuse("eos_token_id", "a token id or a list of them", eos)
    return ids


def chat_template(path: Path) -> tuple[str, Path]:
    """The folder's chat template and the file it is in: chat_template.jinja, else the
    'chat_template' key of the JSON files."""
    for name in CHAT_TEMPLATE_FILES:
        file = path / name
        if not present(file):
            continue
        if name.endswith(".jinja"):
            return read_model_file(file), file
        template = read_json(file).get("chat_template")
        if isinstance(template, str):
            return template, file
    raise ModelError(f"{path}: no chat template (looked in {', '.join(CHAT_TEMPLATE_FILES)})")


def check_graphs(path: Path) -> None:
    """Each graph needs its file in at least one precision, any one (transformers.js loads a folder
    of only `onnx/decoder_model_merged_q4.onnx` and the other two in q4); a graph in none is one
    line naming what each graph has. A variant's path that is there but no regular file (a link
    to /dev/zero, a FIFO) is refused as such."""
    by_graph = {component: [p for p in PRECISIONS if present(variant_file(path / name, p))]
                for component, name in ONNX_FILES.items()}
    missing = [ONNX_FILES[c] for c, found in by_graph.items() if not found]
    if missing:
        raise ModelError(f"{path} is a Hugging Face model folder without {' or '.join(missing)} in any "
                         f"precision (per graph: {describe_graphs(by_graph)})")


def precisions_present(path: Path) -> list[str]:
    """Precisions whose three graphs are all there, by the layout's suffixes (_int8, _q4, _fp16 …)."""
    return present_in_folder(path, ONNX_FILES)


def load_hf_manifest(path: Path) -> ModelManifest:
    config = read_json(path / "config.json")
    entry = family_entry(config.get("model_type"), f"{path / 'config.json'}: unknown model_type",
                         hf_folder=True)
    check_graphs(path)
    if not present(path / "tokenizer.json"):
        raise ModelError(f"{path} is a Hugging Face model folder without tokenizer.json")
    assert entry.hf_folder is not None  # family_entry(hf_folder=True) only returns such families
    own = entry.hf_folder(path, config)
    # a flat config.json (Qwen2-VL as published) has the text model's keys at the top
    text = config.object("text_config") if config.get("text_config") is not None else config
    max_context = text.integer("max_position_embeddings", 8192)
    check_context(path, own.tiers, max_context)
    template, template_file = chat_template(path)
    return ModelManifest(
        path=path, name=path.name, family=entry.name, files={**ONNX_FILES, "tokenizer": "tokenizer.json"},
        tiers=own.tiers, default_tier=own.default_tier or list(own.tiers)[-1], preprocessing=own.preprocessing,
        special_tokens={}, image_token=own.image_token, prompt_format="", stop_tokens=own.stop_tokens,
        max_context=max_context,
        precisions=precisions_present(path), chat_template=template,
        chat_template_file=template_file,
        family_config=own.family_config)


def check_context(path: Path, tiers: dict[str, ResolutionTier], max_context: int,
                  context_from: str = "config.json max_position_embeddings") -> None:
    """Refuse, at load, a folder whose richest tier's image tokens leave no room in the context:
    every request at that tier would only fail after its image was prepared and encoded."""
    richest = max(tiers.values(), key=lambda t: t.image_tokens)
    if richest.image_tokens >= max_context:
        raise ModelError(f"{path}: tier {richest.name} gives {richest.image_tokens} image tokens, more than "
                         f"the model's context of {max_context} ({context_from}) holds")
