"""Per-rank checkpoints: `runs/<name>/checkpoints/step_<N>/rank_<R>.pt` plus a `latest` marker.

Each rank saves its own shard (model chunk parameters, optimizer and scheduler state, RNG state,
trainer counters), so a resumed run with the same layout continues bit-for-bit. The layout that
wrote a checkpoint is recorded beside it (`layout.json`), and resuming on another one stops with
an error before any process group exists instead of loading mismatched shards. The marker is
written by global rank 0 after every rank has finished writing, so a crash mid-save never leaves
a `latest` that points to a partial checkpoint.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LAYOUT_FILE = "layout.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest_step(run_dir: Path) -> int | None:
    marker = run_dir / "checkpoints" / "latest"
    if not marker.is_file():
        return None
    return int(marker.read_text().strip())


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def check_resumable(run_dir: Path, layout: dict[str, Any]) -> None:
    """ValueError if the latest checkpoint of `run_dir` was written by another parallel layout
    (checkpoints from before layouts were recorded are not checked)."""
    step = latest_step(run_dir)
    record = checkpoint_dir(run_dir, step) / LAYOUT_FILE if step is not None else None
    if record is None or not record.is_file():
        return
    saved = json.loads(record.read_text())
    if saved != layout:
        raise ValueError(f"trainer.resume: the checkpoint {record.parent} was written by the layout {_describe(saved)}, "
                         f"but this run has {_describe(layout)}; per-rank checkpoints resume only on the layout "
                         f"that wrote them. Launch with that layout, or start afresh with trainer.resume=false "
                         f"(or another name / trainer.output_dir)")


def _describe(layout: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in layout.items())


def save(run_dir: Path, step: int, state: dict[str, Any], layout: dict[str, Any]) -> Path:
    rank = dist.get_rank() if dist.is_initialized() else 0
    directory = checkpoint_dir(run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"rank_{rank:05d}.pt.tmp"
    torch.save(state, tmp)
    tmp.rename(directory / f"rank_{rank:05d}.pt")
    if rank == 0:
        (directory / LAYOUT_FILE).write_text(json.dumps(layout) + "\n")
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        (run_dir / "checkpoints" / "latest").write_text(f"{step}\n")
    if dist.is_initialized():
        dist.barrier()
    return directory


def load(run_dir: Path, step: int) -> dict[str, Any]:
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = checkpoint_dir(run_dir, step) / f"rank_{rank:05d}.pt"
    if not path.is_file():
        raise ValueError(f"checkpoint {path} is missing: was the run saved with a different number of processes? "
                         f"Resume with the same parallel layout, or start fresh with trainer.resume=false")
    return torch.load(path, map_location="cpu", weights_only=False)
