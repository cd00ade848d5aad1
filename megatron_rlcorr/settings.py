"""Settings dataclasses from YAML mappings, with errors that name the key and the fix.

Every settings type (the model's, the optimizer's, the rollout engine's, ...) lives beside the
code that consumes it and is built from its recipe section by `from_mapping`: unknown keys get
a "did you mean", missing required keys are named, values are checked against the field's
annotation (bool, int, float, str, Literal, Optional, list/tuple/dict, nested dataclasses), and
numeric strings from YAML ("1e-4") are accepted where a number is expected. A key a settings
type no longer takes is named in its `RETIRED_KEYS` (a class attribute: key -> what replaced it),
and meeting it stops with that explanation rather than a bare "unknown key". `check_choice` is the
one check of a Literal option used by the types' own validation.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Literal, Mapping, TypeVar, Union, get_args, get_origin, get_type_hints

from .config import did_you_mean

T = TypeVar("T")


def from_mapping(cls: type[T], mapping: Mapping[str, Any] | None, section: str) -> T:
    """cls(**mapping) after checking keys and value types; `section` prefixes error messages."""
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{section} must be a mapping of settings, got {type(mapping).__name__}: {mapping!r}")
    fields, hints = _fields_and_hints(cls)
    retired = getattr(cls, "RETIRED_KEYS", {})
    kwargs = {}
    for key, value in mapping.items():
        if key in retired:
            raise ValueError(f"{section}.{key}: {retired[key]}")
        if key not in fields:
            raise ValueError(f"unknown key {section}.{key}{did_you_mean(str(key), list(fields))}; "
                             f"allowed: {', '.join(fields)}")
        kwargs[key] = coerce(value, hints[key], f"{section}.{key}")
    missing = [name for name, f in fields.items() if name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{section} is missing required setting(s): {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ValueError(f"{section}: {err}") from None


@functools.cache
def _fields_and_hints(cls: type) -> tuple[dict[str, dataclasses.Field], dict[str, Any]]:
    """The init fields of a settings type and their resolved annotations: resolving them evaluates
    every annotation's string, so it is done once per type (a plan --search parses hundreds of recipes)."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init}, get_type_hints(cls)


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


def check_choice(name: str, value: Any, allowed: Any) -> None:
    """ValueError naming `name`, the allowed values and the closest one, unless `value` is one of
    `allowed` (a tuple of values or a Literal type)."""
    choices = get_args(allowed) if get_origin(allowed) is Literal else tuple(allowed)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
                         f"{did_you_mean(str(value), [str(c) for c in choices])}")
