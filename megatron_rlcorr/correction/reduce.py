"""Named partial statistics that are all-reduced together: one SUM buffer, one MAX buffer.

The correction reduces twice: per-sequence statistics over the CP group (so every CP rank sees
whole sequences before deciding anything), then batch statistics over the DP group. Each stage
packs all its tensors into one buffer per reduction op, so a call costs at most two collectives
per group, O(sequences) bytes, and no host synchronisation. Minima travel as negated maxima.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Partials:
    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._maxes: dict[str, torch.Tensor] = {}

    def add_sum(self, name: str, value: torch.Tensor) -> None:
        assert name not in self._sums, f"duplicate partial {name}"
        self._sums[name] = value

    def add_max(self, name: str, value: torch.Tensor) -> None:
        assert name not in self._maxes, f"duplicate partial {name}"
        self._maxes[name] = value

    def add_min(self, name: str, value: torch.Tensor) -> None:
        self.add_max(name, -value)

    def sum(self, name: str) -> torch.Tensor:
        return self._sums[name]

    def max(self, name: str) -> torch.Tensor:
        return self._maxes[name]

    def min(self, name: str) -> torch.Tensor:
        return -self._maxes[name]

    @staticmethod
    def concat_rows(parts: list["Partials"]) -> "Partials":
        """Per-row partials of consecutive row blocks, joined in row order."""
        if len(parts) == 1:
            return parts[0]
        out = Partials()
        out._sums = {name: torch.cat([p._sums[name] for p in parts]) for name in parts[0]._sums}
        out._maxes = {name: torch.cat([p._maxes[name] for p in parts]) for name in parts[0]._maxes}
        return out

    def all_reduce(self, group: dist.ProcessGroup | None) -> "Partials":
        """Reduce in place over `group` (no-op for None or a group of one) and return self."""
        if group is None or dist.get_world_size(group) == 1:
            return self
        _all_reduce_packed(self._sums, dist.ReduceOp.SUM, group)
        _all_reduce_packed(self._maxes, dist.ReduceOp.MAX, group)
        return self


def _all_reduce_packed(named: dict[str, torch.Tensor], op: dist.ReduceOp, group: dist.ProcessGroup) -> None:
    if not named:
        return
    names = list(named)
    dtype = torch.promote_types(torch.float32, named[names[0]].dtype)
    for name in names[1:]:
        dtype = torch.promote_types(dtype, named[name].dtype)
    flat = [named[n].reshape(-1).to(dtype) for n in names]
    buffer = torch.cat(flat)
    dist.all_reduce(buffer, op=op, group=group)
    for name, piece in zip(names, buffer.split([f.numel() for f in flat])):
        named[name] = piece.view(named[name].shape).to(named[name].dtype)
