"""What one training step takes and gives: the mini-batch (StepBatch, checked by check_batch), the
step's settings (StepConfig) and an update's result (StepResult).

Conventions: a StepBatch holds one data-parallel rank's full (un-split) sequences, right-padded
`[B, T]`, identical on every TP / CP / PP rank of that DP rank; per-token tensors are indexed by the
position of the TARGET token (targets_BT[:, t] is what position t predicts). Everything else of the
step (training/step.py) and of the forward-only passes (training/old_pass.py) reads these types.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import RolloutCorrectionConfig
from ..correction.compiled import COMPILE_MODES, CompileMode
from ..settings import check_choice
from .kl import KLLossSettings
from .losses import LossConfig


@dataclass
class StepBatch:
    """One DP rank's mini-batch: full (un-split) sequences, padded [B, T], identical on every TP/CP/PP rank of that DP rank."""
    tokens_BT: torch.Tensor            # int64 input tokens (prompt + response, right-padded with pad id 0)
    targets_BT: torch.Tensor           # int64, tokens_BT shifted left by one (target of position t); pad at the end
    response_mask_BT: torch.Tensor     # float32 0/1: 1 where targets_BT[:, t] is a response token to train on
    rollout_log_probs_BT: torch.Tensor # float32 engine log-prob of targets_BT[:, t] (garbage where mask is 0)
    advantages_BT: torch.Tensor        # float32 per-token advantage
    # MoE: the experts the rollout engine routed each position's token to, int16 [B, T, MoE layers, k]
    # (axis 2: DecoderShape.moe_layers), -1 where it recorded none (padding, prompt positions it did
    # not report, each sequence's last token); None for a dense model or an engine that records none.
    # rollout.routing_replay replays it (routing_replay.py); the routing metrics compare against it.
    routed_experts_BTLK: torch.Tensor | None = None


@dataclass(frozen=True)
class StepConfig:
    loss: LossConfig
    correction: RolloutCorrectionConfig
    micro_batch_size: int
    temperature: float = 1.0      # rollout temperature, applied to logits before log-probs
    # > 0: packed micro-batches of at most this many tokens per rank (micro_batch_size unused)
    max_tokens_per_micro_batch: int = 0
    kl_loss: KLLossSettings = KLLossSettings()
    # seq-mean-token-sum-norm's F when loss.loss_scale_factor is unset (the response length limit)
    response_limit: int = 1
    # rollout.routing_replay: MoE tokens the engine recorded go to its experts in every forward (routing_replay.py)
    routing_replay: bool = False
    # algorithm.correction_compile: "eager" (the reference) or "torch" (torch.compile, correction/compiled.py)
    correction_compile: CompileMode = "eager"

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 0 (0: padded micro-batches), got "
                             f"{self.max_tokens_per_micro_batch}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        check_choice("correction_compile", self.correction_compile, COMPILE_MODES)

    @property
    def loss_scale_factor(self) -> float:
        return self.loss.loss_scale_factor or float(self.response_limit)

    @property
    def use_policy_gradient(self) -> bool:
        return self.correction.use_policy_gradient or self.loss.loss_type == "policy_gradient"


@dataclass
class StepResult:
    metrics: dict[str, torch.Tensor]  # 0-d tensors, identical on ALL ranks
    grad_norm: torch.Tensor
    update_successful: bool



def check_batch(batch: StepBatch) -> None:
    """ValueError unless every tensor of `batch` is [B, T] like tokens_BT (routed experts: [B, T, L, k])."""
    shape = batch.tokens_BT.shape
    if batch.tokens_BT.dim() != 2:
        raise ValueError(f"StepBatch.tokens_BT must be [B, T], got shape {tuple(shape)}")
    for field in dataclasses.fields(batch):
        tensor = getattr(batch, field.name)
        if tensor is None:
            continue
        per_token = field.name == "routed_experts_BTLK"  # [B, T, MoE layers, top-k]
        if tensor.shape[:2] != shape or (tensor.dim() != 2 and not per_token):
            raise ValueError(f"StepBatch.{field.name} has shape {tuple(tensor.shape)}, expected tokens_BT's "
                             f"{tuple(shape)}" + (" + [MoE layers, top-k]" if per_token else ""))
    routed = batch.routed_experts_BTLK
    if routed is not None and (routed.dim() != 4 or routed.is_floating_point()):
        raise ValueError(f"StepBatch.routed_experts_BTLK must be an integer [B, T, MoE layers, top-k] tensor, got "
                         f"{routed.dtype} of shape {tuple(routed.shape)}")
    for name in ("tokens_BT", "targets_BT"):
        if getattr(batch, name).is_floating_point():
            raise ValueError(f"StepBatch.{name} must be an integer tensor, got {getattr(batch, name).dtype}")

