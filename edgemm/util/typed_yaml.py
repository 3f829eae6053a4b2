"""A mapping (as parsed from YAML) → nested dataclasses, checked against their type hints.

The conversion is generic, driven by each dataclass's fields and type hints: the config
(edgemm/config.py) is a tree of dataclasses, so a new section is added by writing its
dataclass, with an optional `validate(self, path)` for ranges and choices (using `require`
and `choice` below), and adding it as a field of `Config`. Every refusal is a one-line
`ConfigError` naming the full key path.

Supported field types: bool, int, float (an int is accepted), str, list[T], dict[str, T],
T | None, and nested dataclasses (given as mappings; an empty/null section means all
defaults; a dataclass with a `SHORTHAND` field name also takes a string, as that field).
YAML `true` is not an int and `1` is not a bool. A field typed `Any` takes several shapes
(backend.warmup): its section's validate() checks it.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from edgemm.errors import ConfigError
from edgemm.util.numbers import finite_number

# ---- value checks, for the sections' validate() methods ------------------------------

def show(value: Any) -> str:
    """`'ten' (str)`: a value as it appears in error messages, kept short."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def require(ok: bool, path: str, must: str, value: Any) -> None:
    """ConfigError "'path' must <must>, got <value>" unless `ok`."""
    if not ok:
        raise ConfigError(f"{path!r} must {must}, got {value!r}")


def choice(value: Any, choices: tuple[str, ...], path: str) -> None:
    """ConfigError naming the choices unless `value` is one of them."""
    require(value in choices, path, f"be one of {', '.join(choices)}", value)


# ---- generic dict -> dataclass conversion ------------------------------------------

_SCALARS = {bool: "a boolean (true/false)", int: "an integer", float: "a finite number", str: "a string"}


def _describe(hint: Any) -> str:
    """What a type hint accepts, for error messages: 'an integer or null'."""
    if dataclasses.is_dataclass(hint):
        shorthand = getattr(hint, "SHORTHAND", None)
        return f"a string (its {shorthand}) or a mapping" if shorthand else "a mapping"
    if typing.get_origin(hint) is dict:
        return "a mapping"
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None)) + " or null"
    if typing.get_origin(hint) is list:
        items = "mappings" if dataclasses.is_dataclass(args[0]) else "items"
        return "a list of " + {str: "strings", int: "integers", float: "numbers",
                               bool: "booleans"}.get(args[0], items)
    return _SCALARS[hint]


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _convert(value: Any, hint: Any, path: str, expected: str | None = None) -> Any:
    """Check `value` against type hint `hint`; return it in the field's type."""
    def wrong() -> ConfigError:
        return ConfigError(f"{path!r} must be {expected or _describe(hint)}, got {show(value)}")

    if hint is Any:  # a field of several shapes: its section's validate() checks it
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"config field {path!r}: only 'X | None' unions are supported, not {hint}")
        return None if value is None else _convert(value, inner[0], path, _describe(hint))
    if dataclasses.is_dataclass(hint):
        shorthand = getattr(hint, "SHORTHAND", None)
        if shorthand and isinstance(value, str):  # `person: is there a person ?` = {prompt: …}
            value = {shorthand: value}
        if value is not None and not isinstance(value, Mapping):
            raise wrong()
        return build(hint, value, path)
    if origin is dict:  # name → item (a stream's alerts): the names are strings
        if not isinstance(value, Mapping):
            raise wrong()
        for key in value:
            if not isinstance(key, str):
                raise ConfigError(f"{path!r} must have names as keys, got {show(key)}")
        return {key: _convert(item, args[1], _join(path, key)) for key, item in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise wrong()
        return [_convert(item, args[0], f"{path}[{i}]") for i, item in enumerate(value)]
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = finite_number(value)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
        if isinstance(value, bool):  # YAML 1.1 reads unquoted on/off/yes/no as booleans
            expected = f"a string (YAML read an unquoted on/off/yes/no as {str(value).lower()}: quote it)"
    else:
        raise TypeError(f"config field {path!r}: unsupported type {hint}")
    if not ok:
        raise wrong()
    return value


def build(cls: type, data: Any, path: str) -> Any:
    """Mapping → dataclass `cls`: missing keys take defaults, then cls.validate(path) runs."""
    if data is None:  # an empty section (`model:` with nothing under it) means all defaults
        data = {}
    if not isinstance(data, Mapping):  # nested sections are checked in _convert
        raise ConfigError(f"top level must be a mapping of sections, got {show(data)}")
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
