"""The mapper: verl keys and values -> recipe keys, with the report's three lists (`map_source`).

Rules (rules_model.py, rules_algorithm.py, rules_trainer.py) run first, in order; each consumes
the verl keys it handles (`map`, `skip`, `derive`, `differ`: the bookkeeping of core.py). Then every
key left is mapped by the DIRECT table or reported with its UNMAPPED reason (tables.py), and last
the cluster rule (cluster.py) picks the layout for trainer.nnodes x n_gpus_per_node from the whole
recipe. Values the recipe cannot take as they are (an interpolation of verl's base config, ???, an
empty string such as a script's empty variable) are reported first and left unset.
"""
from __future__ import annotations

from typing import Sequence

import yaml

from ..tree import apply_overrides
from . import cluster, rules_algorithm, rules_model, rules_trainer
from .core import ImportResult, Mapper
from .source import Source
from .tables import DIRECT, ORDER, build_tree, unmapped_reason

__all__ = ["ImportResult", "Mapper", "map_source"]


def map_source(source: Source, overrides: Sequence[str] = ()) -> ImportResult:
    """Map `source`'s verl keys onto a recipe; `overrides` (recipe key=value) are set on top."""
    m = Mapper(source, overrides)
    _skip_unresolved(m)
    for rule in (*rules_model.RULES, *rules_algorithm.RULES, *rules_trainer.RULES):
        rule(m)
    for key in m.values:
        if key in DIRECT and m.pending(key):
            recipe_key, convert = DIRECT[key]
            m.map(key, recipe_key, m.convert(key, convert))
        elif key not in m.done and key not in cluster.KEYS:
            m.skip(key, unmapped_reason(key))
    for item in m.overrides:   # in recipe order where the table knows the key (apply_overrides sets it again)
        key, _, text = item.partition("=")
        if key.strip() in ORDER:
            m.flat[key.strip()] = yaml.safe_load(text)
    cluster.choose_layout(m)
    tree = apply_overrides(build_tree(m.flat), m.overrides)
    for item in m.overrides:
        key, _, text = item.partition("=")
        m.mapped.append(("(command line)", key.strip(), yaml.safe_load(text)))

    def position(key: str) -> int:
        """Report order: notes about the command line first, then the source's order, derived entries last."""
        if key in m.order:
            return m.order[key]
        return len(m.order) if key.startswith("(") else -1

    return ImportResult(
        source=m.src.path, kind=m.src.kind, tree=tree,
        mapped=sorted(m.mapped, key=lambda e: position(e[0])),
        differs=sorted(m.differs, key=lambda d: position(d[0])),
        unmapped=sorted(m.unmapped, key=lambda u: position(u[0])),
        launch=m.src.launch, launch_args=m.src.launch_args, home=m.src.home)


def _skip_unresolved(m: Mapper) -> None:
    for key, value in m.values.items():
        if isinstance(value, str) and "${" in value:
            m.skip(key, f"the interpolation {value} refers to verl's base config, which is not read: set "
                        "the recipe key yourself")
        elif value == "???":
            m.skip(key, "a mandatory value left unset (???) in the config")
        elif value == "" or value == [""]:
            target = f"{DIRECT[key][0]} is" if key in DIRECT else "the recipe keys it maps to are"
            m.skip(key, f"empty in the source (a variable of the script left empty?): not imported, so {target} "
                        "unset here (this project's default, or required): set it in the recipe")
