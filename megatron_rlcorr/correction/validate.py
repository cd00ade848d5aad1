"""Input checks for `compute_rollout_correction`.

Layout checks (shapes, dtypes) read only tensor metadata and always run. Value checks (NaN, +inf
or positive log-probs at valid positions, a mask that is not 0/1, malformed cu_seqlens) need the
data: they are counted on the device and fetched with ONE host synchronisation, and only when
the caller asks for them (`check_inputs=True`).
"""
from __future__ import annotations

import torch


def check_layout(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                 cu_seqlens: torch.Tensor | None) -> None:
    for name, t in (("old_log_prob", old_log_prob), ("rollout_log_prob", rollout_log_prob)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor of log-probs, got dtype {t.dtype}")
    if not isinstance(response_mask, torch.Tensor):
        raise ValueError(f"response_mask must be a torch.Tensor, got {type(response_mask).__name__}")
    if response_mask.is_complex():
        raise ValueError(f"response_mask must be bool, integer or float 0/1, got dtype {response_mask.dtype}")
    shapes = {"old_log_prob": old_log_prob.shape, "rollout_log_prob": rollout_log_prob.shape,
              "response_mask": response_mask.shape}
    if len(set(shapes.values())) != 1:
        raise ValueError("old_log_prob, rollout_log_prob and response_mask must have the same shape, got "
                         + ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items()))
    devices = {old_log_prob.device, rollout_log_prob.device, response_mask.device}
    if len(devices) != 1:
        raise ValueError(f"old_log_prob, rollout_log_prob and response_mask must be on one device, got {devices}")
    if cu_seqlens is None:
        if old_log_prob.dim() != 2:
            raise ValueError(f"the padded layout needs [batch, seq_len] tensors, got shape {tuple(old_log_prob.shape)}; "
                             f"for packed sequences pass 1-D tensors with cu_seqlens")
        return
    if old_log_prob.dim() != 1:
        raise ValueError(f"with cu_seqlens (packed layout) the log-probs must be 1-D [num_tokens], got shape "
                         f"{tuple(old_log_prob.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [num_sequences + 1], got shape "
                         f"{tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}")


def check_values(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                 cu_seqlens: torch.Tensor | None) -> None:
    """Raise ValueError naming each bad tensor and how many positions are bad (one host sync)."""
    valid = response_mask != 0
    counts = [
        (~((response_mask == 0) | (response_mask == 1))).sum(),
        _bad_log_probs(old_log_prob, valid),
        _bad_log_probs(rollout_log_prob, valid),
    ]
    if cu_seqlens is not None:
        steps = cu_seqlens[1:] - cu_seqlens[:-1]
        counts += [(cu_seqlens[:1] != 0).sum() + (steps < 0).sum()
                   + (cu_seqlens[-1:] > old_log_prob.numel()).sum()]
    bad_mask, bad_old, bad_rollout, *bad_cu = torch.stack(counts).tolist()
    problems = []
    if bad_mask:
        problems.append(f"response_mask has {bad_mask} value(s) that are not 0 or 1")
    for name, bad in (("old_log_prob", bad_old), ("rollout_log_prob", bad_rollout)):
        if bad:
            problems.append(f"{name} has {bad} valid position(s) (response_mask=1) that are NaN, +inf or > 0; "
                            f"log-probs of sampled tokens must be finite and <= 0 (mask such tokens out)")
    if bad_cu and bad_cu[0]:
        problems.append(f"cu_seqlens must start at 0, be non-decreasing and end at most at num_tokens="
                        f"{old_log_prob.numel()} ({bad_cu[0]} violation(s))")
    if problems:
        raise ValueError("compute_rollout_correction: " + "; ".join(problems))


def _bad_log_probs(log_prob: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    bad = torch.isnan(log_prob) | (log_prob > 0)  # +inf is > 0
    return (bad & valid).sum()
