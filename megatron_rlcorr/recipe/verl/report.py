"""The import's outputs: the recipe file (`recipe_yaml`, `write_recipe`) and the report's three
lists (`format_report`): mapped (verl key -> recipe key = value), meaning differs, not mapped."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

import yaml

from .core import ImportResult
from .values import show


def recipe_yaml(result: ImportResult) -> str:
    """The recipe file: a header naming the source, then the mapped keys in recipe order."""
    header = [f"# Imported from {result.source.resolve()} by `megatron-rlcorr import-verl`.",
              "# Check every path (model.hf_checkpoint, data.train_files, data.tokenizer) before a run: they are",
              "# the source's own" + (f", with $HOME = {result.home} and the working directory {os.getcwd()}."
                                      if result.kind == "script" else "."),
              "# Keys not written here take this project's defaults; the import report lists what was mapped,",
              "# what means something different here and what was not mapped."]
    body = yaml.safe_dump(result.tree, sort_keys=False, default_flow_style=False, width=100)
    return "\n".join(header) + "\n" + body


def write_recipe(result: ImportResult, out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and out.resolve() == result.source.resolve():
        raise ValueError(f"--out {out} is the verl source itself; write the recipe to another file")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give a file name such as {out / 'recipe.yaml'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(recipe_yaml(result))
    return out


def format_report(result: ImportResult) -> str:
    """Three lists: mapped (verl key -> recipe key = value), meaning differs, not mapped."""
    lines = [f"imported {result.source} ({result.kind})"]
    if result.launch:
        rest = len(result.launch) - result.launch_args
        lines.append(f"launch: {shlex.join(result.launch[:result.launch_args])} ... ({rest} arguments)")
    lines.append(f"mapped ({len(result.mapped)}):")
    lines += [f"  {verl} -> {ours} = {show(value)}" for verl, ours, value in result.mapped]
    lines.append(f"meaning differs ({len(result.differs)}):")
    lines += [f"  {verl}: {reason}" for verl, reason in result.differs]
    lines.append(f"not mapped ({len(result.unmapped)}):")
    lines += [f"  {verl}: {reason}" for verl, reason in result.unmapped]
    return "\n".join(lines)
