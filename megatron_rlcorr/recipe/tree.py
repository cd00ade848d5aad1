"""A recipe's YAML tree: the `base:` chain, section-wise merging and dotted `key=value` overrides.

The tree is plain data (dicts, lists, scalars as YAML parsed them); recipe.py turns it into the
settings types. Overrides are parsed as YAML values (`optim.lr=1e-4`, `x=null`, `y=[1, 2]`).
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml


def read_tree(path: Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The YAML tree of the recipe at `path` after its `base:` chain, with `overrides` applied."""
    return apply_overrides(_read_file(path, ()), overrides)


def _read_file(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """The YAML tree of `path`; a top-level `base: other.yaml` (relative to this file) is loaded
    first and this file's settings are merged over it (_merge_sections)."""
    if not path.is_file():
        raise ValueError(f"recipe {path} not found" + (f" (the base of {chain[-1]})" if chain else ""))
    if path.resolve() in chain:
        raise ValueError(f"recipe {path}: circular base chain {' -> '.join(map(str, chain))}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path} is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"recipe {path} must be a YAML mapping, got {type(tree).__name__}")
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str):
        raise ValueError(f"recipe {path}: base must be a path to another recipe, got {base!r}")
    return _merge_sections(_read_file(path.parent / base, (*chain, path.resolve())), tree)


def _merge_sections(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Sections merge key by key; a key's value replaces the base's whole (an
    algorithm.rollout_correction block is never half inherited)."""
    merged = dict(base)
    for section, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(section), Mapping):
            merged[section] = {**merged[section], **value}
        else:
            merged[section] = value
    return merged


def apply_overrides(tree: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested mapping, in place."""
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
        try:
            node[keys[-1]] = copy.deepcopy(_parse_value(text))
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"override {item!r}: its value is not valid YAML ({problem}); quote an override that "
                             "holds spaces as one shell word, e.g. 'data.reward={aime: dapo_math}'") from None
    return tree


@functools.lru_cache(maxsize=1024)
def _parse_value(text: str) -> Any:
    """An override's value as YAML parses it, parsed once per text (plan --search applies the same
    few layout overrides to hundreds of candidates); callers copy it, as it may be a list or mapping."""
    return yaml.safe_load(text)
