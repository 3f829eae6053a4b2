"""Typed runtime configuration, read from one YAML file.

Every key is optional; anything left out takes the default documented next to
its field below. Unknown keys, wrong types and out-of-range values are refused
with a one-line `ConfigError` naming the full key path, e.g.

    config: unknown key 'backend.thread' (known: intra_op_threads, name, providers, warmup)
    config: 'generation.max_new_tokens' must be an integer, got 'ten' (str)

The dict → dataclass conversion is generic (driven by each dataclass's fields
and type hints), so a new section is added by writing its dataclass, with an
optional `validate(self, path)` for ranges and choices, and adding it as a
field of `Config`.

Supported field types: bool, int, float (an int is accepted), str, list[T],
T | None, and nested dataclasses (given as mappings; an empty/null section
means all defaults). YAML `true` is not an int and `1` is not a bool.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from edgemm.errors import EdgemmError

__all__ = [
    "ConfigError", "ModelConfig", "BackendConfig", "LimitsConfig", "GenerationConfig",
    "Config", "load_config", "config_from_dict", "config_to_dict",
]

PRECISIONS = ("fp32", "int8", "fp16")
BACKENDS = ("onnxruntime", "tensorrt")
PROVIDERS = ("cpu", "cuda", "tensorrt")


class ConfigError(EdgemmError, ValueError):
    """A configuration problem; the message is one line starting with 'config'."""
    exit_code = 2
    kind = "config_error"

    def __init__(self, detail: str, file: str | os.PathLike | None = None):
        self.detail = detail
        self.file = None if file is None else os.fspath(file)
        super().__init__(f"config: {self.file}: {detail}" if file is not None else f"config: {detail}")


# ---- value checks used by the validate() methods ---------------------------------

def _show(value: Any) -> str:
    """`'ten' (str)`: a value as it appears in error messages, kept short."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _require(ok: bool, path: str, must: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{path!r} must {must}, got {value!r}")


def _choice(value: Any, choices: tuple[str, ...], path: str) -> None:
    _require(value in choices, path, f"be one of {', '.join(choices)}", value)


# ---- sections ------------------------------------------------------------------------

@dataclass
class ModelConfig:
    path: str | None = None  # model folder; null = the built-in models/tiny-vlm shipped with edgemm
    precision: str = "fp32"  # fp32 | int8 | fp16 (int8/fp16 load the *_int8.onnx / *_fp16.onnx variants)

    def validate(self, path: str) -> None:
        if self.path is not None:
            _require(self.path.strip() != "", f"{path}.path", "be a folder or null", self.path)
        _choice(self.precision, PRECISIONS, f"{path}.precision")


@dataclass
class BackendConfig:
    name: str = "onnxruntime"  # onnxruntime | tensorrt
    providers: list[str] = field(default_factory=lambda: ["cpu"])  # onnxruntime execution providers, most preferred first: cpu | cuda | tensorrt
    intra_op_threads: int = 0  # threads per onnxruntime session; 0 = onnxruntime decides
    warmup: bool = True  # run each graph once at load so the first request isn't slow

    def validate(self, path: str) -> None:
        _choice(self.name, BACKENDS, f"{path}.name")
        _require(len(self.providers) > 0, f"{path}.providers", "list at least one provider", self.providers)
        for i, provider in enumerate(self.providers):
            _choice(provider, PROVIDERS, f"{path}.providers[{i}]")
            _require(provider not in self.providers[:i], f"{path}.providers[{i}]", "not repeat an earlier provider", provider)
        _require(self.intra_op_threads >= 0, f"{path}.intra_op_threads", "be >= 0", self.intra_op_threads)


@dataclass
class LimitsConfig:
    max_pixels: int = 40_000_000  # images with more pixels (width x height) are refused before decoding
    max_image_bytes: int = 50 * 1024 * 1024  # larger encoded images are refused unread
    max_prompt_chars: int = 4000  # longer prompts are refused

    def validate(self, path: str) -> None:
        for name in ("max_pixels", "max_image_bytes", "max_prompt_chars"):
            _require(getattr(self, name) > 0, f"{path}.{name}", "be > 0", getattr(self, name))


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32  # most tokens generated per answer, 1..4096
    temperature: float = 0.0  # sampling temperature; 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1]; 1 = off
    seed: int | None = None  # sampling seed (>= 0) for reproducible answers; null = random
    tier: str | None = None  # resolution tier name (see the model's tiers); null = the model's top tier

    def validate(self, path: str) -> None:
        _require(1 <= self.max_new_tokens <= 4096, f"{path}.max_new_tokens", "be in 1..4096", self.max_new_tokens)
        _require(self.temperature >= 0, f"{path}.temperature", "be >= 0", self.temperature)
        _require(0 < self.top_p <= 1, f"{path}.top_p", "be in (0, 1]", self.top_p)
        if self.seed is not None:
            _require(self.seed >= 0, f"{path}.seed", "be >= 0 or null", self.seed)
        if self.tier is not None:
            _require(self.tier.strip() != "", f"{path}.tier", "be a tier name or null", self.tier)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)


# ---- generic dict -> dataclass conversion ------------------------------------------

_SCALARS = {bool: "a boolean (true/false)", int: "an integer", float: "a finite number", str: "a string"}


def _describe(hint: Any) -> str:
    """What a type hint accepts, for error messages: 'an integer or null'."""
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None)) + " or null"
    if typing.get_origin(hint) is list:
        return "a list of " + {str: "strings", int: "integers", float: "numbers",
                               bool: "booleans"}.get(args[0], "items")
    return _SCALARS[hint]


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _convert(value: Any, hint: Any, path: str, expected: str | None = None) -> Any:
    """Check `value` against type hint `hint`; return it in the field's type."""
    def wrong() -> ConfigError:
        return ConfigError(f"{path!r} must be {expected or _describe(hint)}, got {_show(value)}")

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"config field {path!r}: only 'X | None' unions are supported, not {hint}")
        return None if value is None else _convert(value, inner[0], path, _describe(hint))
    if dataclasses.is_dataclass(hint):
        if value is not None and not isinstance(value, Mapping):
            raise wrong()
        return _build(hint, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise wrong()
        return [_convert(item, args[0], f"{path}[{i}]") for i, item in enumerate(value)]
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    else:
        raise TypeError(f"config field {path!r}: unsupported type {hint}")
    if not ok:
        raise wrong()
    return value


def _finite(number: int | float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int too big for a float
        return False


def _build(cls: type, data: Any, path: str) -> Any:
    """Mapping → dataclass `cls`: missing keys take defaults, then cls.validate(path) runs."""
    if data is None:  # an empty section (`model:` with nothing under it) means all defaults
        data = {}
    if not isinstance(data, Mapping):  # nested sections are checked in _convert
        raise ConfigError(f"top level must be a mapping of sections, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in known:  # also catches non-string keys
            raise ConfigError(f"unknown key {_join(path, key)!r} (known: {', '.join(sorted(known))})")
        kwargs[key] = _convert(value, hints[key], _join(path, key))
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate(path)
    return obj


# ---- public API ----------------------------------------------------------------------

def config_from_dict(data: Mapping[str, Any] | None) -> Config:
    """Check a plain mapping (as parsed from YAML) and turn it into a `Config`."""
    return _build(Config, data, "")


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """`Config` → plain nested dict of YAML-safe values; `config_from_dict` reverses it."""
    return dataclasses.asdict(cfg)


def load_config(source: str | os.PathLike | Mapping[str, Any] | None = None) -> Config:
    """Defaults (None), a mapping taken as is, or a YAML file path.

    File problems (missing, unreadable, bad YAML, top level not a mapping) and
    every schema error are raised as `ConfigError` with the file's path in the
    message (and line:column for YAML syntax errors).
    """
    if source is None or isinstance(source, Mapping):
        return config_from_dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_config: expected a path, a mapping or None, got {type(source).__name__}")
    file = os.fspath(source)
    try:
        text = Path(file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", file) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text (byte {e.start})", file) from None
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror or e}", file) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        detail = f"invalid YAML: {problem}" + (f" ({context})" if context else "")
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else file
        raise ConfigError(" ".join(detail.split()), where) from None
    try:
        cfg = config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(e.detail, file) from None
    # a relative model folder means "next to this config file", not "wherever systemd started us"
    if cfg.model.path is not None and not Path(cfg.model.path).is_absolute():
        cfg.model.path = str(Path(file).resolve().parent / cfg.model.path)
    return cfg
