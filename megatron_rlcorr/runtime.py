"""What every torchrun entry point (train, score, export) does around its work.

- `report_bad_input`: a bad recipe or argument stops every rank with one message and exit code
  2, before any process group exists (no hanging rendezvous, no traceback). Rank 0 reports;
  torchrun stops all workers as soon as one exits non-zero, so the other ranks wait a grace
  period first: exiting at once could get rank 0 killed before it printed. A rank still alive
  after the wait must have failed alone (e.g. it sees another filesystem) and reports its own
  error, tagged with its rank.
- `process_groups`: the default process group (NCCL with CUDA, gloo without), Megatron-Core's
  CPU compatibility layer when there is no GPU, and the parallel groups of a layout; all torn
  down at the end.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .parallel.groups import ParallelGroups
    from .parallel.layout import ParallelSettings

EXIT_BAD_INPUT = 2
REPORT_GRACE_S = 10.0  # how long ranks other than 0 wait, on bad input, for rank 0 to report it


def launch_rank() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as torchrun sets them; (0, 1) outside torchrun."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def report_bad_input(what: str, err: Exception) -> int:
    """Print `error: <what>: <err>` once (module docstring) and return the exit code."""
    rank, _ = launch_rank()
    where = ""
    if rank != 0:
        time.sleep(REPORT_GRACE_S)
        where = f" (rank {rank})"
    print(f"error: {what}{where}: {err}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


@contextmanager
def process_groups(parallel: ParallelSettings, *, timeout_minutes: int, rollout_tp: int = 1
                   ) -> Iterator[ParallelGroups]:
    """The parallel groups of `parallel` (and rollout groups of `rollout_tp` ranks) on this
    torchrun world, torn down on exit. Every group
    (the default one and Megatron-Core's) gets the collective timeout `timeout_minutes`
    (trainer.timeout_minutes: generating 20k-token responses can outlast torch's 10 minutes)."""
    from .parallel.cpu import enable_cpu_megatron
    from .parallel.groups import build_parallel_groups, destroy_parallel_groups

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    try:
        enable_cpu_megatron()
        groups = build_parallel_groups(parallel.tp, parallel.pp, parallel.cp, parallel.vpp,
                                       sequence_parallel=parallel.sequence_parallel, timeout_minutes=timeout_minutes,
                                       rollout_tp=rollout_tp)
        try:
            yield groups
        finally:
            destroy_parallel_groups()
    finally:
        dist.destroy_process_group()
