"""KL to a reference policy: verl's per-token estimators, and the KL-loss settings.

Estimators of KL(pi_theta || pi_ref) from the sampled token's log-probs (J. Schulman,
"Approximating KL divergence", 2020), with verl's names:

| type | value at a sampled token, d = log pi_theta - log pi_ref |
|---|---|
| `kl` / `k1` | d |
| `abs` | abs(d) |
| `mse` / `k2` | d^2 / 2 |
| `low_var_kl` / `k3` | exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10] |

A `+` suffix (`k1+`, `k3+`, `low_var_kl+`, `abs+`) keeps the value of the estimator but takes the
gradient of k2 (straight-through): k1 and k3 are unbiased estimators of the KL's value, but their
expected gradient is not the KL's gradient, which k2's is. (verl at b178a3cd documents the `+`
types but raises NotImplementedError for them; they run here.)

`kl_loss` (KLLossSettings) adds `coef * agg(estimator)` to the policy loss, aggregated with the
loss's own mode and global normalisers, on the tokens the loss counts (rejection applies).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ..settings import check_choice

KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                 "kl+", "k1+", "abs+", "low_var_kl+", "k3+"]
KL_TYPES: tuple[str, ...] = get_args(KLType)

_K3_LOG_RATIO_BOUND = 20.0
_K3_VALUE_BOUND = 10.0


@dataclass(frozen=True)
class KLLossSettings:
    """The recipe's `algorithm.kl_loss`: a KL penalty to the reference policy in the loss (verl's
    actor.use_kl_loss / kl_loss_coef / kl_loss_type; same defaults)."""

    enabled: bool = False        # add coef * KL(pi_theta || pi_ref) to the loss (builds the reference policy)
    coef: float = 0.001          # the KL term's weight; finite, >= 0
    type: KLType = "low_var_kl"  # per-token estimator (training/kl.py); a + suffix takes k2's gradient

    def __post_init__(self) -> None:
        check_choice("type", self.type, KL_TYPES)
        if not (math.isfinite(self.coef) and self.coef >= 0):
            raise ValueError(f"coef must be a finite number >= 0, got {self.coef}")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate of the given type (module docstring); differentiable in log_prob."""
    check_choice("kl type", kl_type, KL_TYPES)
    base = kl_type.removesuffix("+")
    value = _estimate(log_prob, ref_log_prob, base)
    if not kl_type.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    return k2 - k2.detach() + value.detach()


def _estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, base: str) -> torch.Tensor:
    if base in ("kl", "k1"):
        return log_prob - ref_log_prob
    if base == "abs":
        return (log_prob - ref_log_prob).abs()
    if base in ("mse", "k2"):
        return 0.5 * (log_prob - ref_log_prob).square()
    log_ratio = (ref_log_prob - log_prob).clamp(-_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
    return (log_ratio.exp() - log_ratio - 1).clamp(-_K3_VALUE_BOUND, _K3_VALUE_BOUND)
