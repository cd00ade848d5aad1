"""What `--model SRC` names (`score`, `export`): a model to build, with its recipe and its weights.

SRC is one of
- a Hugging Face checkpoint directory (config.json + safetensors): the model is built from it
  under any parallel layout (`model.hf_checkpoint`), each rank reading only its shards;
- a run directory (`runs/<name>`, written by `train`): its latest checkpoint;
- one checkpoint of a run (`runs/<name>/checkpoints/step_N`).
A run checkpoint (Megatron-Core's distributed format, training/checkpoint.py) loads under any
parallel layout; a per-rank one from before that format loads on the layout that wrote it, which
`checkpoint_layout` gives, and another layout is refused with the fix named.

The recipe: for a Hugging Face SRC, the model section holds `hf_checkpoint: SRC` plus the
non-architecture keys of `--config`'s model section (precision, FP8, ...), so a recipe written
for another model still lends its rollout, correction and trainer settings; for a run, the run's
own recipe.yaml (its model and parallel sections always: the model describes the weights, the
parallel section is the default layout, which `parallel.*` overrides may change). Dotted
overrides apply last.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Sequence

import yaml

from ..model.architecture import DecoderShape
from ..model.hf_config import CONFIG_FILE
from ..training import checkpoint
from .recipe import Recipe, parse_recipe
from .tree import apply_overrides, read_tree

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups

# The keys that describe one checkpoint (its tokenizer's rows too): never lent to another model.
_ARCHITECTURE_KEYS = ({f.name for f in dataclasses.fields(DecoderShape)}
                      | {"max_position_embeddings", "token_vocab_size"})
_SRC_KINDS = ("a Hugging Face checkpoint directory (with config.json), a run directory (runs/<name>, "
              "with checkpoints/) or one of its checkpoints (runs/<name>/checkpoints/step_N)")


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf", "checkpoint"]
    path: Path                 # the Hugging Face directory, or the run directory
    step: int | None = None    # the checkpoint's step (kind "checkpoint")

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint.checkpoint_dir(self.path, self.step)


def resolve_source(src: str | Path) -> ModelSource:
    """The kind of model `src` names; ValueError naming what was expected otherwise."""
    path = Path(src)
    if not path.is_dir():
        raise ValueError(f"--model {src}: no such directory; expected {_SRC_KINDS}")
    if (path / CONFIG_FILE).is_file():
        return ModelSource("hf", path)
    if (path / "checkpoints").is_dir():
        step = checkpoint.latest_step(path)
        if step is None:
            raise ValueError(f"--model {src}: the run has no finished checkpoint yet (no checkpoints/latest)")
        return ModelSource("checkpoint", path, step)
    if path.parent.name == "checkpoints" and path.name.startswith("step_") and path.name[5:].isdigit():
        return ModelSource("checkpoint", path.parent.parent, int(path.name[5:]))
    raise ValueError(f"--model {src}: not a model directory; expected {_SRC_KINDS}")


def checkpoint_layout(source: ModelSource) -> dict[str, Any] | None:
    """The parallel layout that wrote a run checkpoint (None for Hugging Face sources or
    checkpoints from before layouts were recorded)."""
    if source.kind != "checkpoint":
        return None
    record = source.checkpoint_dir / checkpoint.LAYOUT_FILE
    return json.loads(record.read_text()) if record.is_file() else None


def source_recipe(source: ModelSource, config: str | None, overrides: Sequence[str]) -> Recipe:
    """The recipe that builds `source`'s model (module docstring), overrides applied."""
    tree = read_tree(Path(config)) if config else {}
    if source.kind == "hf":
        model = {k: v for k, v in (tree.get("model") or {}).items() if k not in _ARCHITECTURE_KEYS}
        tree["model"] = {**model, "hf_checkpoint": str(source.path)}
    else:
        run = _run_tree(source.path)
        tree = {**(tree or run), "model": run.get("model"), "parallel": run.get("parallel")}
    return parse_recipe(apply_overrides(tree, overrides))


def _run_tree(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "recipe.yaml"
    if not path.is_file():
        raise ValueError(f"run {run_dir} has no recipe.yaml (written by train at its first checkpoint)")
    return yaml.safe_load(path.read_text()) or {}


def check_source_layout(source: ModelSource, recipe: Recipe, world_size: int) -> None:
    """A per-rank run checkpoint loads only on the layout that wrote it (distributed ones anywhere)."""
    if source.kind != "checkpoint" or not checkpoint.is_legacy(source.checkpoint_dir):
        return
    saved = checkpoint_layout(source)
    if saved is not None and saved != recipe.parallel.layout(world_size):
        wanted = " ".join(f"{k}={v}" for k, v in saved.items())
        raise ValueError(f"--model {source.checkpoint_dir} was written by the layout {wanted} and per-rank "
                         f"checkpoints load only on that layout: launch with --nproc {saved['world_size']} and "
                         "no parallel.* overrides, or export it to Hugging Face format first and use that")


def load_source_weights(source: ModelSource, model_chunks: list[Any], groups: ParallelGroups) -> None:
    """Put a run checkpoint's weights into this rank's chunks (a Hugging Face source's weights are
    read when the chunks are built, from model.hf_checkpoint)."""
    if source.kind != "checkpoint":
        return
    if not checkpoint.is_legacy(source.checkpoint_dir):
        checkpoint.load_model(source.checkpoint_dir, model_chunks, groups)
        return
    state = checkpoint.load_legacy(source.checkpoint_dir)
    for chunk, chunk_state in zip(model_chunks, state["model"], strict=True):
        chunk.load_state_dict(chunk_state)
