"""What `megatron-rlcorr analyze` reads: a scored rollout file, a dumps directory or a run directory.

Why: the mismatch between the rollout engine's and the trainer's token log-probs is a property of
data the project already writes, so the analyzer takes that data as it is:
- a scored rollout file (data/rollout_file.py after `megatron-rlcorr score`): every record has
  `rollout_log_probs` (the engine's) and `log_probs` (the trainer's), one per response token;
- a dumps directory: `step_<N>.jsonl` files in the same format (rl/dumps.py, written every
  `trainer.dump_every` steps), N the step (records may also carry `step`, `reward` and
  `finish_reason`; `reward` is kept per sequence, for tools/ablate.py);
- a run directory: `dumps/` as above, `metrics.jsonl` (rl/progress.py: one JSON object per logged
  step) and the run's resolved `recipe.yaml`.

Conventions:
- All dump files of a directory are analysed as one batch (files in step order, records in file
  order); `step_of_sequence` keeps each sequence's step for the per-step trend. An empty dump (a
  step without a training batch: every group filtered out) is skipped.
- `old` is the trainer's log-prob (pi_old, the `log_probs` field), `rollout` the engine's.
- A token whose log-prob, in either list, is not finite or is positive is left out of every
  statistic (masked), as the trainer masks it before the correction (docs/api.md); their
  number is `Batch.invalid_tokens`. A bad record (missing field, wrong length) is an error naming
  the file, the line, the field and the fix.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.rollout_file import RolloutRecord, read_rollouts

DUMP_NAME = re.compile(r"^step_(\d+)\.jsonl$")
INPUT_KINDS = ("a scored rollout file (JSONL), a dumps directory (step_<N>.jsonl) or a run directory (dumps/ + "
               "metrics.jsonl)")


@dataclass
class Batch:
    """The sequences of the input, packed: token tensors [N], `cu_seqlens` [S+1] (the packed layout of docs/api.md)."""

    old_log_prob: torch.Tensor        # float64 [N], the trainer's; 0.0 where masked
    rollout_log_prob: torch.Tensor    # float64 [N], the engine's; 0.0 where masked
    mask: torch.Tensor                # float32 [N], 0 at invalid tokens
    cu_seqlens: torch.Tensor          # int64 [S+1]
    invalid_tokens: int = 0

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        """Valid response tokens (masked ones not counted)."""
        return int(self.mask.sum().item())

    @property
    def lengths(self) -> torch.Tensor:
        """int64 [S]: response tokens of each sequence, masked ones included."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def sequence_of_token(self) -> torch.Tensor:
        """int64 [N]: the index of each token's sequence."""
        return torch.repeat_interleave(torch.arange(self.num_sequences), self.lengths)

    def select(self, rows: torch.Tensor) -> "Batch":
        """The sub-batch of the sequences where `rows` (bool [S]) is true, in order."""
        tokens = rows[self.sequence_of_token]
        lengths = self.lengths[rows]
        return Batch(self.old_log_prob[tokens], self.rollout_log_prob[tokens], self.mask[tokens],
                     torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
                     int((self.mask[tokens] == 0).sum().item()))


@dataclass
class AnalysisInput:
    """Everything read from INPUT."""

    path: Path
    kind: str                                   # "scored" | "dumps" | "run"
    batch: Batch
    files: list[Path]
    step_of_sequence: torch.Tensor | None = None  # int64 [S] for dumps, None for a scored file
    reward_of_sequence: torch.Tensor | None = None  # float64 [S] for dumps (NaN where a record has none)
    metrics: list[dict[str, Any]] | None = None   # metrics.jsonl records of a run, in file order
    recipe: Path | None = None                    # the run's recipe.yaml, when there is one

    @property
    def steps(self) -> list[int]:
        return [] if self.step_of_sequence is None else sorted(set(self.step_of_sequence.tolist()))


def load_input(path: str | Path) -> AnalysisInput:
    """Read INPUT (module docstring); ValueError naming what is wrong and the fix."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"input {path} does not exist; give {INPUT_KINDS}")
    if path.is_file():
        return AnalysisInput(path, "scored", _pack(_scored_records(path), path), [path])
    if (path / "dumps").is_dir():
        dumps = _dump_files(path / "dumps", run=path)
        metrics_path = path / "metrics.jsonl"
        metrics = read_metrics(metrics_path) if metrics_path.is_file() else None
        recipe = path / "recipe.yaml"
        return _from_dumps(path, "run", dumps, metrics, recipe if recipe.is_file() else None)
    return _from_dumps(path, "dumps", _dump_files(path, run=None), None, None)


def _from_dumps(path: Path, kind: str, dumps: list[tuple[int, Path]], metrics: list[dict[str, Any]] | None,
                recipe: Path | None) -> AnalysisInput:
    records, steps = [], []
    dumps = [(step, file) for step, file in dumps if file.read_text().strip()]  # a step that trained nothing
    if not dumps:
        raise ValueError(f"{path}: every step_<N>.jsonl dump is empty (those steps had no training batch); "
                         f"nothing to analyze")
    for step, file in dumps:
        file_records = _scored_records(file)
        records += file_records
        steps += [step] * len(file_records)
    rewards = [r.fields.get("reward") for r in records]
    return AnalysisInput(path, kind, _pack(records, path), [f for _, f in dumps],
                         torch.tensor(steps, dtype=torch.int64),
                         torch.tensor([math.nan if x is None else float(x) for x in rewards], dtype=torch.float64),
                         metrics, recipe)


def _dump_files(directory: Path, run: Path | None) -> list[tuple[int, Path]]:
    """(step, file) of every step_<N>.jsonl in `directory`, by step."""
    found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := DUMP_NAME.match(p.name)))
    if found:
        return found
    if run is not None:
        raise ValueError(f"run directory {run}: {directory} holds no step_<N>.jsonl dump; the trainer writes them "
                         f"with trainer.dump_every: K (every K-th step's rollouts)")
    raise ValueError(f"directory {directory} holds no step_<N>.jsonl dump file and no dumps/ directory; give "
                     f"{INPUT_KINDS} (a run writes dumps with trainer.dump_every: K)")


def _scored_records(path: Path) -> list[RolloutRecord]:
    records = read_rollouts(path)
    for record in records:
        where = f"{path}:{record.line}"
        if record.rollout_log_probs is None:
            raise ValueError(f"{where}: no 'rollout_log_probs' (the rollout engine's log-prob of each sampled "
                             f"token); the analyzer compares them with the trainer's, so generate with log-probs "
                             f"returned (vLLM: SamplingParams(logprobs=0)) and write them to each record")
        _trainer_log_probs(record, where)
    return records


def _trainer_log_probs(record: RolloutRecord, where: str) -> list[float]:
    values = record.fields.get("log_probs")
    if values is None:
        raise ValueError(f"{where}: no 'log_probs' (the trainer's log-prob of each response token); run "
                         f"`megatron-rlcorr score --model SRC --rollouts IN.jsonl --out scored.jsonl` and analyze "
                         f"the scored file")
    if not isinstance(values, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                               for x in values):
        raise ValueError(f"{where}: log_probs must be a list of numbers (one per response token)")
    if len(values) != len(record.response_ids):
        raise ValueError(f"{where}: log_probs has {len(values)} values for {len(record.response_ids)} response "
                         f"tokens; score the file again with `megatron-rlcorr score`")
    return values


def _pack(records: list[RolloutRecord], path: Path) -> Batch:
    old = [float(x) for r in records for x in r.fields["log_probs"]]
    rollout = [x for r in records for x in r.rollout_log_probs]
    valid = [_valid(a) and _valid(b) for a, b in zip(old, rollout)]
    lengths = torch.tensor([len(r.response_ids) for r in records], dtype=torch.int64)
    mask = torch.tensor(valid, dtype=torch.float32)
    old_t = torch.tensor(old, dtype=torch.float64).where(mask.bool(), torch.zeros((), dtype=torch.float64))
    rollout_t = torch.tensor(rollout, dtype=torch.float64).where(mask.bool(), torch.zeros((), dtype=torch.float64))
    batch = Batch(old_t, rollout_t, mask, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
                  invalid_tokens=len(valid) - sum(valid))
    if batch.num_tokens == 0:
        raise ValueError(f"input {path}: no response token with finite log-probs <= 0 in both rollout_log_probs and "
                         f"log_probs ({len(records)} records, {len(valid)} tokens); nothing to analyze")
    return batch


def _valid(x: float) -> bool:
    return math.isfinite(x) and x <= 0.0


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl; a last line cut short (a run still writing) is skipped."""
    lines = path.read_text().splitlines()
    records = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if line_no == len(lines):
                break
            raise ValueError(f"{path}:{line_no}: not valid JSON ({err}); metrics.jsonl holds one JSON object per "
                             f"logged step (rl/progress.py)") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{line_no}: expected a JSON object with an integer 'step' (rl/progress.py)")
        records.append(record)
    return records
