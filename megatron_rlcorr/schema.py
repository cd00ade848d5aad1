"""Building dataclasses from YAML mappings with errors that name the key and the fix.

Used by every recipe section: unknown keys get a "did you mean", values are checked against the
field's annotation (bool, int, float, str, Literal, Optional, list/tuple/dict), and numeric
strings from YAML ("1e-4") are accepted where a number is expected.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Mapping, TypeVar, Union, get_args, get_origin, get_type_hints

from .config import did_you_mean

T = TypeVar("T")


def from_mapping(cls: type[T], mapping: Mapping[str, Any] | None, section: str) -> T:
    """cls(**mapping) after checking keys and value types; `section` prefixes error messages."""
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{section} must be a mapping of settings, got {type(mapping).__name__}: {mapping!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in mapping.items():
        if key not in fields:
            raise ValueError(f"unknown key {section}.{key}{did_you_mean(str(key), list(fields))}; "
                             f"allowed: {', '.join(fields)}")
        kwargs[key] = coerce(value, hints[key], f"{section}.{key}")
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ValueError(f"{section}: {err}") from None


def coerce(value: Any, annotation: Any, name: str) -> Any:
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce(value, option, name)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if len(errors) == 1 else f"{name}: {value!r} matches none of {annotation}")
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, args))}, got {value!r}"
                             f"{did_you_mean(str(value), [str(a) for a in args])}")
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {value!r}")
        item = args[0] if args else Any
        return origin(coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value))
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(annotation):
        return from_mapping(annotation, value, name)
    return value


def apply_overrides(tree: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested mapping, in place."""
    import yaml

    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. trainer.steps=10)")
        path, text = item.split("=", 1)
        keys = path.split(".")
        node = tree
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {key} is not a section")
            node = child
        node[keys[-1]] = yaml.safe_load(text)
    return tree
