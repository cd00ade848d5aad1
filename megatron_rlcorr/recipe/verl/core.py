"""The mapper's core: `ImportResult` (what an import found) and `Mapper`, the bookkeeping every rule
reads and writes (the verl values, the recipe keys set so far, the report's three lists).

The rules (rules_model.py, rules_algorithm.py, rules_trainer.py, cluster.py) import this module and
mapper.py imports the rules, so this one imports none of them: mapper -> rules -> core.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .hydra import resolve_interpolations
from .source import Source
from .tables import DIFFERENCES
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
    """One import's state: the resolved verl values, the verl keys handled, the flat recipe keys set
    and the report's lists; the rules call its bookkeeping methods (mapper.map_source runs them)."""

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
