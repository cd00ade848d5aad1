"""Run checkpoints with Megatron-Core's dist_checkpointing: resumable on any parallel layout.

`runs/<name>/checkpoints/step_<N>/` is one distributed checkpoint (Megatron's `torch_dist`
format: `metadata.json`, `.metadata`, one `__<rank>_<i>.distcp` file per writing rank, and the
common state: `common.pt` up to Megatron-Core 0.18, inside the `.distcp` files from 0.19 on) plus
`layout.json`, the layout that wrote it, and `checkpoint.json`, what wrote it (Megatron-Core's
version, the optimizer and its format); `checkpoints/latest` names the newest complete step.
What a checkpoint holds:

- model: every chunk's `sharded_state_dict()`: each tensor under its global name (layer numbers
  counted over the whole model, not the pipeline stage; routed experts under their global expert
  index) with the slice this rank holds, so a loading rank reads the slice of its own TP / PP /
  VPP / EP / ETP layout whatever layout wrote it. The
  padded vocabulary changes with TP; Megatron marks the embedding and output rows as
  shape-tolerant and loads the rows both layouts have.
- optimizer: Megatron's optimizer state, per parameter for plain Adam. The distributed
  optimizer's in one of Megatron's two formats (`trainer.optimizer_checkpoint_format`):
  `dp_reshardable` (the default), each rank writes its own flat shard of the float32 master
  weights and Adam moments, nothing gathered: host memory at save is the rank's shard, and it
  loads on the same TP / PP / CP / VPP (and EP / ETP) layout with any DP size; `fully_reshardable`, the shards
  of each data-parallel group are all-gathered and written as canonical per-parameter tensors
  (every rank briefly holds its model-parallel slice's whole optimizer state in float32, x 3),
  which loads on any layout. Megatron-LM makes the same choice (--dist-ckpt-optim-fully-
  reshardable). The loader reads the format from `checkpoint.json` (checkpoints without one
  were written `fully_reshardable`) and refuses a `dp_reshardable` one on another model-parallel
  layout, with the fix: resume on the layout that wrote it with
  `trainer.optimizer_checkpoint_format=fully_reshardable` until its next save.
- common, written once by rank 0: the step, the scheduler, the trainer's state (data position,
  KL controller) and the optimizer kind.
- rng: each rank's python / torch / CUDA / tensor-parallel-tracker states. Restored only on the
  layout that wrote them; a run resumed on another layout keeps the seeds it started with (its
  ranks draw other random numbers anyway).

Checkpoints move forward only: a Megatron-Core release reads what older ones wrote, not what
newer ones write (0.19 moved the common state from `common.pt` into the `.distcp` files, which
0.16 - 0.18 cannot find). `check_readable` refuses a checkpoint written by a newer minor release
than the installed one, naming both versions (for checkpoints without `checkpoint.json`: one
without `common.pt` was written by 0.19 or newer).

Writing: rank 0 creates the directory, every rank writes its shards, then rank 0 writes
`layout.json` and `checkpoint.json` and moves `latest` once all ranks are done, so `latest` never
names a partial checkpoint. With `CheckpointWriter(async_save=True)` the shards are copied to
host memory at save time and written by a background process while training goes on; the next
save, `poll` at a later step, or `close` finishes it and only then moves `latest`. The writer is
Megatron's own: 0.16 has only that one; 0.17+ take `async_strategy` and default to "nvrx"
(nvidia-resiliency-ext, not a dependency), so `async_strategy="mcore"` is passed wherever
`dist_checkpointing.save` accepts it (0.19 logs that it is deprecated in favour of nvrx).

Checkpoints from before this format (per-rank `rank_<R>.pt` files) still load, on the layout that
wrote them only: `check_resumable` refuses another with the fix named, and `load_legacy` reads
them.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import queue
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from .optimizer import inner_optimizers

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups

LAYOUT_FILE = "layout.json"
RECORD_FILE = "checkpoint.json"
LEGACY_RANK_FILE = "rank_{rank:05d}.pt"
# Megatron's names for the distributed optimizer's checkpoint formats (module docstring).
OptimizerFormat = Literal["dp_reshardable", "fully_reshardable"]
# What checkpoints without a record (before checkpoint.json) were written in.
UNRECORDED_FORMAT = "fully_reshardable"
# The layout keys a dp_reshardable optimizer state depends on (its DP size may change; the experts' state is
# sharded over the expert-data-parallel group, which ep and etp change).
MODEL_PARALLEL_KEYS = ("tp", "pp", "cp", "vpp", "ep", "etp")
# The first release that keeps the common state inside the .distcp files (no common.pt).
COMMON_IN_DISTCP = "0.19"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest_step(run_dir: Path) -> int | None:
    marker = run_dir / "checkpoints" / "latest"
    if not marker.is_file():
        return None
    return int(marker.read_text().strip())


def is_legacy(directory: Path) -> bool:
    """A per-rank checkpoint from before the distributed format."""
    return (directory / LEGACY_RANK_FILE.format(rank=0)).is_file()


def saved_layout(directory: Path) -> dict[str, Any] | None:
    record = directory / LAYOUT_FILE
    return json.loads(record.read_text()) if record.is_file() else None


def describe(layout: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in layout.items())


def saved_record(directory: Path) -> dict[str, Any] | None:
    """What wrote the checkpoint: {"megatron_core": version, "optimizer": "distributed" | "plain" |
    None, "optimizer_format": OptimizerFormat}; None for checkpoints from before the record."""
    record = directory / RECORD_FILE
    return json.loads(record.read_text()) if record.is_file() else None


def megatron_core_version() -> str:
    """The installed megatron-core's version (from its distribution: no import of Megatron)."""
    from importlib.metadata import version

    return version("megatron-core")


def _release(version: str) -> tuple[int, int]:
    from packaging.version import Version

    return (*Version(version).release, 0)[:2]


def check_readable(directory: Path, installed: str | None = None) -> None:
    """ValueError when the installed Megatron-Core cannot read the checkpoint: one written by a
    newer minor release (checkpoints move forward only; module docstring)."""
    installed = installed or megatron_core_version()
    record = saved_record(directory)
    if record is not None:
        writer = record["megatron_core"]
        if _release(writer) > _release(installed):
            raise ValueError(f"checkpoint {directory} was written by Megatron-Core {writer}, but megatron-core "
                             f"{installed} is installed: checkpoints move forward only (a release reads what "
                             f"older ones wrote, not what newer ones write). Resume it where megatron-core>={writer} is "
                             f"installed, or start afresh with trainer.resume=false")
        return
    written_by_019 = (directory / "metadata.json").is_file() and not (directory / "common.pt").is_file()
    if written_by_019 and _release(installed) < _release(COMMON_IN_DISTCP):
        raise ValueError(f"checkpoint {directory} has no common.pt: it was written by Megatron-Core "
                         f"{COMMON_IN_DISTCP} or newer (which keeps the common state inside the .distcp files), "
                         f"but megatron-core {installed} is installed and cannot read it: checkpoints move forward "
                         f"only. Resume it where megatron-core>={COMMON_IN_DISTCP} is installed, or start afresh "
                         "with trainer.resume=false")


def check_optimizer_format(directory: Path, layout: dict[str, Any]) -> None:
    """ValueError when the checkpoint's distributed-optimizer state is in the DP-sharded format
    and `layout` differs from the one that wrote it in TP, PP, CP, VPP, EP or ETP."""
    record, saved = saved_record(directory), saved_layout(directory)
    if record is None or record.get("optimizer") != "distributed" or saved is None:
        return
    if record["optimizer_format"] != "dp_reshardable":
        return
    # A layout without ep / etp (dense, or ep = etp = 1: ParallelSettings.layout) has 1 of each.
    defaults = {"ep": 1, "etp": 1}
    changed = [key for key in MODEL_PARALLEL_KEYS
               if saved.get(key, defaults.get(key)) != layout.get(key, defaults.get(key))]
    if changed:
        raise ValueError(f"checkpoint {directory} holds the distributed optimizer's state in the DP-sharded format "
                         f"(trainer.optimizer_checkpoint_format=dp_reshardable), which loads with another DP size "
                         f"but not with another {'/'.join(changed)}: it was written by {describe(saved)}, this run "
                         f"has {describe(layout)}. Resume once on the layout that wrote it with "
                         "trainer.optimizer_checkpoint_format=fully_reshardable (and e.g. trainer.exit_interval to "
                         "save and stop), then change the layout; or start afresh with trainer.resume=false")


# ---- RNG ----------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tracker" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# ---- the sharded state dict -----------------------------------------------------------------------

def _metadata(groups: ParallelGroups, optimizer_format: OptimizerFormat = UNRECORDED_FORMAT) -> dict[str, Any]:
    # What Megatron-LM passes to sharded_state_dict (the group is not saved, the rest is).
    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "distrib_optim_sharding_type": optimizer_format, "dp_cp_group": groups.dp_cp}


def _content_metadata(groups: ParallelGroups, optimizer_format: OptimizerFormat) -> dict[str, Any]:
    return {k: v for k, v in _metadata(groups, optimizer_format).items() if k != "dp_cp_group"}


def _model_state(model_chunks: list[Any], groups: ParallelGroups) -> dict[str, Any]:
    metadata = _metadata(groups)  # the model's sharding does not depend on the optimizer's format
    state = {}
    for i, chunk in enumerate(model_chunks):
        module = chunk.module if hasattr(chunk, "ddp_config") else chunk
        state[f"model{i}"] = module.sharded_state_dict(metadata=metadata)
    return state


def _rng_object(groups: ParallelGroups):
    from megatron.core.dist_checkpointing import ShardedObject

    world, rank = dist.get_world_size(), dist.get_rank()
    return ShardedObject("rng_state_by_rank", rng_state(), (world,), (rank,), replica_id=0)


def _optimizer_kind(optimizer) -> str:
    return "distributed" if inner_optimizers(optimizer)[0].__class__.__name__ == "DistributedOptimizer" else "plain"


def _full_state(model_chunks, optimizer, scheduler, groups, common: dict[str, Any], *, is_loading: bool,
                with_rng: bool, optimizer_format: OptimizerFormat) -> dict[str, Any]:
    state = _model_state(model_chunks, groups)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                          metadata=_metadata(groups, optimizer_format))
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["common"] = common
    if with_rng:
        state["rng"] = _rng_object(groups)
    return state


# ---- saving -------------------------------------------------------------------------------------

@contextlib.contextmanager
def _in_process_write_results() -> Iterator[None]:
    """A synchronous save's write results through an in-process queue: Megatron-Core's file writer
    spawns a multiprocessing Manager for its queue on first use, asynchronous or not (a process per
    rank that imports the launch's main module again: seconds) for what a synchronous save fills and
    reads here. Put back afterwards (a later asynchronous save gets its Manager); where there is no
    such module global, or a Manager's queue exists, Megatron-Core's own is used."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:
        yield
        return
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None


class CheckpointWriter:
    """Saves checkpoints, synchronously or in a background process (`async_save`).

    At most one asynchronous save is in flight: a new save first finishes the previous one.
    `poll()` (every rank, at every step: it is collective) moves `latest` as soon as a background
    save is done; `close()` waits for it.
    """

    def __init__(self, async_save: bool = False, optimizer_format: OptimizerFormat = "dp_reshardable"):
        self.async_save = async_save
        self.optimizer_format = optimizer_format
        self._queue = None
        self._pending: Callable[[], None] | None = None  # a synchronous save's `latest` move, deferred

    def save(self, run_dir: Path, step: int, *, model_chunks: list[Any], optimizer, scheduler,
             groups: ParallelGroups, common: dict[str, Any], layout: dict[str, Any],
             extra: Callable[[Path], None] | None = None, defer_latest: bool = False) -> Path:
        """Save step `step`'s checkpoint; `extra(directory)` (every rank) writes files of the caller's
        into it, on disk before `latest` moves to it (rl/async_rollout.py: the rollouts in flight).
        `defer_latest`: `latest` moves at the next poll() or close(), not now; a caller that saves
        before it logs the step (rl/trainer.py, rollout.placement separate) polls after logging, so a
        crash in between resumes from the checkpoint before, whose run logged every step."""
        from megatron.core import dist_checkpointing

        self.close()
        directory = checkpoint_dir(run_dir, step)
        rank0 = dist.get_rank() == 0
        if rank0:
            directory.mkdir(parents=True, exist_ok=True)
            for stale in directory.iterdir():  # a crashed earlier save of this step
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        dist.barrier()
        random_state = rng_state()  # torch's distributed checkpoint writer draws random numbers
        if optimizer is not None:
            start_adam_state(optimizer)
        kind = _optimizer_kind(optimizer) if optimizer is not None else None
        state = _full_state(model_chunks, optimizer, scheduler, groups, {**common, "optimizer_kind": kind},
                            is_loading=False, with_rng=True, optimizer_format=self.optimizer_format)
        with contextlib.nullcontext() if self.async_save else _in_process_write_results():
            request = dist_checkpointing.save(state, str(directory), _save_strategy(groups),
                                              async_sharded_save=self.async_save,
                                              content_metadata=_content_metadata(groups, self.optimizer_format),
                                              **async_options(dist_checkpointing.save))
        set_rng_state(random_state)  # saving must not change what the run draws next
        if extra is not None:
            extra(directory)
        record = {"megatron_core": megatron_core_version(), "optimizer": kind,
                  "optimizer_format": self.optimizer_format}

        def finish() -> None:
            if rank0:
                (directory / LAYOUT_FILE).write_text(json.dumps(layout) + "\n")
                (directory / RECORD_FILE).write_text(json.dumps(record) + "\n")
                (run_dir / "checkpoints" / "latest").write_text(f"{step}\n")

        if not self.async_save:
            dist.barrier()  # every rank's shards are on disk before `latest` moves
            if defer_latest:
                self._pending = finish
                return directory
            finish()
            dist.barrier()
            return directory
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        request.add_finalize_fn(finish)  # runs on every rank once all ranks finished writing
        self._queue = AsyncCallsQueue()
        self._queue.schedule_async_request(request)
        return directory

    def poll(self) -> None:
        self._finish_pending()
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=False)

    def close(self) -> None:
        self._finish_pending()
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)
            self._queue.close()
            self._queue = None
            dist.barrier()


    def drop_pending(self) -> None:
        """Never move `latest` to a save deferred with `defer_latest` (the run failed before logging it)."""
        self._pending = None

    def _finish_pending(self) -> None:
        if self._pending is not None:
            finish, self._pending = self._pending, None
            finish()
            dist.barrier()


def async_options(save) -> dict[str, Any]:
    """The writer for `dist_checkpointing.save`: Megatron's own ("mcore") where `save` takes
    `async_strategy` (0.17+, whose default "nvrx" needs nvidia-resiliency-ext); nothing on 0.16,
    whose only writer it is."""
    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(save).parameters else {}


def _save_strategy(groups: ParallelGroups):
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # Replicated tensors (every DP x CP rank holds the same model slice) are written once, the
    # writing spread over the DP x CP group instead of all on its first rank.
    return FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1), groups.dp_cp)


# ---- loading ------------------------------------------------------------------------------------

def load(directory: Path, *, model_chunks: list[Any], optimizer, scheduler, groups: ParallelGroups,
         layout: dict[str, Any]) -> dict[str, Any]:
    """Load a distributed checkpoint into this rank's model / optimizer / scheduler (any layout);
    the RNG too when `layout` is the one that wrote it. Returns the common (trainer) state."""
    from megatron.core import dist_checkpointing

    check_readable(directory)
    check_optimizer_format(directory, layout)
    record = saved_record(directory)
    optimizer_format = record["optimizer_format"] if record is not None else UNRECORDED_FORMAT
    common = dist_checkpointing.load_common_state_dict(str(directory))["common"]
    saved_kind = common.get("optimizer_kind")
    if optimizer is not None and saved_kind != _optimizer_kind(optimizer):
        raise ValueError(f"checkpoint {directory} holds the state of the {saved_kind} optimizer but this run uses the "
                         f"{_optimizer_kind(optimizer)} one: set optim.use_distributed_optimizer="
                         f"{str(saved_kind == 'distributed').lower()} to resume it")
    if optimizer is not None:
        start_adam_state(optimizer)  # a fresh optimizer's state, for the load to fill in
    same_layout = saved_layout(directory) == layout
    state = _full_state(model_chunks, optimizer, scheduler, groups, common, is_loading=True, with_rng=same_layout,
                        optimizer_format=optimizer_format)
    loaded = dist_checkpointing.load(state, str(directory), _load_strategy(groups))
    for i, chunk in enumerate(model_chunks):
        chunk.load_state_dict(loaded[f"model{i}"], strict=True)
    if optimizer is not None:
        # dp_reshardable's loader copies into the master weights without no_grad: with fp32 weights they
        # are views of the parameters (leaves that require grad), and autograd refuses in-place copies.
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        set_rng_state(loaded["rng"])
    return loaded["common"]


def load_model(directory: Path, model_chunks: list[Any], groups: ParallelGroups) -> None:
    """Only the model's weights (score, export): any layout."""
    from megatron.core import dist_checkpointing

    check_readable(directory)
    loaded = dist_checkpointing.load(_model_state(model_chunks, groups), str(directory), _load_strategy(groups))
    for i, chunk in enumerate(model_chunks):
        chunk.load_state_dict(loaded[f"model{i}"], strict=True)


def _load_strategy(groups: ParallelGroups):
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    return FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), groups.dp_cp)


def start_adam_state(optimizer) -> None:
    """Give every parameter without Adam state the state torch's Adam starts from (step 0, zero
    moments), on the CPU path (torch's Adam under Megatron's optimizer).

    Why: Megatron's distributed optimizer cannot describe an empty torch-Adam state (it reads one
    `step` from the states), which a fresh optimizer has when it loads a checkpoint, and a run
    whose every update so far was skipped (a zero gradient: every token rejected,
    training/optimizer.step_optimizer) has when it saves one. From step 0 and zero moments
    torch's Adam computes exactly what it computes from no state, so a save resumes as the run
    would have continued, and a load overwrites them. (Megatron's own answer, an Adam step on
    zero gradients, would step a run that never updated.) TE's and apex's Adam, on GPU, describe
    an empty state by themselves.
    """
    for inner in inner_optimizers(optimizer):
        adam = getattr(inner, "optimizer", None)
        if not isinstance(adam, torch.optim.Adam):  # torch's AdamW subclasses it
            continue
        for group in adam.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for param in group["params"]:
                if adam.state[param]:
                    continue
                adam.state[param] = {
                    "step": torch.zeros((), dtype=_adam_step_dtype(), device=param.device if on_device else None),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    **({"max_exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
                       if group.get("amsgrad") else {}),
                }


def _adam_step_dtype() -> torch.dtype:
    # torch's Adam keeps `step` in float32 (float64 when that is the default dtype).
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


# ---- per-rank checkpoints (the format before dist_checkpointing) ---------------------------------

def check_resumable(run_dir: Path, layout: dict[str, Any], *, distributed_optimizer: bool) -> None:
    """ValueError if the latest checkpoint of `run_dir` is a per-rank one written by another
    parallel layout, or for the distributed optimizer (per-rank checkpoints hold the plain
    optimizer's state); a distributed checkpoint that the installed Megatron-Core cannot read
    (`check_readable`) or whose DP-sharded optimizer state does not fit `layout`
    (`check_optimizer_format`). Checked before any process group exists."""
    step = latest_step(run_dir)
    if step is None:
        return
    if not is_legacy(checkpoint_dir(run_dir, step)):
        check_readable(checkpoint_dir(run_dir, step))
        check_optimizer_format(checkpoint_dir(run_dir, step), layout)
        return
    if distributed_optimizer:
        raise ValueError(f"trainer.resume: {checkpoint_dir(run_dir, step)} is a per-rank checkpoint (from before "
                         "distributed checkpoints) of the plain, replicated Adam; resume it with "
                         "optim.use_distributed_optimizer=false, or start afresh with trainer.resume=false")
    saved = saved_layout(checkpoint_dir(run_dir, step))
    if saved is not None and saved != layout:
        raise ValueError(f"trainer.resume: the checkpoint {checkpoint_dir(run_dir, step)} was written by the layout "
                         f"{describe(saved)}, but this run has {describe(layout)}; per-rank checkpoints (from before "
                         f"distributed checkpoints) resume only on the layout that wrote them. Launch with that "
                         f"layout, or start afresh with trainer.resume=false (or another name / trainer.output_dir)")


def load_legacy(directory: Path) -> dict[str, Any]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = directory / LEGACY_RANK_FILE.format(rank=rank)
    if not path.is_file():
        raise ValueError(f"checkpoint {path} is missing: was the run saved with a different number of processes? "
                         f"Resume with the same parallel layout, or start fresh with trainer.resume=false")
    return torch.load(path, map_location="cpu", weights_only=False)
