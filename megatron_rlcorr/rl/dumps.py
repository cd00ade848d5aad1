"""Rollout dumps: every `trainer.dump_every` steps, the step's rollouts as a scored rollout file.

Why: the mismatch analyzer (`megatron-rlcorr analyze`) reads what the correction saw, token by
token: the engine's log-probs next to the trainer's. A dump is the `score` format
(data/rollout_file.py) plus the step's outcome, one JSON object per sequence:
`prompt_ids`, `response_ids`, `rollout_log_probs` (the engine's), `log_probs` (the trainer's
pi_old, before the step's updates, at the rollout temperature), `step`, `reward` (with the
overlong penalty) and `finish_reason` ("eos" or "length").

Where: `<run_dir>/dumps/step_<N>.jsonl`, written by global rank 0. Every data-parallel replica's
share comes from its last pipeline stage's first TP/CP rank (which holds pi_old for whole
sequences) and is gathered to rank 0, so the file holds the whole step batch in DP-rank order,
dynamic sampling's inert fillers left out. Bounded: at most `trainer.dump_max_samples`
sequences per dump, taken evenly from the replicas (each replica's first ones).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .sampling import RolloutGroups


def dump_records(share: RolloutGroups, log_probs_BT: torch.Tensor, rewards_B: torch.Tensor, *, step: int,
                 limit: int) -> list[dict[str, Any]]:
    """The first `limit` non-filler sequences of this replica's share as dump records;
    `log_probs_BT` is the trainer's [B, T] (row i predicts its targets, as in rl/batch.py)."""
    records = []
    prompts = share.prompt_ids()
    fillers = share.filler_G.repeat_interleave(share.n).tolist()
    log_probs_BT, rewards = log_probs_BT.float().cpu(), rewards_B.double().cpu().tolist()
    for i, (prompt, response) in enumerate(zip(prompts, share.response_ids)):
        if len(records) == limit:
            break
        if fillers[i]:
            continue
        start = len(prompt) - 1
        records.append({"step": step, "prompt_ids": list(prompt), "response_ids": list(response),
                        "rollout_log_probs": share.logprobs[i].float().tolist(),
                        "log_probs": log_probs_BT[i, start:start + len(response)].tolist(),
                        "reward": rewards[i], "finish_reason": share.finish_reasons[i]})
    return records


def gather_and_write(records: list[dict[str, Any]] | None, run_dir: Path, step: int) -> Path | None:
    """Gather every rank's records (None from ranks that hold none) to rank 0, which writes the
    dump; collective over the world. Returns the file on rank 0."""
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(records, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    path = Path(run_dir) / "dumps" / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w") as f:
        for part in gathered:
            for record in part or ():
                f.write(json.dumps(record) + "\n")
    tmp.replace(path)  # a reader never sees half a dump
    return path
