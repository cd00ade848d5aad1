"""The mapper: verl keys and values -> recipe keys, with the report's three lists.

Rules (rules_model.py, rules_algorithm.py, rules_trainer.py) run first, in order; each consumes
the verl keys it handles (`map`, `skip`, `derive`, `differ`). Then every key left is mapped by the
DIRECT table or reported with its UNMAPPED reason (tables.py), and last the cluster rule
(cluster.py) picks the layout for trainer.nnodes x n_gpus_per_node from the whole recipe.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from ..tree import apply_overrides
from .source import Source
from .hydra import resolve_interpolations
from .tables import DIFFERENCES, DIRECT, ORDER, build_tree, unmapped_reason
from .values import Bad, show


@dataclass
class ImportResult:
    """What `import_verl` found. Lists are in the order the verl keys appear in the source."""

    source: Path
    kind: str                                     # "script", "yaml" or "overrides"
    tree: dict[str, Any]                          # the recipe mapping, sections in recipe order
    mapped: list[tuple[str, str, Any]] = field(default_factory=list)   # (verl key, recipe key, value)
    differs: list[tuple[str, str]] = field(default_factory=list)       # (verl key, reason)
    unmapped: list[tuple[str, str]] = field(default_factory=list)      # (verl key, reason)
    launch: list[str] | None = None               # the launch command line of a script
    launch_args: int = 0                          # where verl's own arguments start in `launch`
    home: str = ""                                # what $HOME meant in the resolved values


class Mapper:
    def __init__(self, source: Source, overrides: Sequence[str] = ()) -> None:
        self.src = source
        self.overrides = list(overrides)          # recipe key=value set on top of the import (command line)
        self.values = resolve_interpolations(source.values)
        self.order = {key: i for i, key in enumerate(self.values)}
        self.done: set[str] = set()
        self.flat: dict[str, Any] = {}
        self.mapped: list[tuple[str, str, Any]] = []
        self.differs: list[tuple[str, str]] = []
        self.unmapped: list[tuple[str, str]] = list(source.notes)
        self.steps: int | None = None             # the run's length in RL steps, once rules_trainer knows it

    # -- bookkeeping --
    def has(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def convert(self, key: str, convert: Callable[[Any], Any]) -> Any:
        try:
            return convert(self.values[key])
        except Bad as bad:
            raise ValueError(f"{self.src.path}: {key}={show(self.values[key])}{self.src.where(key)}: expected {bad}"
                             ) from None

    def map(self, key: str, recipe_key: str, value: Any) -> None:
        self.done.add(key)
        self.flat[recipe_key] = value
        self.mapped.append((key, recipe_key, value))

    def skip(self, key: str, reason: str) -> None:
        self.done.add(key)
        self.unmapped.append((key, reason))

    def differ(self, key: str, concept: str) -> None:
        self.differs.append((key, DIFFERENCES[concept]))

    def derive(self, recipe_key: str, value: Any, why: str) -> None:
        """A recipe key that follows from the run rather than from one verl key."""
        self.flat[recipe_key] = value
        self.mapped.append((why, recipe_key, value))

    def unmap(self, key: str, reason: str) -> None:
        """Turn a mapped verl key into a "not mapped" line (a later rule superseded its value)."""
        self.mapped = [m for m in self.mapped if m[0] != key]
        self.unmapped.append((key, reason))

    def pending(self, key: str) -> bool:
        """The key is present, not yet handled, and not null (a null is reported here)."""
        if key not in self.values or key in self.done:
            return False
        if self.values[key] is None:
            self.skip(key, "null: verl's default applies there, this project's default here")
            return False
        return True

    def dapo_recipe(self) -> bool:
        """Launched as verl's DAPO recipe (recipe.dapo.main_dapo or its file)."""
        module = self.src.module()
        return module.startswith(("recipe.dapo.", "recipe/dapo/")) or "/recipe/dapo/" in module

    # -- the run --
    def run(self) -> ImportResult:
        from . import cluster, rules_algorithm, rules_model, rules_trainer

        self._unresolved()
        for rule in (*rules_model.RULES, *rules_algorithm.RULES, *rules_trainer.RULES):
            rule(self)
        for key in self.values:
            if key in DIRECT and self.pending(key):
                recipe_key, convert = DIRECT[key]
                self.map(key, recipe_key, self.convert(key, convert))
            elif key not in self.done and key not in cluster.KEYS:
                self.skip(key, unmapped_reason(key))
        for item in self.overrides:   # in recipe order where the table knows the key (apply_overrides sets it again)
            key, _, text = item.partition("=")
            if key.strip() in ORDER:
                self.flat[key.strip()] = yaml.safe_load(text)
        cluster.choose_layout(self)
        tree = apply_overrides(build_tree(self.flat), self.overrides)
        for item in self.overrides:
            key, _, text = item.partition("=")
            self.mapped.append(("(command line)", key.strip(), yaml.safe_load(text)))
        position = self._position
        return ImportResult(
            source=self.src.path, kind=self.src.kind, tree=tree,
            mapped=sorted(self.mapped, key=lambda m: position(m[0])),
            differs=sorted(self.differs, key=lambda d: position(d[0])),
            unmapped=sorted(self.unmapped, key=lambda u: position(u[0])),
            launch=self.src.launch, launch_args=self.src.launch_args, home=self.src.home)

    def _position(self, key: str) -> int:
        """Report order: notes about the command line first, then the source's order, derived entries last."""
        if key in self.order:
            return self.order[key]
        return len(self.order) if key.startswith("(") else -1

    def _unresolved(self) -> None:
        for key, value in self.values.items():
            if isinstance(value, str) and "${" in value:
                self.skip(key, f"the interpolation {value} refers to verl's base config, which is not read: set "
                               "the recipe key yourself")
            elif value == "???":
                self.skip(key, "a mandatory value left unset (???) in the config")
