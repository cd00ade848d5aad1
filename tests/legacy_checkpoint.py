"""Writes checkpoints in the per-rank format megatron-rlcorr used before distributed checkpoints
(`step_<N>/rank_<R>.pt` + `layout.json` + `checkpoints/latest`), so tests can check that such
checkpoints still load on their own layout and are refused, with the fix named, on another."""
import json
from pathlib import Path

import torch


def write_legacy(run_dir: Path, step: int, states: list[dict], layout: dict | None) -> Path:
    """One rank file per entry of `states` (rank order); no layout record when layout is None."""
    directory = run_dir / "checkpoints" / f"step_{step:06d}"
    directory.mkdir(parents=True, exist_ok=True)
    for rank, state in enumerate(states):
        torch.save(state, directory / f"rank_{rank:05d}.pt")
    if layout is not None:
        (directory / "layout.json").write_text(json.dumps(layout) + "\n")
    (run_dir / "checkpoints" / "latest").write_text(f"{step}\n")
    return directory


def legacy_state(model_chunks, optimizer, scheduler, step: int, **extra) -> dict:
    """What a rank saved: its chunks, the plain optimizer, the scheduler, RNG and counters."""
    import random

    from megatron.core import tensor_parallel

    return {"step": step, "model": [chunk.state_dict() for chunk in model_chunks],
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "tp_rng": tensor_parallel.get_cuda_rng_tracker().get_states(), **extra}
