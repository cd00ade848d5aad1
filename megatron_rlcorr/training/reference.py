"""The reference policy of the KL penalties: a frozen copy of the policy as the run started.

Built like the policy (same layout, model.hf_checkpoint or the seeded initialisation), never
trained: no gradients, no optimizer state, no DDP buffers. Its log-probs come from the trainer's
forward-only pipeline pass (step.compute_old_log_probs), in the same micro-batches as pi_old's,
right after them. With `offload` its weights wait in CPU memory between uses (on a GPU machine;
on CPU there is nothing to move). A resumed run rebuilds it from the same source, so it stays
the starting policy whatever checkpoint the policy resumed from.

Memory: one more copy of the model's weights in the training dtype per rank (its TP/PP shard).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..model.build import build_model_chunks
from ..model.config import ModelConfig
from .old_pass import compute_old_log_probs
from .step_types import StepBatch

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups


@dataclass(frozen=True)
class ReferenceSettings:
    """The recipe's `algorithm.reference` (verl: ref.*.param_offload)."""

    offload: bool = False  # keep the reference's weights in CPU memory between uses


class ReferencePolicy:
    def __init__(self, model_cfg: ModelConfig, groups: ParallelGroups, *, seed: int,
                 settings: ReferenceSettings) -> None:
        self.groups, self.settings = groups, settings
        self.chunks: list[Any] = build_model_chunks(model_cfg, groups, seed=seed)
        for chunk in self.chunks:
            chunk.requires_grad_(False)
            chunk.eval()
        self.device = next(self.chunks[0].parameters()).device
        self._offload()

    def log_probs(self, batch: StepBatch, *, micro_batch_size: int, temperature: float,
                  max_tokens_per_micro_batch: int = 0, routing_replay: bool = False) -> torch.Tensor | None:
        """log pi_ref(targets) [B, T] on last-stage ranks, None elsewhere (collective over the
        model-parallel group, like compute_old_log_probs). MoE: `routing_replay` routes the tokens
        the engine recorded to its experts, as the policy's passes do (training/step.py says why)."""
        self._load()
        try:
            return compute_old_log_probs(self.chunks, batch, groups=self.groups, micro_batch_size=micro_batch_size,
                                         temperature=temperature, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                         routing_replay=routing_replay)
        finally:
            self._offload()

    def _offload(self) -> None:
        if self.settings.offload and self.device.type == "cuda":
            for chunk in self.chunks:
                chunk.cpu()

    def _load(self) -> None:
        if self.settings.offload and self.device.type == "cuda":
            for chunk in self.chunks:
                chunk.to(self.device)
