"""The rollout file: one JSON object per sequence, the input of `score` and of the mismatch analyzer.

Each line holds `prompt_ids` (a non-empty list of token ids), `response_ids` (a list of token
ids) and optionally `rollout_log_probs` (one float per response token: what the rollout engine,
vLLM or another, reported for the sampled token). `score` adds `log_probs` (the trainer's float32
log-prob of every response token). Any other field passes through untouched and in place.

Records are read whole into memory (token ids and floats as Python lists): the file is meant
for analysis batches of up to some hundred thousand sequences, not for training data.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable


@dataclass
class RolloutRecord:
    """One line of a rollout file; `fields` is the whole JSON object as read (pass-through)."""

    line: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float] | None
    fields: dict[str, Any]


def read_rollouts(path: str | Path, vocab_size: int | None = None) -> list[RolloutRecord]:
    """Every record of `path`, validated; ValueError naming the file, line, field and fix."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"rollout file {path} not found")
    records = []
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                records.append(_record(_parse(line, path, line_no), path, line_no, vocab_size))
    if not records:
        raise ValueError(f"rollout file {path} holds no records (one JSON object per line)")
    return records


def _parse(line: str, path: Path, line_no: int) -> dict[str, Any]:
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{line_no}: not valid JSON ({err})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path}:{line_no}: each line must be a JSON object, got {type(fields).__name__}")
    return fields


def _record(fields: dict[str, Any], path: Path, line_no: int, vocab_size: int | None) -> RolloutRecord:
    where = f"{path}:{line_no}"
    prompt = _token_ids(fields, "prompt_ids", where, vocab_size)
    if not prompt:
        raise ValueError(f"{where}: prompt_ids is empty; a sequence needs at least one prompt token (e.g. BOS)")
    response = _token_ids(fields, "response_ids", where, vocab_size)
    rollout = fields.get("rollout_log_probs")
    if rollout is not None:
        if not isinstance(rollout, list) or not all(_is_number(x) for x in rollout):
            raise ValueError(f"{where}: rollout_log_probs must be a list of numbers (one per response token)")
        if len(rollout) != len(response):
            raise ValueError(f"{where}: rollout_log_probs has {len(rollout)} values for {len(response)} response "
                             "tokens; give one log-prob per response token, or leave the field out")
        rollout = [float(x) for x in rollout]
    return RolloutRecord(line_no, prompt, response, rollout, fields)


def _token_ids(fields: dict[str, Any], key: str, where: str, vocab_size: int | None) -> list[int]:
    if key not in fields:
        raise ValueError(f"{where}: missing {key!r} (a list of token ids)")
    ids = fields[key]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{where}: {key} must be a list of integer token ids")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise ValueError(f"{where}: {key} holds token id {bad[0]} outside the model's vocabulary "
                         f"[0, {vocab_size}); were these rollouts made with another tokenizer?")
    return ids


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def write_rollouts(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """One JSON object per line (Python's JSON: a non-finite float passed through stays one)."""
    with Path(path).open("w") as f:
        for fields in records:
            f.write(json.dumps(fields) + "\n")
