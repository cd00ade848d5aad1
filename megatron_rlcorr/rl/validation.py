"""Validation: the policy's score on held-out prompts (`data.val_files`), as verl's trainer computes it.

What. Every prompt of the validation files (each usable row once, in file order) gets
`rollout.val_kwargs.n` responses, sampled as `val_kwargs` says (do_sample false: greedy), scored
by the task's reward; the metrics are verl's per data source (val_metrics.py). The trainer runs it
(rl/trainer.py: before training, every trainer.test_freq steps and at the last step), and so does
`megatron-rlcorr eval` on a checkpoint.

Layout-free, like training rollouts (rollout_world.py): the world's rollout groups of
`rollout.tensor_parallel_size` ranks each sample a contiguous chunk of the prompts, prompt i with
the seed derived from (run seed, "validation", step, i). A prompt's samples therefore do not depend
on the layout or the number of engines, a resumed run repeats the validations of the uninterrupted
one, and a greedy validation (one generation per prompt, copied n times, as verl's n greedy
samples are the same) repeats exactly. The bootstrap of best@k / maj@k is seeded per prompt.

Exchanges (validation sets are small): each rollout group's first rank all-gathers a few numbers
per sample (data source, the reward's numeric fields and `pred`), so every rank computes the same
metrics; the full records (tokens, text, every field the reward returns) go to global rank 0 only,
at most `max_records` of them (the first ones, in prompt order then sample order).

A row's data source is its `data_source` field (verl's schema); rows without one count under
"unknown" (verl's name for a batch without the field).
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..data.datasets import PromptDataset
from ..data.prompt import Prompt, Task
from ..data.tasks import DataSettings
from ..rollout.base import RolloutEngine, ValSampling
from .rollout_world import chunk_bounds
from .sampling import derive_seed
from .val_metrics import validation_metrics

if TYPE_CHECKING:  # Megatron-Core is imported inside the process groups only (runtime.py)
    from ..parallel.groups import ParallelGroups

UNKNOWN_SOURCE = "unknown"


@dataclass
class ValidationResult:
    """A validation's flat metrics (on every rank) and its per-sample records (global rank 0 only)."""

    metrics: dict[str, float]
    # One per (prompt, sample), prompt order then sample order: data_source, prompt (text), prompt_ids,
    # response_ids, response (text), finish_reason, ground_truth, score, acc (when the reward gives
    # one), and every other field the reward returns. [] on the other ranks.
    records: list[dict] = field(default_factory=list)


def open_val_dataset(data: DataSettings, *, tokenizer_dir: str | None,
                     files: Sequence[str] | None = None) -> PromptDataset:
    """A dataset over `files` (default data.val_files) read with the training data's keys,
    tokenizer and reward; opening it reads each file's first row (a wrong key fails here)."""
    from ..data.hf_tokenizer import HFTokenizer
    from ..data.rewards import get_reward_fn

    files_key = "data.val_files" if files is None else "the validation files"
    files = list(data.val_files if files is None else files)
    if not files:
        raise ValueError("no validation files: set data.val_files (parquet / JSONL in the training data's schema)")
    path = data.tokenizer or tokenizer_dir
    if path is None:
        raise ValueError("validation files need a tokenizer: set data.tokenizer or model.hf_checkpoint")
    return PromptDataset(files, tokenizer=HFTokenizer(path), reward_fn=get_reward_fn(data.reward),
                         prompt_key=data.prompt_key, answer_key=data.answer_key,
                         max_prompt_length=data.max_prompt_length, on_long_prompt=data.on_long_prompt,
                         skip_bad_rows=data.skip_bad_rows, shuffle=False, files_key=files_key)


def load_val_prompts(data: DataSettings, *, tokenizer_dir: str | None, files: Sequence[str] | None = None
                     ) -> tuple[Task, list[Prompt]]:
    """The validation task (its tokenizer and reward) and every usable row of `files` (default
    data.val_files) once, in file order. Long and bad rows are handled as data.on_long_prompt and
    data.skip_bad_rows say for training; skipped ones are reported in a warning."""
    dataset = open_val_dataset(data, tokenizer_dir=tokenizer_dir, files=files)
    read = dataset.in_file_order()
    if read.dropped_long or read.skipped_bad:
        warnings.warn(f"validation uses {len(read.prompts)} of the {dataset.num_rows} rows of "
                      f"{', '.join(map(str, dataset.files))}: {read.dropped_long} prompts longer than "
                      f"data.max_prompt_length={data.max_prompt_length} dropped, {read.skipped_bad} bad rows "
                      "skipped (data.skip_bad_rows)", stacklevel=2)
    return dataset, read.prompts


def data_source(prompt: Prompt) -> str:
    source = prompt.extra.get("data_source") if isinstance(prompt.extra, Mapping) else None
    return UNKNOWN_SOURCE if source is None else str(source)


def _scored(task: Task, prompt: Prompt, response_ids: list[int]) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    """(the variables the metrics read: "reward" and the reward's fields; right or not; the record's
    reward fields: score, acc when given, the others). Right: the reward's acc, else score >= 1."""
    result = task.reward(prompt, response_ids)
    if not isinstance(result, Mapping):
        score = float(result)
        return {"reward": score}, score >= 1.0, {"score": score}
    score = float(result["score"])
    fields = {"score": score, **{k: v for k, v in result.items() if k != "score"}}
    correct = bool(result["acc"]) if "acc" in result else score >= 1.0
    return {"reward": score, **{k: v for k, v in fields.items() if k != "reward"}}, correct, fields


def _metric_info(infos: dict[str, Any]) -> dict[str, Any]:
    """What travels to every rank: numbers, and the reward's `pred` (maj@k votes on it)."""
    return {k: (v if k == "pred" else float(v)) for k, v in infos.items() if k == "pred" or isinstance(v, Real)}


def _generate(engine: RolloutEngine, task: Task, prompts: list[Prompt], first: int, sampling: ValSampling, *,
              max_new_tokens: int, seed: int, step: int) -> tuple[list[dict], list[dict]]:
    """(per-sample metric info, per-sample records) of prompts[first:first + len(prompts)]."""
    n, temperature = sampling.n, sampling.sampling_temperature
    draws = 1 if temperature == 0 else n  # greedy: n identical samples, generated once
    seeds = [derive_seed(seed, "validation", step, first + i) for i in range(len(prompts))]
    out = engine.sample_groups([p.ids for p in prompts], n=draws, seeds=seeds, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    infos, records = [], []
    for i, prompt in enumerate(prompts):
        source = data_source(prompt)
        for d in range(draws):
            response = list(out.response_ids[i * draws + d])
            variables, correct, fields = _scored(task, prompt, response)
            info = {"prompt": first + i, "source": source, "correct": correct, "vars": _metric_info(variables)}
            record = {"data_source": source, "prompt": prompt.text, "prompt_ids": list(prompt.ids),
                      "response_ids": response, "response": task.tokenizer.decode(response),
                      "finish_reason": out.finish_reasons[i * draws + d], "ground_truth": prompt.answer, **fields}
            copies = n if draws == 1 else 1
            infos.extend([info] * copies)
            records.extend(dict(record) for _ in range(copies))
    return infos, records


def validate(engine: RolloutEngine, task: Task, prompts: list[Prompt], sampling: ValSampling, *, max_new_tokens: int,
             groups: ParallelGroups, seed: int, step: int, device: torch.device | str,
             max_records: int | None = None) -> ValidationResult:
    """Validate on `prompts` (collective over the world; module docstring). `max_records` bounds
    the records gathered to rank 0 (None: all). `device` is this rank's device; the object
    collectives stage their bytes where the backend wants them (the current CUDA device for NCCL)."""
    if not prompts:
        raise ValueError("validation needs at least one prompt; none was given")
    size, rank, world = groups.rollout_group_size, dist.get_rank(), dist.get_world_size()
    start, end = chunk_bounds(len(prompts), world // size)[rank // size]
    infos: list[dict] = []
    records: list[dict] = []
    if end > start:
        infos, records = _generate(engine, task, prompts[start:end], start, sampling,
                                   max_new_tokens=max_new_tokens, seed=seed, step=step)
    reporting = rank % size == 0  # a rollout group's ranks hold the same samples: its first reports them
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, infos if reporting else [])
    everything = [info for part in gathered for info in part]  # rank order = prompt order
    assert len(everything) == len(prompts) * sampling.n, (len(everything), len(prompts), sampling.n)
    variables = sorted({name for info in everything for name in info["vars"]})
    metrics = validation_metrics([info["source"] for info in everything], [info["prompt"] for info in everything],
                                 {name: [info["vars"].get(name) for info in everything] for name in variables},
                                 [info["correct"] for info in everything])
    return ValidationResult(metrics, _gather_records(records if reporting else [], start * sampling.n, max_records))


def _gather_records(records: list[dict], offset: int, limit: int | None) -> list[dict]:
    """The first `limit` records of the whole validation on rank 0 (`offset`: the index of this
    rank's first record); [] elsewhere."""
    if limit == 0:
        return []  # (every rank knows it: no exchange)
    if limit is not None:
        records = records[: max(limit - offset, 0)]
    rank0 = dist.get_rank() == 0
    gathered: list[Any] = [None] * dist.get_world_size() if rank0 else []
    dist.gather_object(records, gathered if rank0 else None, dst=0)
    if not rank0:
        return []
    merged = [record for part in gathered for record in part]
    return merged if limit is None else merged[:limit]


def write_generations(records: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Records as JSON lines (written whole, then renamed: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for record in records:
            f.write(json.dumps(record, default=_jsonable) + "\n")
    tmp.replace(path)
    return path


def _jsonable(value: Any) -> Any:
    """A reward field json cannot write: a number type's value (numpy's), else its text."""
    return value.item() if hasattr(value, "item") else str(value)
