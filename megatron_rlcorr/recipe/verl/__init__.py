"""Import a verl run into a recipe: `megatron-rlcorr import-verl SCRIPT_OR_YAML --out RECIPE.yaml [key=value ...]`.

Input: a verl run script (bash ending in `python3 -m verl.trainer.main_ppo a.b=c ...` or
`python3 -m recipe.dapo.main_dapo ...`, possibly behind `ray job submit ... --` or `torchrun`), a
verl YAML config (a nested mapping such as ppo_trainer.yaml's layout, or Hydra's list of override
strings), or a text file of `key=value` override lines; optionally recipe `key=value` overrides
set on top of the import (`model.architecture=qwen2.5-32b`, so the layout for the source's
cluster can be chosen before the checkpoint is on this machine). Output: `ImportResult` with the
recipe tree and three lists for the report: every verl key mapped (to which recipe key, with what
value), every key whose meaning differs here (the reasons are `DIFFERENCES`, one table the docs
can reuse), and every key not mapped (with why). Recipe keys not written keep this project's
defaults.

The parts, in the order they run:
- source.py: reading the source into verl keys (a script through the sandbox of verl_script.py,
  which runs it with nothing external executed); hydra.py: Hydra's value syntax and
  interpolations; values.py: converting values.
- core.py: the bookkeeping every rule uses (Mapper) and ImportResult; mapper.py: the run
  (map_source), which imports the rules; rules_model.py, rules_algorithm.py, rules_trainer.py:
  the rules for keys whose mapping depends on others; tables.py: the one-to-one keys, the reasons
  for keys not mapped and DIFFERENCES; datafiles.py: what the data files say (data sources, rows);
  cluster.py: the layout for trainer.nnodes x n_gpus_per_node, as `plan --search` chooses it.
- report.py: the recipe YAML and the report's text.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from .core import ImportResult
from .hydra import HydraLoader, parse_hydra_value
from .mapper import map_source
from .report import format_report, recipe_yaml, write_recipe
from .source import read_source
from .tables import DIFFERENCES

__all__ = ["DIFFERENCES", "HydraLoader", "ImportResult", "format_report", "import_verl", "parse_hydra_value",
           "recipe_yaml", "write_recipe"]


def import_verl(path: str | Path, env: Mapping[str, str] | None = None,
                overrides: Sequence[str] = ()) -> ImportResult:
    """Read a verl run script, YAML config or override file and map it onto a recipe.

    env: the environment a script runs with (default: this process's); with a mapping, exactly
    those variables (the sandbox sets PATH and HOME itself; env's HOME, else this process's, is what
    $HOME means in the resolved values). overrides: recipe `key=value` set on top of the import
    (e.g. model.architecture=qwen2.5-32b), before the layout is chosen.
    """
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ValueError(f"override {item!r}: expected a recipe key=value (e.g. model.architecture=qwen2.5-32b)")
    return map_source(read_source(Path(path), env), overrides)
