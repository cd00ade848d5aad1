"""Correction settings evaluated on the data: every preset, and the block the findings judge.

Why: whether a preset or a threshold suits an engine is an empirical question: how many tokens
and sequences it would keep on this data and what weights it would give. Nothing is
re-implemented: each setting is run through the project's own `compute_rollout_correction` on
the whole batch (packed layout, `cu_seqlens`, one process, no groups), with the trainer's
log-probs as `old_log_prob` and the engine's as `rollout_log_prob`, in float32 as the trainer
passes them. From its result (`Evaluation`):
- kept_token_fraction: the valid tokens its mask keeps;
- kept_sequence_fraction: the non-empty sequences that keep every valid token (a sequence losing
  some tokens to token-level RS is not kept, as in `rollout_rs_seq_masked_fraction`);
- weight_mean / weight_std / weight_max: token-weighted, over the kept tokens, of the weights it
  gives (after truncation and batch normalisation; 1 on every kept token without IS);
- ess: the effective sample size of those weights as a fraction of the kept tokens,
  (sum w)^2 / (n sum w^2); 1 without IS, 0 when nothing is kept;
- unit_mean: the mean of its weights in the unit batch normalisation makes 1 (docs/math.md): per
  sequence for sequence IS (each non-empty sequence once), per valid token for token IS, before
  rejection (rejection does not zero weights, docs/math.md); 1 without IS;
- metrics: every correction metric (docs/math.md, "The metrics"), without the `rollout_corr/` prefix.
Bypass presets are evaluated alike: in bypass mode the trainer corrects inside the loss, current
policy against the rollout, and on this data (the trainer's log-probs before any update) that is
the same comparison.

The block (`load_block`): `--config RECIPE [overrides]` gives its `algorithm.rollout_correction`
(only that block is read: the recipe's model, data and checkpoint need not exist); without
--config, a run directory's own `recipe.yaml`; else DAPO_BLOCK. Overrides must name keys of that
block (`algorithm.rollout_correction.rollout_rs_threshold=1.02`): nothing else is read, so
anything else is refused rather than ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config import PRESETS, RolloutCorrectionConfig
from ..correction import compute_rollout_correction
from ..recipe.tree import apply_overrides, read_tree
from .inputs import Batch

BLOCK_KEY = "algorithm.rollout_correction"
# The correction of the DAPO recipes (recipes/tiny_cpu.yaml, the dapo_qwen2.5 recipes): sequence IS
# truncated at 2 and batch-normalised, geometric RS [0.99, 1.01], token veto 1e-4.
DAPO_BLOCK: dict[str, Any] = {
    "rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True,
    "rollout_rs": "geometric", "rollout_rs_threshold": 1.01, "rollout_rs_threshold_lower": 0.99,
    "rollout_token_veto_threshold": 1e-4,
}


@dataclass
class Block:
    """The correction block the findings are evaluated under, and where it came from."""

    config: RolloutCorrectionConfig
    source: str


@dataclass
class Evaluation:
    """One setting on the data (module docstring)."""

    config: RolloutCorrectionConfig
    kept_token_fraction: float
    kept_sequence_fraction: float
    ess: float
    weight_mean: float | None
    weight_std: float | None
    weight_max: float | None
    unit_mean: float
    metrics: dict[str, float]
    is_weights: torch.Tensor | None    # float32 [N], as returned
    kept: torch.Tensor                 # float32 [N], the returned mask
    sequence_kept: torch.Tensor        # bool [S]: every valid token of the sequence kept
    nonempty: torch.Tensor             # bool [S]: the sequence has a valid token

    def numbers(self) -> dict[str, Any]:
        """The JSON-ready numbers of `summary.json` (presets and correction)."""
        metric = self.metrics.get
        return {
            "settings": self.config.to_dict(),
            "description": describe(self.config),
            "kept_token_fraction": self.kept_token_fraction,
            "kept_sequence_fraction": self.kept_sequence_fraction,
            "ess": self.ess,
            "weight_mean": self.weight_mean,
            "weight_std": self.weight_std,
            "weight_max": self.weight_max,
            "rs_masked_fraction": metric("rollout_rs_masked_fraction", 0.0),
            "rs_seq_masked_fraction": metric("rollout_rs_seq_masked_fraction", 0.0),
            "veto_fraction": metric("rollout_is_veto_fraction", 0.0),
        }


def evaluate(batch: Batch, config: RolloutCorrectionConfig) -> Evaluation:
    """`config` run through the correction on the whole batch (module docstring)."""
    out = compute_rollout_correction(batch.old_log_prob.float(), batch.rollout_log_prob.float(), batch.mask,
                                     config, cu_seqlens=batch.cu_seqlens)
    valid = batch.mask.double()
    kept = out.response_mask.double() * valid
    seq = batch.sequence_of_token
    per_seq = torch.zeros(batch.num_sequences, dtype=torch.float64)
    n_valid = per_seq.index_add(0, seq, valid)
    n_kept = per_seq.index_add(0, seq, kept)
    nonempty, sequence_kept = n_valid > 0, n_kept == n_valid
    weights = out.is_weights.double() if out.is_weights is not None else valid
    mean, std, top, ess = _weight_stats(weights[kept > 0])
    return Evaluation(
        config=config,
        kept_token_fraction=float(kept.sum() / valid.sum()),
        kept_sequence_fraction=float(sequence_kept[nonempty].double().mean()),
        ess=ess, weight_mean=mean, weight_std=std, weight_max=top,
        unit_mean=_unit_mean(config, weights, valid, seq, n_valid),
        metrics={k.removeprefix("rollout_corr/"): float(v) for k, v in out.metrics.items()},
        is_weights=out.is_weights, kept=out.response_mask.float() * batch.mask, sequence_kept=sequence_kept,
        nonempty=nonempty,
    )


def _weight_stats(w: torch.Tensor) -> tuple[float | None, float | None, float | None, float]:
    """mean, population std, max and ESS fraction of the kept tokens' weights (None, 0 when none)."""
    if w.numel() == 0:
        return None, None, None, 0.0
    square = float((w * w).sum())
    ess = float(w.sum()) ** 2 / (w.numel() * square) if square > 0 else 0.0
    return float(w.mean()), float(w.std(unbiased=False)), float(w.max()), ess


def _unit_mean(config: RolloutCorrectionConfig, weights: torch.Tensor, valid: torch.Tensor, seq: torch.Tensor,
               n_valid: torch.Tensor) -> float:
    if config.rollout_is is None:
        return 1.0
    if config.rollout_is == "token":
        return float((weights * valid).sum() / valid.sum())
    per_seq = torch.zeros_like(n_valid).index_add_(0, seq, weights * valid)
    nonempty = n_valid > 0
    return float((per_seq[nonempty] / n_valid[nonempty]).mean())


def evaluate_presets(batch: Batch) -> dict[str, Evaluation]:
    """Every preset of config.PRESETS with its default arguments."""
    return {name: evaluate(batch, getattr(RolloutCorrectionConfig, name)()) for name in PRESETS}


def with_changes(config: RolloutCorrectionConfig, **changes: Any) -> RolloutCorrectionConfig:
    """`config` with some fields replaced (validated again)."""
    return RolloutCorrectionConfig(**{**config.to_dict(), **changes})


def describe(config: RolloutCorrectionConfig) -> str:
    """One line in words: 'sequence IS C=2 (batch-normalised), geometric RS [0.99, 1.01], veto 1e-04'."""
    parts = []
    if config.rollout_is is not None:
        low = config.rollout_is_threshold_lower
        high = config.rollout_is_threshold
        bounds = f"[{low:g}, {high:g}]" if low is not None else f"C={high:g}"
        norm = " (batch-normalised)" if config.rollout_is_batch_normalize else ""
        parts.append(f"{config.rollout_is} IS {bounds}{norm}")
    rule = config.ratio_rejection
    if rule is not None:
        parts.append(f"{config.rollout_rs} RS [{rule.lower:g}, {rule.upper:g}]")
    elif config.rejection_rules:
        parts.append(f"RS {', '.join(r.option for r in config.rejection_rules)}")
    if config.rollout_token_veto_threshold is not None:
        parts.append(f"veto {config.rollout_token_veto_threshold:.0e}")
    mode = "bypass" if config.bypass_mode else "decoupled"
    return (", ".join(parts) or "no IS, no RS (metrics only)") + f"; {mode} mode"


def load_block(config: str | Path | None, overrides: Sequence[str] = (), run_recipe: Path | None = None) -> Block:
    """The block to evaluate (module docstring); ValueError naming the file and key."""
    _check_overrides(overrides)
    if config is not None:
        tree, source = read_tree(Path(config)), str(config)
    elif run_recipe is not None:
        tree, source = read_tree(run_recipe), f"{run_recipe} (the run's recipe)"
    else:
        tree, source = {"algorithm": {"rollout_correction": dict(DAPO_BLOCK)}}, "the DAPO block (default)"
    apply_overrides(tree, overrides)
    if overrides:
        source += " with " + " ".join(overrides)
    algorithm = tree.get("algorithm") or {}
    if not isinstance(algorithm, dict):
        raise ValueError(f"{source}: algorithm must be a mapping, got {type(algorithm).__name__}")
    try:
        return Block(RolloutCorrectionConfig.from_dict(algorithm.get("rollout_correction")), source)
    except ValueError as err:
        raise ValueError(f"{source}: {BLOCK_KEY}: {err}") from None


def _check_overrides(overrides: Sequence[str]) -> None:
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or not key.startswith(BLOCK_KEY + "."):
            raise ValueError(f"override {item!r}: analyze reads only the correction block, so overrides look like "
                             f"{BLOCK_KEY}.<field>=value (e.g. {BLOCK_KEY}.rollout_rs_threshold=1.02)")
