"""Converting verl's values to recipe values: each converter returns the value or raises `Bad`
with what was expected (the mapper adds the file, key and line)."""
from __future__ import annotations

import json
import math
import re
from typing import Any


class Bad(Exception):
    """A verl value that cannot be converted; the message says what was expected."""


def show(value: Any) -> str:
    """A value as the report and the error messages print it (JSON, strings bare)."""
    return json.dumps(value) if not isinstance(value, str) else value


def to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise Bad("an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d+", value.strip()):
        return int(value)
    raise Bad("an integer")


def pos_int(value: Any) -> int:
    number = to_int(value)
    if number < 1:
        raise Bad("an integer >= 1")
    return number


def to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise Bad("a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise Bad("a number") from None
    if not math.isfinite(number):
        raise Bad("a finite number")
    return number


def to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise Bad("True or False")


def to_str(value: Any) -> str:
    if isinstance(value, (dict, list)) or value is None:
        raise Bad("a string")
    return str(value)


def str_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise Bad("a file path or a list of file paths")


def short(number: float) -> float:
    """A product of floats without binary noise in the YAML (0.1 * 1e-6 -> 1e-07)."""
    return float(f"{number:.12g}")



def minutes(value: Any) -> int:
    """Seconds (verl's nccl_timeout) -> whole minutes, rounded up."""
    seconds = pos_int(value)
    return -(-seconds // 60)
