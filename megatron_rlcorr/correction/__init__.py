"""Rollout correction: IS weights, rejection sampling and off-policy metrics (pure torch).

No megatron, TE or vLLM import here: process groups are passed in explicitly.
"""
from .core import CorrectionResult, compute_rollout_correction

__all__ = ["CorrectionResult", "compute_rollout_correction"]
