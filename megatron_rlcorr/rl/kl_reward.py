"""KL to the reference policy as a reward penalty (verl's `algorithm.use_kl_in_reward`).

Each response's reward loses `beta * sum_t kl_t`, kl_t the per-token estimator (training/kl.py)
of the log-probs the step trains against (pi_old in decoupled mode, pi_rollout in bypass mode)
versus the reference policy's, over the response tokens. Advantages are then computed from the
penalised rewards; fillers keep their (empty) masks and so their zero advantage.

The coefficient beta is fixed, or adaptive (Ziegler et al. 2019, as verl): after each step
beta *= 1 + clip(KL / target_kl - 1, -0.2, 0.2) * sequences / horizon, with KL the step's mean
over sequences of their per-token mean estimate, over every data-parallel rank. beta stays a
0-d tensor (no host sync) and is saved in checkpoints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from ..settings import check_choice
from ..training.kl import KL_TYPES, KLType, kl_penalty

Controller = Literal["fixed", "adaptive"]
_PROPORTIONAL_CLIP = 0.2


@dataclass(frozen=True)
class KLInRewardSettings:
    """The recipe's `algorithm.kl_in_reward` (verl: use_kl_in_reward, kl_penalty, kl_ctrl.*)."""

    enabled: bool = False             # reward -= beta x the response's summed per-token KL to the reference policy
    coef: float = 0.001               # beta: fixed, or the adaptive controller's initial value; finite, >= 0
    type: KLType = "kl"               # per-token estimator (training/kl.py)
    controller: Controller = "fixed"  # fixed: beta = coef; adaptive: beta steered to target_kl (rl/kl_reward.py)
    target_kl: float = 0.1            # adaptive: the per-token KL (mean over the step's sequences) to steer to; > 0
    horizon: int = 10000              # adaptive: beta changes per step by at most 0.2 x the step's sequences / horizon

    def __post_init__(self) -> None:
        check_choice("type", self.type, KL_TYPES)
        check_choice("controller", self.controller, Controller)
        if not (math.isfinite(self.coef) and self.coef >= 0):
            raise ValueError(f"coef must be a finite number >= 0, got {self.coef}")
        if not self.target_kl > 0 or self.horizon < 1:
            raise ValueError(f"target_kl must be > 0 and horizon >= 1, got {self.target_kl}, {self.horizon}")


class KLController:
    """beta, fixed or adapted to a target KL (module docstring)."""

    def __init__(self, settings: KLInRewardSettings) -> None:
        self.settings = settings
        self.value = torch.tensor(settings.coef, dtype=torch.float64)

    def update(self, current_kl: torch.Tensor, num_sequences: int) -> None:
        if self.settings.controller == "fixed":
            return
        error = (current_kl.double() / self.settings.target_kl - 1).clamp(-_PROPORTIONAL_CLIP, _PROPORTIONAL_CLIP)
        self.value = self.value.to(error.device) * (1 + error * num_sequences / self.settings.horizon)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"value": self.value.cpu()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.value = state["value"].double()


def kl_penalised_rewards(rewards_B: torch.Tensor, log_probs_BT: torch.Tensor, ref_log_probs_BT: torch.Tensor,
                         mask_BT: torch.Tensor, controller: KLController,
                         dp_group: dist.ProcessGroup | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(rewards minus beta x each sequence's summed KL, metrics), then the controller's update.

    Collective over dp_group (two numbers). Sequences without response tokens (fillers) are
    neither penalised nor counted.
    """
    mask = mask_BT != 0
    with torch.no_grad():
        kl_BT = torch.where(mask, kl_penalty(log_probs_BT.float(), ref_log_probs_BT.float(),
                                             controller.settings.type), 0.0)
    counts_B = mask.sum(dim=-1)
    beta = controller.value.to(rewards_B.device)
    penalised_B = rewards_B - (beta * kl_BT.sum(dim=-1)).to(rewards_B.dtype)
    seq_kl_B = kl_BT.sum(dim=-1) / counts_B.clamp(min=1)
    totals = torch.stack([seq_kl_B.sum().double(), (counts_B > 0).sum().double()])
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(totals, group=dp_group)
    current_kl = totals[0] / totals[1].clamp(min=1)
    metrics = {"actor/reward_kl_penalty": current_kl.float(), "actor/reward_kl_penalty_coeff": beta.float()}
    controller.update(current_kl, int(rewards_B.numel() * (dist.get_world_size(dp_group) if dp_group else 1)))
    return penalised_B, metrics
