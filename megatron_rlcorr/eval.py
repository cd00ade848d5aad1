"""Entry point: a model's validation metrics and generations on prompt files.

    torchrun --nproc_per_node=N -m megatron_rlcorr.eval --model SRC --data FILE [FILE ...] --out DIR \
        [--n N] [--temperature T] [--top-p P] [--top-k K] [--max-new-tokens M] [--config RECIPE] \
        [--overwrite] [section.key=value ...]

(`megatron-rlcorr eval ...` validates the same arguments and launches this.) SRC is a Hugging
Face checkpoint, a run or one of its checkpoints (recipe/source.py). Each FILE holds prompts in
the training schema (data/datasets.py: parquet or JSONL), read with the recipe's data.prompt_key,
data.answer_key, tokenizer and reward (`data.reward` may give each data_source its own). Every
usable row is one prompt, in file order; it gets `rollout.val_kwargs.n` samples (`--n`) of at
most `rollout.max_new_tokens` tokens (`--max-new-tokens`), sampled as `rollout.val_kwargs` says
(`--temperature` T > 0 samples at T, with `--top-p` and `--top-k`; `--temperature 0` is greedy,
as is val_kwargs' default; greedy samples are all the same, and rank 0 warns when `--n` > 1 is),
generated and scored exactly as validation inside a run (rl/validation.py): every rank generates
its share with the recipe's rollout engine (`rollout.engine`, `rollout.precision`: the embedded
engine in bf16 unless the recipe or an override says otherwise) holding the model's weights, so
the numbers do not depend on the parallel layout, and greedy evaluation is deterministic. Options
given on the command line win over the same keys in `--config` and the overrides.

Every option without a value on the command line takes the recipe's: `--config`'s, else a run's
own recipe.yaml, else (a Hugging Face SRC without --config) the recipe defaults (e.g.
`rollout.max_new_tokens` 16, one greedy sample). The samples are seeded as validation at the
checkpoint's step (step N of `runs/<name>/checkpoints/step_N`; 0 for a Hugging Face SRC) with
`trainer.seed`, so eval of a run's checkpoint with the run's recipe repeats that run's validation
at that step, sampled or greedy.

`--out DIR` must be empty or absent; `--overwrite` writes into a non-empty one (metrics.json and
generations.jsonl are replaced, other files left as they are).

Rank 0 writes
- DIR/metrics.json: one flat object with the metrics validation logs in training, in the same
  names (val-core/<data_source>/<acc or reward>/mean@N, ... and pass@k; rl/val_metrics.py);
- DIR/generations.jsonl: one record per (prompt, sample), prompt order then sample order:
  data_source, prompt (text), prompt_ids, response_ids, response (text), finish_reason,
  ground_truth, score, acc (when the reward gives one) and every other field the reward returns.

Memory: the Megatron model is built only to stream its weights into the engine (as training
does); eval drops it before generation starts.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .recipe import Recipe
from .recipe.source import ModelSource, check_source_layout, load_source_weights, resolve_source, source_recipe
from .runtime import launch_rank, process_groups, report_bad_input

if TYPE_CHECKING:
    from .data.prompt import Prompt, Task
    from .rl.validation import ValidationResult

METRICS_FILE, GENERATIONS_FILE = "metrics.json", "generations.jsonl"
# An override (section.key=value, or name=value) rather than a data file: what `--data a.parquet
# parallel.tp=2` leaves in --data, since argparse cannot tell where --data's files end.
_OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*=")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron-rlcorr eval",
                                     description="validation metrics and generations of a model on prompt files")
    add_arguments(parser)
    args = parser.parse_args(argv)
    normalize_args(args)
    return args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint dir, run dir or run checkpoint")
    parser.add_argument("--data", required=True, nargs="+", metavar="FILE",
                        help="prompt files (parquet / JSONL, the training schema and data.* keys)")
    parser.add_argument("--out", required=True, help=f"directory for {METRICS_FILE} and {GENERATIONS_FILE}")
    # dest "samples": the launch passes --samples on, as torchrun's parser refuses "--n" as an ambiguous
    # abbreviation of its own options (--nnodes, --nproc-per-node, ...) even after the module's name
    parser.add_argument("--n", "--samples", dest="samples", type=int, default=None, metavar="N",
                        help="samples per prompt (rollout.val_kwargs.n)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature; 0 is greedy (rollout.val_kwargs.temperature and do_sample)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling (rollout.val_kwargs.top_p)")
    parser.add_argument("--top-k", type=int, default=None, help="top-k sampling, 0 = off (rollout.val_kwargs.top_k)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="response length limit (default: rollout.max_new_tokens of --config, else of a run's "
                             "recipe, else 16)")
    parser.add_argument("--config", default=None, help="recipe for data, reward, rollout and precision settings")
    parser.add_argument("--overwrite", action="store_true",
                        help=f"write into a non-empty --out (replacing its {METRICS_FILE} and {GENERATIONS_FILE})")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2 data.prompt_key=question")


def normalize_args(args: argparse.Namespace) -> None:
    """Move overrides that followed the data files (`--data a.parquet parallel.tp=2`) from --data to
    the overrides (a FILE that exists stays a file whatever its name)."""
    moved = [item for item in args.data if _OVERRIDE.match(item) and not Path(item).exists()]
    if moved:
        args.data = [item for item in args.data if item not in moved]
        args.overrides = [*moved, *args.overrides]


def option_overrides(args: argparse.Namespace) -> list[str]:
    """The recipe overrides the sampling options stand for."""
    overrides = []
    for option, key in (("samples", "n"), ("top_p", "top_p"), ("top_k", "top_k")):
        if getattr(args, option) is not None:
            overrides.append(f"rollout.val_kwargs.{key}={getattr(args, option)}")
    if args.temperature is not None:
        overrides += [f"rollout.val_kwargs.temperature={args.temperature}",
                      f"rollout.val_kwargs.do_sample={'true' if args.temperature > 0 else 'false'}"]
    if args.max_new_tokens is not None:
        overrides.append(f"rollout.max_new_tokens={args.max_new_tokens}")
    return overrides


def prepare(args: argparse.Namespace, world_size: int) -> tuple[ModelSource, Recipe, Task, list[Prompt]]:
    """Everything checked before any process group exists; ValueError naming what is wrong."""
    normalize_args(args)
    if not args.data:
        raise ValueError("--data names no prompt file")
    source = resolve_source(args.model)
    recipe = source_recipe(source, args.config, [*args.overrides, *option_overrides(args)])
    recipe.check_model_layout(world_size)
    check_source_layout(source, recipe, world_size)
    recipe.check_rollout(world_size)
    check_out(Path(args.out), overwrite=args.overwrite)
    task, prompts = read_prompts(recipe, args.data)
    if recipe.model.vocab_size < task.tokenizer.vocab_size:
        where = recipe.data.tokenizer or recipe.model.hf_checkpoint
        raise ValueError(f"the tokenizer in {where} has {task.tokenizer.vocab_size} tokens, more than the model's "
                         f"model.vocab_size={recipe.model.vocab_size} rows: evaluate with the tokenizer the model was "
                         "trained with")
    check_prompt_lengths(recipe, prompts)
    return source, recipe, task, prompts


def check_out(out: Path, *, overwrite: bool) -> None:
    """--out must be a directory to create, an empty one, or (--overwrite) any directory."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ValueError(f"--out {out} is not empty (it holds {shown}): pass --overwrite to replace its "
                         f"{METRICS_FILE} and {GENERATIONS_FILE}, or choose another --out")


def seed_step(source: ModelSource) -> int:
    """The validation step whose seeds eval samples with: the checkpoint's step (0 for a Hugging
    Face checkpoint), so eval of a run checkpoint draws what the run's validation drew there."""
    return source.step if source.kind == "checkpoint" else 0


def greedy_repeats(recipe: Recipe) -> str | None:
    """The warning for n > 1 greedy samples per prompt (they are identical), or None."""
    sampling = recipe.rollout.val_kwargs
    if sampling.n == 1 or sampling.sampling_temperature > 0:
        return None
    return (f"eval: --n {sampling.n} (rollout.val_kwargs.n) with greedy decoding (--temperature 0, or "
            f"rollout.val_kwargs.do_sample false) gives the same response {sampling.n} times per prompt, so every "
            f"@{sampling.n} metric equals its @1; pass --temperature T > 0 to sample, or --n 1")


def read_prompts(recipe: Recipe, files: list[str]) -> tuple[Task, list[Prompt]]:
    """Every usable row of `files`, in order, with the task that scores them; each file's data
    sources checked against a per-source data.reward."""
    from .data.rewards import missing_source_error
    from .rl.validation import load_val_prompts

    task, prompts = None, []
    for path in files:
        if not Path(path).is_file():
            raise ValueError(f"--data {path}: no such file")
        try:
            task, mine = load_val_prompts(recipe.data, tokenizer_dir=recipe.model.hf_checkpoint, files=[path])
        except ValueError as err:
            raise ValueError(f"--data {path}: {err}") from None
        spec = recipe.data.reward
        if not isinstance(spec, str):
            counts = Counter(p.extra.get("data_source") for p in mine)
            for source_name, count in counts.items():
                if source_name not in spec:
                    raise missing_source_error(spec, source_name, f"--data {path} ({count} of its {len(mine)} prompts)")
        prompts += mine
    return task, prompts


def check_prompt_lengths(recipe: Recipe, prompts: list[Prompt]) -> None:
    """The engine must hold the longest prompt and a whole response."""
    from .rollout.base import engine_max_model_len

    limit = engine_max_model_len(recipe.rollout, recipe.data.max_prompt_length, recipe.model.max_position_embeddings)
    longest = max(len(p.ids) for p in prompts)
    if longest + recipe.rollout.max_new_tokens > limit:
        raise ValueError(f"the longest prompt is {longest} tokens, and with rollout.max_new_tokens="
                         f"{recipe.rollout.max_new_tokens} it exceeds the {limit} tokens the rollout engine holds "
                         "(rollout.max_model_len, or data.max_prompt_length + max_new_tokens, or the model's "
                         "max_position_embeddings): lower --max-new-tokens, or set data.max_prompt_length to drop "
                         "longer prompts")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        source, recipe, task, prompts = prepare(args, launch_rank()[1])
    except ValueError as err:
        return report_bad_input(f"eval --model {args.model}", err)
    warning = greedy_repeats(recipe)
    if warning and launch_rank()[0] == 0:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    with process_groups(recipe.parallel, timeout_minutes=recipe.trainer.timeout_minutes,
                        rollout_tp=recipe.rollout.tensor_parallel_size) as groups:
        result = evaluate(source, recipe, task, prompts, groups)
        rank0 = dist.get_rank() == 0
    if rank0:
        write_outputs(Path(args.out), result, recipe, len(prompts), seed_step(source))
    return 0


def evaluate(source: ModelSource, recipe: Recipe, task: Task, prompts: list[Prompt], groups) -> ValidationResult:
    """Validation of `source`'s model on `prompts` (collective over the world)."""
    from .model.build import build_model_chunks
    from .rl.validation import validate
    from .rollout import load_model_weights, make_engine
    from .rollout.base import engine_max_model_len

    rollout = recipe.rollout
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    chunks = build_model_chunks(recipe.model, groups, seed=recipe.trainer.seed, init_weights=source.kind == "hf")
    load_source_weights(source, chunks, groups)
    tok = task.tokenizer
    max_model_len = engine_max_model_len(rollout, recipe.data.max_prompt_length, recipe.model.max_position_embeddings)
    engine = make_engine(rollout, recipe.model, eos_token_id=tok.eos_ids, pad_token_id=tok.pad_id, device=device,
                         max_model_len=max_model_len, seed=recipe.trainer.seed)
    load_model_weights(engine, rollout, chunks, groups)  # the trainer's weight sync, collective over TP and PP
    del chunks  # generation needs the engine only
    if cuda:
        torch.cuda.empty_cache()
    engine.wake_up(["kv_cache"])
    return validate(engine, task, prompts, rollout.val_kwargs, max_new_tokens=rollout.max_new_tokens, groups=groups,
                    seed=recipe.trainer.seed, step=seed_step(source), device=device)


def write_outputs(out: Path, result: ValidationResult, recipe: Recipe, num_prompts: int, step: int) -> None:
    from .rl.validation import write_generations

    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / METRICS_FILE
    metrics_path.write_text(json.dumps(result.metrics, indent=2) + "\n")
    generations_path = write_generations(result.records, out / GENERATIONS_FILE)
    sampling = recipe.rollout.val_kwargs
    how = (f"temperature {sampling.temperature}, top_p {sampling.top_p}, top_k {sampling.top_k}" if sampling.do_sample
           else "greedy")
    print(f"evaluated {num_prompts} prompts x {sampling.n} samples ({how}, at most "
          f"{recipe.rollout.max_new_tokens} new tokens; seeded as validation at step {step})", flush=True)
    for name, value in result.metrics.items():
        if name.startswith("val-core/"):
            print(f"  {name}: {value:.6g}")
    print(f"wrote {metrics_path} ({len(result.metrics)} metrics) and {generations_path} "
          f"({len(result.records)} generations)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
