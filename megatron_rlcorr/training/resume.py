"""Where a run starts: the latest checkpoint of its run directory, loaded into the model, optimizer
and scheduler, or step 0.

`resume_step` is the step of `<run_dir>/checkpoints/latest` when the run resumes; a fresh run
(trainer.resume false) removes that marker, so a later resume never continues the old run's
checkpoints. `load_state` loads the checkpoint of a step: a distributed one (checkpoint.load) on
any layout, or a per-rank one (the format before it) on the layout that wrote it only. Both are
collective over the world. The recipe's lr schedule wins over the checkpoint's (a run may be
extended); the checkpoint gives the step count.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..parallel.groups import ParallelGroups
from . import checkpoint


def resume_step(run_dir: Path, resume: bool) -> int | None:
    """The latest checkpoint's step when `resume`, else None (and the `latest` marker removed)."""
    latest = checkpoint.latest_step(run_dir)
    dist.barrier()  # every rank read the marker before rank 0 may remove it
    if latest is not None and resume:
        return latest
    if latest is not None and dist.get_rank() == 0:
        (run_dir / "checkpoints" / "latest").unlink()  # a fresh run: never resume the old one
    dist.barrier()
    return None


def load_state(run_dir: Path, step: int, *, model_chunks: list[Any], optimizer, scheduler, groups: ParallelGroups,
               layout: dict[str, Any], distributed_optimizer: bool) -> dict[str, Any]:
    """Load step `step`'s checkpoint of `run_dir`; returns its common (trainer) state."""
    directory = checkpoint.checkpoint_dir(run_dir, step)
    scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = True, False
    if not checkpoint.is_legacy(directory):
        return checkpoint.load(directory, model_chunks=model_chunks, optimizer=optimizer, scheduler=scheduler,
                               groups=groups, layout=layout)
    return _load_legacy(run_dir, directory, model_chunks, optimizer, scheduler, layout=layout,
                        distributed_optimizer=distributed_optimizer)


def _load_legacy(run_dir: Path, directory: Path, model_chunks: list[Any], optimizer, scheduler, *,
                 layout: dict[str, Any], distributed_optimizer: bool) -> dict[str, Any]:
    """A per-rank checkpoint (checkpoint.load_legacy), on its own layout."""
    from megatron.core import tensor_parallel

    checkpoint.check_resumable(run_dir, layout, distributed_optimizer=distributed_optimizer)
    state = checkpoint.load_legacy(directory)
    for chunk, chunk_state in zip(model_chunks, state["model"], strict=True):
        chunk.load_state_dict(chunk_state)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    checkpoint.set_rng_state(state["rng"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tp_rng"])
    return state
