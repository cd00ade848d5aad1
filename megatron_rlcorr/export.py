"""Entry point: write a model as a Hugging Face checkpoint.

    torchrun --nproc_per_node=N -m megatron_rlcorr.export --model SRC --out DIR \
        [--dtype bfloat16|float32] [--config RECIPE] [section.key=value ...]

(`megatron-rlcorr export ...` validates the same arguments and launches this.) SRC is a Hugging
Face checkpoint (a round trip through the Megatron model), a run or one of its checkpoints
(recipe/source.py). DIR receives config.json (the source checkpoint's own, or a new one of the
family that represents the model), safetensors shards (model.safetensors or model-*-of-*.safetensors
with their index) in Hugging Face names, and the tokenizer files of the model's tokenizer
(`data.tokenizer`, else the Hugging Face checkpoint the model came from) with its
generation_config.json. Weights stream one tensor at a time (model/hf.py: export_hf), so the peak
extra memory is about one full tensor whatever the model size.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .recipe import Recipe
from .recipe.source import ModelSource, check_source_layout, load_source_weights, resolve_source, source_recipe
from .runtime import launch_rank, process_groups, report_bad_input

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron-rlcorr export", description="write a Hugging Face checkpoint")
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint dir, run dir or run checkpoint")
    parser.add_argument("--out", required=True, help="directory for the Hugging Face checkpoint")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the written weights")
    parser.add_argument("--config", default=None, help="recipe (tokenizer, precision settings)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2")


def prepare(args: argparse.Namespace, world_size: int) -> tuple[ModelSource, Recipe]:
    """Everything checked before any process group exists; ValueError naming what is wrong."""
    source = resolve_source(args.model)
    recipe = source_recipe(source, args.config, args.overrides)
    recipe.check_model_layout(world_size)
    check_source_layout(source, recipe, world_size)
    out = Path(args.out).resolve()
    if out in (source.path.resolve(), Path(recipe.model.hf_checkpoint or "/nonexistent").resolve()):
        raise ValueError(f"--out {args.out} is the source checkpoint itself; write the export elsewhere")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out} exists and is not a directory")
    return source, recipe


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        source, recipe = prepare(args, launch_rank()[1])
    except ValueError as err:
        return report_bad_input(f"export --model {args.model}", err)
    with process_groups(recipe.parallel, timeout_minutes=recipe.trainer.timeout_minutes) as groups:
        written = export_model(source, recipe, groups, args.out, DTYPES[args.dtype])
    if written is not None:
        print(f"wrote {written} ({args.dtype}); load it with transformers' "
              f"AutoModelForCausalLM.from_pretrained({str(written)!r})", flush=True)
    return 0


def export_model(source: ModelSource, recipe: Recipe, groups, out: str | Path, dtype: torch.dtype) -> Path | None:
    """Build the model of `source` on this rank, then write it (collective)."""
    from .model.build import build_model_chunks
    from .model.hf import export_hf

    chunks = build_model_chunks(recipe.model, groups, seed=recipe.trainer.seed, init_weights=source.kind == "hf")
    load_source_weights(source, chunks, groups)
    return export_hf(chunks, groups, out, recipe.model, dtype=dtype, tokenizer_dir=recipe.data.tokenizer)


if __name__ == "__main__":
    sys.exit(main())
