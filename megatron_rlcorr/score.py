"""Entry point: the trainer's view of any engine's rollouts.

    torchrun --nproc_per_node=N -m megatron_rlcorr.score --model SRC --rollouts IN.jsonl --out OUT.jsonl \
        [--config RECIPE] [section.key=value ...]

(`megatron-rlcorr score ...` validates the same arguments and launches this.) SRC is a Hugging
Face checkpoint, a run or one of its checkpoints (recipe/source.py). IN is a rollout file
(data/rollout_file.py); OUT holds the same records in the same order, each with `log_probs`: the
float32 log-prob the Megatron model gives every response token, at `rollout.temperature` as the
trainer applies it, under the layout of the overrides (`parallel.tp=2`, `model.bf16=true`, ...),
normalised over the tokenizer's rows only (PADDED_ROWS_NOTE).

Each data-parallel replica scores every dp-th record, shortest first, in calls of
`trainer.micro_batch_size` x pp sequences (forward only, the trainer's pipeline schedule).
With expert parallelism (parallel.ep > 1) the expert-parallel group spans data-parallel ranks
and every MoE layer's token exchange is collective over it, so the replicas run in lockstep:
the same number of calls, each padded to the longest record, in padded micro-batches
(trainer.max_tokens_per_micro_batch is not used). rank 0 gathers the log-probs and writes OUT. When records carry `rollout_log_probs`, rank 0 also
runs the rollout correction on all of them at once (the recipe's correction block, or the DAPO
block when the recipe has none), prints its metrics and writes them to OUT.metrics.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .config import RolloutCorrectionConfig
from .data.rollout_file import RolloutRecord, read_rollouts, write_rollouts
from .recipe import Recipe
from .recipe.source import ModelSource, check_source_layout, load_source_weights, resolve_source, source_recipe
from .runtime import launch_rank, process_groups, report_bad_input

# The rollout correction of the DAPO recipe this project descends from (notes/scale-path.md).
DAPO_CORRECTION = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0,
                                          rollout_is_batch_normalize=True, rollout_rs="geometric",
                                          rollout_rs_threshold=1.01, rollout_rs_threshold_lower=0.99,
                                          rollout_token_veto_threshold=1e-4)


PADDED_ROWS_NOTE = (
    "Padded vocabulary rows are masked: where the checkpoint's vocabulary is padded beyond its tokenizer "
    "(model.token_vocab_size, taken from the tokenizer; Qwen2.5: 151,665 tokens of 152,064 rows), the rows "
    "beyond it get no probability, as in training and in both rollout engines, and a response token among "
    "them is refused. transformers does not mask them, so on such a checkpoint its log-prob of a token is "
    "this one + log(1 - p_padded), p_padded being the probability it gives the padded rows.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron-rlcorr score",
                                     description="the trainer's log-probs of an engine's rollouts")
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = PADDED_ROWS_NOTE
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint dir, run dir or run checkpoint")
    parser.add_argument("--rollouts", required=True, help="rollout file (JSONL with prompt_ids, response_ids)")
    parser.add_argument("--out", required=True, help="output JSONL (the records with log_probs added)")
    parser.add_argument("--config", default=None, help="recipe for rollout, correction and precision settings")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2 model.bf16=true")


def prepare(args: argparse.Namespace, world_size: int) -> tuple[ModelSource, Recipe, list[RolloutRecord]]:
    """Everything checked before any process group exists; ValueError naming what is wrong."""
    source = resolve_source(args.model)
    recipe = source_recipe(source, args.config, args.overrides)
    recipe.check_model_layout(world_size)
    check_source_layout(source, recipe, world_size)
    if Path(args.out).resolve() == Path(args.rollouts).resolve():
        raise ValueError(f"--out {args.out} is the input file; write the scored records elsewhere")
    records = read_rollouts(args.rollouts, vocab_size=recipe.model.vocab_size)
    check_response_rows(records, recipe.model.sampled_vocab_size, args.rollouts)
    return source, recipe, records


def check_response_rows(records: list[RolloutRecord], rows: int, path: str) -> None:
    """Response tokens must be rows that can get probability (PADDED_ROWS_NOTE): a padded row's
    log-prob would be PADDED_VOCAB_LOGIT-sized, no number a correction could use."""
    for i, record in enumerate(records):
        beyond = [t for t in record.response_ids if t >= rows]
        if beyond:
            raise ValueError(f"{path}: record {i + 1} (in file order): response_ids holds token id {beyond[0]}, a padded vocabulary "
                             f"row beyond the tokenizer's {rows} tokens (model.token_vocab_size), which no engine "
                             "samples and the trainer masks; were these rollouts made with another tokenizer?")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        source, recipe, records = prepare(args, launch_rank()[1])
    except ValueError as err:
        return report_bad_input(f"score --model {args.model}", err)
    with process_groups(recipe.parallel, timeout_minutes=recipe.trainer.timeout_minutes) as groups:
        log_probs = score_records(source, recipe, records, groups)
    if log_probs is not None:
        write_outputs(args.out, records, log_probs, correction_config(recipe), recipe)
    return 0


def score_records(source: ModelSource, recipe: Recipe, records: list[RolloutRecord], groups) -> list | None:
    """Per record, the list of response-token log-probs, on global rank 0 (None elsewhere)."""
    from .model.build import build_model_chunks

    chunks = build_model_chunks(recipe.model, groups, seed=recipe.trainer.seed, init_weights=source.kind == "hf")
    load_source_weights(source, chunks, groups)
    mine = sorted(range(groups.dp_rank, len(records), groups.dp_size), key=lambda i: _length(records[i]))
    per_call = recipe.trainer.micro_batch_size * groups.pp_size
    calls, width, max_tokens = math.ceil(len(mine) / per_call), 1, recipe.trainer.max_tokens_per_micro_batch
    if groups.ep_size > 1:  # lockstep over the data-parallel ranks (module docstring)
        calls = math.ceil(math.ceil(len(records) / groups.dp_size) / per_call)  # the most any replica makes
        width, max_tokens = max(_length(r) for r in records), 0
    local: dict[int, list[float]] = {}
    for start in range(0, calls * per_call, per_call):
        local.update(_score_call(chunks, [records[i] for i in mine[start:start + per_call]],
                                 mine[start:start + per_call], per_call, recipe, groups, width=width,
                                 max_tokens=max_tokens))
    holds = groups.is_pipeline_last_stage() and groups.tp_rank == 0 and groups.cp_rank == 0
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local if holds else {}, gathered, dst=0)
    if gathered is None:
        return None
    merged = {i: lp for part in gathered for i, lp in part.items()}
    assert len(merged) == len(records), "every record is scored by exactly one replica"
    return [merged[i] for i in range(len(records))]


def _length(record: RolloutRecord) -> int:
    return len(record.prompt_ids) + len(record.response_ids)


def _score_call(chunks, rows: list[RolloutRecord], indices: list[int], per_call: int, recipe: Recipe,
                groups, *, width: int, max_tokens: int) -> dict[int, list[float]]:
    """Log-probs of `rows` (the call padded to `per_call` sequences with one-token fillers, its
    width to a multiple of `width`; `max_tokens`: trainer.max_tokens_per_micro_batch or 0)."""
    from .rl.batch import padded_sequences
    from .training.step import StepBatch, compute_old_log_probs

    fillers = per_call - len(rows)
    prompts = [r.prompt_ids for r in rows] + [[0]] * fillers
    responses = [r.response_ids for r in rows] + [[0]] * fillers
    tokens_BT, targets_BT, response_BT, _ = padded_sequences(prompts, responses, pad_multiple=width)
    zeros_BT = torch.zeros_like(tokens_BT, dtype=torch.float32)
    batch = StepBatch(tokens_BT, targets_BT, response_BT.float(), zeros_BT, zeros_BT)
    log_probs_BT = compute_old_log_probs(chunks, batch, groups=groups,
                                         micro_batch_size=recipe.trainer.micro_batch_size,
                                         temperature=recipe.rollout.temperature or 1.0,
                                         max_tokens_per_micro_batch=max_tokens)
    if log_probs_BT is None:
        return {}
    log_probs_BT = log_probs_BT.cpu()
    return {i: log_probs_BT[row][response_BT[row]].tolist() for row, i in enumerate(indices)}


def correction_config(recipe: Recipe) -> RolloutCorrectionConfig:
    """The recipe's correction block when it has one, else the DAPO block."""
    has_block = (recipe.raw.get("algorithm") or {}).get("rollout_correction") is not None
    return recipe.algorithm.rollout_correction if has_block else DAPO_CORRECTION


def write_outputs(out: str, records: list[RolloutRecord], log_probs: list[list[float]],
                  cfg: RolloutCorrectionConfig, recipe: Recipe) -> None:
    write_rollouts(out, ({**r.fields, "log_probs": lp} for r, lp in zip(records, log_probs)))
    tokens = sum(len(lp) for lp in log_probs)
    print(f"scored {len(records)} sequences ({tokens} response tokens) at temperature "
          f"{recipe.rollout.temperature or 1.0}; wrote {out}", flush=True)
    metrics = correction_metrics(records, log_probs, cfg)
    if metrics is None:
        return
    path = Path(f"{out}.metrics.json")
    path.write_text(json.dumps({"correction": cfg.to_dict(), "metrics": metrics}, indent=2) + "\n")
    for name, value in metrics.items():
        print(f"  {name}: {value:.6g}")
    print(f"rollout-correction metrics of {metrics['num_sequences']:.0f} sequences: {path}", flush=True)


def correction_metrics(records: list[RolloutRecord], log_probs: list[list[float]],
                       cfg: RolloutCorrectionConfig) -> dict[str, float] | None:
    """The correction's metrics over every record that has rollout log-probs, in one call (the
    single-process whole-batch semantics); None when no record has them. Rollout log-probs that
    are not finite or are positive leave the mask first, as in training (docs/api.md)."""
    from .correction import compute_rollout_correction

    rows = [i for i, r in enumerate(records) if r.rollout_log_probs is not None]
    if not rows:
        return None
    width = max(1, max(len(records[i].response_ids) for i in rows))
    old_BT, rollout_BT = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    valid_BT = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, i in enumerate(rows):
        n = len(records[i].response_ids)
        old_BT[b, :n] = torch.tensor(log_probs[i])
        rollout_BT[b, :n] = torch.tensor(records[i].rollout_log_probs)
        valid_BT[b, :n] = True
    invalid_BT = valid_BT & (~torch.isfinite(rollout_BT) | (rollout_BT > 0))
    mask_BT = (valid_BT & ~invalid_BT).float()
    rollout_BT = torch.where(mask_BT.bool(), rollout_BT, torch.zeros_like(rollout_BT))
    out = compute_rollout_correction(old_BT, rollout_BT, mask_BT, cfg)
    metrics = {name: float(value) for name, value in out.metrics.items()}
    metrics.update(num_sequences=float(len(rows)), num_tokens=float(valid_BT.sum()),
                   invalid_rollout_tokens=float(invalid_BT.sum()))
    return metrics


if __name__ == "__main__":
    sys.exit(main())
