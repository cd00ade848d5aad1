"""Hydra's syntax as verl's launches and configs use it: override arguments and their values.

- `HydraLoader` / `parse_hydra_value`: the value of `key=TEXT` as Hydra/OmegaConf reads it: a
  YAML scalar, flow list or mapping, except that bools are only true/false (any case), `1e-6` is a
  float (YAML 1.1 wants a dot) and `yes`/`no`/`on`/`off` stay strings; `key=` is ''.
- `OVERRIDE`: `a.b=v`, `+a.b=v`, `++a.b=v`, `~a.b` (delete).
- `flatten`: a nested config mapping as dotted keys (`_target_`, Hydra's instantiation key, dropped).
- `resolve_interpolations`: whole-value `${a.b}` and `${oc.select:a.b,default}` references.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import yaml

OVERRIDE = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][\w\-]*(?:\.[\w\-]+)*)(=(.*))?$", re.DOTALL)
_INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?([\w.\-]+)(?:,(.*))?\}$", re.DOTALL)


class HydraLoader(yaml.SafeLoader):
    """YAML as Hydra/OmegaConf read override values (module docstring)."""


HydraLoader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
HydraLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))
HydraLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_hydra_value(text: str) -> Any:
    """The value of a Hydra override `key=TEXT`: a YAML scalar, flow list or mapping; `key=` is ''."""
    if not text.strip():
        return ""
    return yaml.load(text, Loader=HydraLoader)


def flatten(node: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    """`node`'s leaves into `out` as dotted keys under `prefix` (empty mappings are leaves)."""
    for key, value in node.items():
        if key == "_target_":
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flatten(value, dotted + ".", out)
        else:
            out[dotted] = value


def resolve_interpolations(values: dict[str, Any]) -> dict[str, Any]:
    """`${a.b}` / `${oc.select:a.b,default}` whole-value references to other keys, resolved."""
    out = dict(values)
    for _ in range(8):  # chains of references
        changed = False
        for key, value in out.items():
            match = _INTERPOLATION.match(value) if isinstance(value, str) else None
            if match and (match.group(1) in out or match.group(2) is not None):
                target = out.get(match.group(1))
                if target is None and match.group(2) is not None:
                    target = parse_hydra_value(match.group(2))
                if target != value:
                    out[key], changed = target, True
        if not changed:
            break
    return out
