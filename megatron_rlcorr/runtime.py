"""What every torchrun entry point (train, score, export) does around its work.

- `report_bad_input`: a bad recipe or argument stops every rank with one message and exit code
  2, before any process group exists (no hanging rendezvous, no traceback). Rank 0 reports;
  torchrun stops all workers as soon as one exits non-zero, so the other ranks wait a grace
  period first: exiting at once could get rank 0 killed before it printed. A rank still alive
  after the wait must have failed alone (e.g. it sees another filesystem) and reports its own
  error, tagged with its rank.
- `process_groups`: the default process group (NCCL with CUDA, gloo without), Megatron-Core's
  CPU compatibility layer when there is no GPU, and the parallel groups of a layout; all torn
  down at the end. It also quiets the known, harmless third-party warnings for its duration.
- `quiet_known_warnings`: hides exactly the warnings of `KNOWN_WARNINGS` (each by message,
  category and emitting module) and the `logging` records of `KNOWN_RECORDS` (by logger, level
  and message). Megatron-Core emits most of them while it is imported, so the entry points import
  it inside `process_groups` only; the rest while it builds, steps and checkpoints the model. A
  run's console then shows set-up, progress and results. Anything else is shown as before: the
  project's own warnings, an unknown third-party warning, the same message from another module.
  `RLCORR_VERBOSE=1` in the environment (`megatron-rlcorr ... --verbose`) keeps them all.
"""
from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .parallel.groups import ParallelGroups
    from .parallel.layout import ParallelSettings

EXIT_BAD_INPUT = 2
REPORT_GRACE_S = 10.0  # how long ranks other than 0 wait, on bad input, for rank 0 to report it
VERBOSE_ENV = "RLCORR_VERBOSE"  # "1": show every warning (quiet_known_warnings hides none)


@dataclass(frozen=True)
class KnownWarning:
    """A third-party warning that says nothing about the run: `message` (a regex, matched
    case-insensitively from the start of the text, as `warnings.filterwarnings` does), its
    `category` and the `module` it is attributed to (a regex of the whole module name).
    `cpu_only`: hidden only where there is no GPU (on one it is advice worth reading)."""

    message: str
    category: type[Warning]
    module: str
    why: str  # why it is harmless here
    cpu_only: bool = False


@dataclass(frozen=True)
class KnownRecord:
    """A third-party `logging` record that says nothing about the run: from the logger named
    `logger` (exactly), at `level`, its message matching the regex `message` from the start."""

    logger: str
    level: int
    message: str
    why: str


# Megatron-Core 0.16 to 0.19 and torch, as the demo, the tiny recipes and resumes meet them.
KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(r"Transformer Engine and Apex are not installed\. Falling back to ", UserWarning,
                 r"megatron\.core\.(optimizer(\.optimizer|\.clip_grads)?|distributed\.fsdp\.src\.megatron_fsdp"
                 r"\.mixed_precision)",
                 "Megatron-Core's fused optimizer kernels are optional; it uses torch's (on import)"),
    KnownWarning(r"Apex is not installed\. Falling back to Torch Norm", UserWarning,
                 r"megatron\.core\.models\.(backends|gpt\.gpt_layer_specs)",
                 "the local (non-Transformer-Engine) layer specs use torch's norms (on import)"),
    KnownWarning(r"full scope is deprecated\. Use empty cuda_graph_(scope|modules) to capture", UserWarning,
                 r"megatron\.core\.transformer\.transformer_config",
                 "Megatron-Core's own default CUDA-graph scope; no CUDA graphs are captured"),
    KnownWarning(r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
                 r"megatron\.core\.optimizer\.optimizer|megatron_rlcorr\.parallel\.cpu",
                 "Megatron-Core's zero_grad reads .grad of its optimizer's shard views (reported from the CPU "
                 "layer's torch-function hook on CPU)"),
    KnownWarning(r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
                 FutureWarning, r"torch\.distributed\.c10d_logger",
                 "Megatron-Core's distributed optimizer calls the collectives by their older names"),
    KnownWarning(r"`load_state_dict` is deprecated and will be removed in future versions\. Please use `load`",
                 FutureWarning, r"megatron\.core\.dist_checkpointing\.strategies\.torch",
                 "Megatron-Core's checkpoint loader calls torch.distributed.checkpoint's older name (resume)"),
    KnownWarning(r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
                 r"megatron_rlcorr\.parallel\.cpu|megatron\.core\.dist_checkpointing\..*|torch\.distributed\..*",
                 "Megatron-Core's checkpoint format holds ShardedTensors (resume)"),
    KnownWarning(r"When using async grad allreduce it is recommended to set the environment variable "
                 r"CUDA_DEVICE_MAX_CONNECTIONS", UserWarning, r"megatron\.core\.tensor_parallel\.layers",
                 "a CUDA stream setting: nothing to tune without a GPU", cpu_only=True),
    KnownWarning(r"absl\.logging is not installed\. Using logging\.getLogger", UserWarning,
                 r"megatron\.core\.hyper_comm_grid", "Megatron-Core logs through python's logging instead"),
    KnownWarning(r"MimoModelConfig is experimental", UserWarning, r"megatron\.core\.models\.mimo\..*",
                 "imported with Megatron-Core's models; not used here"),
)
KNOWN_RECORDS: tuple[KnownRecord, ...] = (
    KnownRecord("megatron.core.dist_checkpointing.strategies.torch", logging.WARNING,
                r"MCore's async save is deprecated",
                "every checkpoint save goes through it; the project picks Megatron's own writer on purpose "
                "(training/checkpoint.py)"),
    KnownRecord("torch.utils.cpp_extension", logging.WARNING, r"No CUDA runtime is found, using CUDA_HOME=",
                "a machine without a GPU; no extension is built"),
)


def verbose() -> bool:
    """RLCORR_VERBOSE set (to anything but "" or "0"): keep every warning."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _KnownRecordFilter(logging.Filter):
    def __init__(self, known: list[KnownRecord]) -> None:
        super().__init__()
        self.known = [(k.level, re.compile(k.message)) for k in known]

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.levelno == level and pattern.match(record.getMessage()) for level, pattern in self.known)


@contextmanager
def quiet_known_warnings() -> Iterator[None]:
    """Hide KNOWN_WARNINGS and KNOWN_RECORDS while the block runs (nothing with RLCORR_VERBOSE=1);
    the process's warning filters and loggers are as they were afterwards."""
    if verbose():
        yield
        return
    on_gpu = torch.cuda.is_available()
    filters = []
    for name in sorted({k.logger for k in KNOWN_RECORDS}):
        record_filter = _KnownRecordFilter([k for k in KNOWN_RECORDS if k.logger == name])
        logging.getLogger(name).addFilter(record_filter)
        filters.append((name, record_filter))
    try:
        with warnings.catch_warnings():
            for known in KNOWN_WARNINGS:
                if not (known.cpu_only and on_gpu):
                    warnings.filterwarnings("ignore", message=known.message, category=known.category,
                                            module=rf"(?:{known.module})\Z")
            yield
    finally:
        for name, record_filter in filters:
            logging.getLogger(name).removeFilter(record_filter)


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
def process_groups(parallel: ParallelSettings, *, timeout_minutes: int, rollout_tp: int = 1,
                   rollout_ranks: int = 0) -> Iterator[ParallelGroups]:
    """The parallel groups of `parallel` (and rollout groups of `rollout_tp` ranks) on this
    torchrun world, torn down on exit. Every group
    (the default one and Megatron-Core's) gets the collective timeout `timeout_minutes`
    (trainer.timeout_minutes: generating 20k-token responses can outlast torch's 10 minutes).

    `rollout_ranks` R > 0 (rollout.placement: separate): the launch is cut in two roles
    (parallel/world.py). The trainer ranks get the groups of `parallel` over their own world; the
    last R ranks, which only generate, get rollout groups of `rollout_tp` over theirs (and a
    trivial model layout). Either way `groups.launch` says which role this rank plays."""
    with quiet_known_warnings():  # first: Megatron-Core is imported below, and warns as it is
        from .parallel.cpu import enable_cpu_megatron
        from .parallel.groups import build_parallel_groups, destroy_parallel_groups
        from .parallel.world import split_world

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(minutes=timeout_minutes)
        launch = None
        if rollout_ranks:
            launch = split_world(rollout_ranks, backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
        try:
            enable_cpu_megatron()
            if launch is not None and launch.role == "rollout":
                groups = build_parallel_groups(1, 1, 1, timeout_minutes=timeout_minutes, rollout_tp=rollout_tp,
                                               launch=launch)
            else:
                groups = build_parallel_groups(parallel.tp, parallel.pp, parallel.cp, parallel.vpp,
                                               sequence_parallel=parallel.sequence_parallel,
                                               timeout_minutes=timeout_minutes,
                                               rollout_tp=1 if launch is not None else rollout_tp,
                                               ep=parallel.ep, etp=parallel.etp, launch=launch)
            try:
                yield groups
            finally:
                destroy_parallel_groups()
        finally:
            dist.destroy_process_group()
