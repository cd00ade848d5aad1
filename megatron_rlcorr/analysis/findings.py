"""The troubleshooting checks of a rollout correction, each finding with a fix computed from the data.

Why: verl's rollout-correction guide lists the symptoms to watch (IS weight std high, ESS low,
many vetoes, IS mean far from 1, much rejected, KL rising) with ranges, and leaves the fix to the
reader. Here each symptom is one check with one threshold, evaluated under one correction block
(presets.load_block) on the data; each finding names the setting to move and its new value,
computed from the data and verified by running the correction again with it (`Finding.expected`
holds what it then gives).

Checks: the value, when it is flagged, and why that threshold.
- is_std_high: `rollout_is_std` (the token-weighted std of the weights clamped to [c, C], the
  metric the trainer logs) > 1.0. With a mean near 1, a std of 1 is a coefficient of variation of
  1: the ESS is then about 1/(1 + 1) = 0.5 and a few samples carry the gradient (the guide's "> 1").
  Truncation bounds this std by (C - c)/2, so with C <= 2.4 and c = 1/C it cannot fire: there
  truncation already caps the variance, and what remains is bias, which is_mean_off shows.
- ess_low: `rollout_is_eff_sample_size` < 0.5: the weights are worth fewer than half as many
  equally-weighted samples (the guide's "< 0.5"; the same reasoning).
  Both: the largest rollout_is_threshold of IS_THRESHOLD_LADDER below the current one under
  which std <= 1.0 and ESS >= 0.5 on this data; for sequence IS also what token IS gives at the
  current threshold (a token weight is one ratio, a sequence weight the product of n of them).
- veto_fraction_high: `rollout_is_veto_fraction` > 0.05. The veto is for catastrophic tokens (the
  trainer's probability below `veto` times the engine's), which a healthy engine produces rarely;
  losing more than 1 sequence in 20 to it (the strict end of the guide's 5-10%) costs training
  signal and points at a systematic cause (a temperature or top-p convention the trainer does not
  apply, a precision bug). Fix: the veto threshold, a power of ten, that vetoes at most
  VETO_TARGET = 1% of the sequences (from the order statistics of each sequence's smallest token
  log-ratio), and the causes to look for first.
- is_mean_off: |m - 1| > 0.1, m the mean of the weights the block gives in the unit batch
  normalisation makes 1 (per sequence for sequence IS, per token for token IS; after truncation
  and normalisation: presets.Evaluation.unit_mean). Weights multiply the loss, so m = 0.8 is a 20%
  smaller step; 10% is a change of learning rate one would not make by accident (the guide's
  0.1-0.2, strict end). Fix: rollout_is_batch_normalize: true, with the mean it gives. With batch
  normalisation on, m is 1 by construction and the check cannot fire.
- masked_fraction_high: `rollout_rs_masked_fraction` (the tokens RS removes; the veto is its own
  check) > 0.10. Rejection should drop the tail; removing more than one token in ten cuts into the
  body of the distribution: the bounds are tighter than the engine's mismatch (the guide: below 10%
  is normal). Fix: bounds of the block's RS level that keep KEEP_SEQUENCES = 95% of the sequences,
  from the order statistics of the per-sequence statistic (geometric mean ratio, sequence ratio,
  or each sequence's token extremes for token RS), 2.5% from each tail, widened to contain the
  current bounds and 1, rounded outwards (`round_bound`); divergence options (k1/k2/k3) get
  geometric bounds instead.
- kl_rising: k3 over the run (trend.py): mean of the last third of the steps / max(mean of the
  first third, 1e-4) > 2.0. A doubling is well outside the step-to-step noise of a batch mean; the
  1e-4 floor (a log-ratio rms of about 0.014 per token) keeps a float-rounding-level mismatch from
  flagging a "rise" from 1e-7 to 1e-6. Needs trend.MIN_POINTS steps. The finding gives the steps,
  the values, the slope and what to check (there is no threshold to move).
Data whose log-probs agree (|old - rollout| <= 1e-6) sits at every check's ideal: no finding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..config import RolloutCorrectionConfig
from .inputs import Batch
from .presets import BLOCK_KEY, Evaluation, evaluate, with_changes
from .statistics import LOG_RATIO_BOUND, Sequences
from .trend import Trend

IS_STD_MAX = 1.0
ESS_MIN = 0.5
VETO_FRACTION_MAX = 0.05
IS_MEAN_TOLERANCE = 0.1
MASKED_FRACTION_MAX = 0.10
KL_RISING_FACTOR = 2.0
KL_FLOOR = 1e-4
KEEP_SEQUENCES = 0.95
VETO_TARGET = 0.01
IS_THRESHOLD_LADDER = (50.0, 20.0, 10.0, 5.0, 3.0, 2.0, 1.5)
CHECKS = ("is_std_high", "ess_low", "veto_fraction_high", "is_mean_off", "masked_fraction_high", "kl_rising")


@dataclass
class Finding:
    check: str
    value: float
    threshold: float
    recommendation: str
    settings: dict[str, Any] = field(default_factory=dict)   # block fields to set (empty: no setting fixes it)
    expected: dict[str, float] = field(default_factory=dict)  # what the correction gives with them, this data

    def to_dict(self) -> dict[str, Any]:
        """The `summary.json` entry: exactly {check, value, threshold, recommendation} (docs/api.md)."""
        return {"check": self.check, "value": self.value, "threshold": self.threshold,
                "recommendation": self.recommendation}


@dataclass
class Context:
    """What the checks look at."""

    batch: Batch
    seqs: Sequences
    block: Evaluation
    trend: Trend | None

    @property
    def config(self) -> RolloutCorrectionConfig:
        return self.block.config


@dataclass(frozen=True)
class Check:
    name: str
    threshold: float
    above: bool                                                  # flagged when value > threshold (else <)
    value: Callable[[Context], float | None]                     # None: not applicable under this block
    recommend: Callable[[Context, float], tuple[str, dict[str, Any], dict[str, float]]]

    def flagged(self, value: float) -> bool:
        return value > self.threshold if self.above else value < self.threshold


def run_checks(ctx: Context) -> tuple[dict[str, dict[str, Any]], list[Finding]]:
    """Every check's value ({check: {value, threshold, flagged}}; value None when not applicable)
    and the findings, in CHECKS order."""
    results, findings = {}, []
    for check in _CHECKS:
        value = check.value(ctx)
        flagged = value is not None and check.flagged(value)
        results[check.name] = {"value": value, "threshold": check.threshold, "flagged": flagged}
        if flagged:
            text, settings, expected = check.recommend(ctx, value)
            findings.append(Finding(check.name, value, check.threshold, text, settings, expected))
    return results, findings


def overrides(settings: dict[str, Any]) -> str:
    """Settings as command-line overrides: 'algorithm.rollout_correction.x=1 ...'."""
    return " ".join(f"{BLOCK_KEY}.{k}={_yaml(v)}" for k, v in settings.items())


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---- IS weights: std and ESS ----

def _is_metric(name: str) -> Callable[[Context], float | None]:
    return lambda ctx: ctx.block.metrics[name] if ctx.config.rollout_is is not None else None


def _is_healthy(ev: Evaluation) -> bool:
    return ev.metrics["rollout_is_std"] <= IS_STD_MAX and ev.metrics["rollout_is_eff_sample_size"] >= ESS_MIN


def _is_numbers(ev: Evaluation) -> str:
    m = ev.metrics
    return (f"rollout_is_std {m['rollout_is_std']:.3g}, "
            f"rollout_is_eff_sample_size {m['rollout_is_eff_sample_size']:.3g}"
            f", {m['rollout_is_ratio_fraction_high']:.1%} of the {ev.config.rollout_is}s above the threshold")


def _recommend_is_threshold(ctx: Context, value: float) -> tuple[str, dict[str, Any], dict[str, float]]:
    cfg, current = ctx.config, ctx.config.rollout_is_threshold
    low = cfg.rollout_is_threshold_lower
    chosen = None
    for threshold in (c for c in IS_THRESHOLD_LADDER if c < current and (low is None or low <= c)):
        ev = evaluate(ctx.batch, with_changes(cfg, rollout_is_threshold=threshold))
        if _is_healthy(ev):
            chosen = (threshold, ev)
            break
    token = None
    if cfg.rollout_is == "sequence":
        token = evaluate(ctx.batch, with_changes(cfg, rollout_is="token"))
    now = f"{cfg.rollout_is} IS at rollout_is_threshold={current:g} gives {_is_numbers(ctx.block)}"
    if chosen is not None:
        threshold, ev = chosen
        settings = {"rollout_is_threshold": threshold}
        text = (f"{now}. Lower the truncation: {overrides(settings)}; on this data that gives {_is_numbers(ev)} "
                f"(std <= {IS_STD_MAX:g} and ESS >= {ESS_MIN:g}).")
        if token is not None and _is_healthy(token):
            text += (f" Or switch to token-level weights ({BLOCK_KEY}.rollout_is=token, a weight per token instead "
                     f"of the product over the sequence): {_is_numbers(token)}.")
        return text, settings, _expected(ev, "rollout_is_std", "rollout_is_eff_sample_size")
    if token is not None and _is_healthy(token):
        settings = {"rollout_is": "token"}
        text = (f"{now}, and no threshold down to {IS_THRESHOLD_LADDER[-1]:g} fixes it. Switch to token-level "
                f"weights: {overrides(settings)} gives {_is_numbers(token)}.")
        return text, settings, _expected(token, "rollout_is_std", "rollout_is_eff_sample_size")
    why = (f": the explicit lower clip rollout_is_threshold_lower={low:g} keeps the spread; remove it"
           if low is not None else "")
    text = (f"{now}, and no truncation threshold down to {IS_THRESHOLD_LADDER[-1]:g} brings std <= {IS_STD_MAX:g} and "
            f"ESS >= {ESS_MIN:g}{why}; or filter instead of weighting (the decoupled_geo_rs preset).")
    return text, {}, {}


# ---- veto ----

def _veto_value(ctx: Context) -> float | None:
    if ctx.config.rollout_token_veto_threshold is None:
        return None
    return ctx.block.metrics["rollout_is_veto_fraction"]


def _recommend_veto(ctx: Context, value: float) -> tuple[str, dict[str, Any], dict[str, float]]:
    lowest = ctx.seqs.min_log_ratio.sort().values
    allowed = int(VETO_TARGET * len(lowest))
    # Vetoed iff min_log_ratio < log(v): a v <= exp(lowest[allowed]) vetoes at most `allowed` sequences.
    exponent = math.floor(float(lowest[allowed]) / math.log(10))
    veto = max(10.0 ** exponent, 1e-300)
    settings = {"rollout_token_veto_threshold": veto}
    ev = evaluate(ctx.batch, with_changes(ctx.config, **settings))
    m = ctx.block.metrics
    text = (f"the veto (rollout_token_veto_threshold={ctx.config.rollout_token_veto_threshold:.0e}) rejects "
            f"{value:.1%} of the sequences: {m['rollout_is_catastrophic_token_fraction']:.2%} of the tokens have a "
            f"trainer probability below that many times the engine's (the smallest ratio is "
            f"{math.exp(max(float(lowest[0]), -745.0)):.3g}). Tokens that far apart usually mean the engine samples "
            f"from another distribution than the trainer scores: check rollout.temperature, top-p/top-k and the "
            f"log-prob convention (rollout.logprobs) first. To veto at most {VETO_TARGET:.0%} of the sequences: "
            f"{overrides(settings)}; on this data it then vetoes {ev.metrics['rollout_is_veto_fraction']:.2%}.")
    return text, settings, _expected(ev, "rollout_is_veto_fraction")


# ---- IS mean ----

def _mean_value(ctx: Context) -> float | None:
    return abs(ctx.block.unit_mean - 1.0) if ctx.config.rollout_is is not None else None


def _recommend_batch_norm(ctx: Context, value: float) -> tuple[str, dict[str, Any], dict[str, float]]:
    cfg, mean = ctx.config, ctx.block.unit_mean
    unit = "sequence" if cfg.rollout_is == "sequence" else "token"
    settings = {"rollout_is_batch_normalize": True}
    ev = evaluate(ctx.batch, with_changes(cfg, **settings))
    text = (f"the IS weights average {mean:.3f} per {unit} after truncation at {cfg.rollout_is_threshold:g} "
            f"(untruncated: rollout_is_mean {ctx.block.metrics['rollout_is_mean']:.3g}), so every step is scaled by "
            f"about {mean:.2f}. Normalise them to mean 1 over the batch: {overrides(settings)}; on this data the mean "
            f"per {unit} becomes {ev.unit_mean:.3f}.")
    return text, settings, {"unit_mean": ev.unit_mean}


# ---- rejection ----

def _masked_value(ctx: Context) -> float | None:
    return ctx.block.metrics["rollout_rs_masked_fraction"] if ctx.config.rejection_rules else None


def _recommend_rs_bounds(ctx: Context, value: float) -> tuple[str, dict[str, Any], dict[str, float]]:
    cfg, seqs = ctx.config, ctx.seqs
    rule = cfg.ratio_rejection
    level = rule.option if rule is not None else "geometric"
    low_stat, high_stat = {"geometric": (seqs.log_ratio_mean, seqs.log_ratio_mean),
                           "sequence": (seqs.log_ratio_sum, seqs.log_ratio_sum),
                           "token": (seqs.min_log_ratio, seqs.max_log_ratio)}[level]
    lower, upper = keeping_bounds(low_stat, high_stat, KEEP_SEQUENCES)
    if rule is not None:
        lower, upper = min(lower, rule.lower), max(upper, rule.upper)
    settings: dict[str, Any] = {"rollout_rs_threshold_lower": lower, "rollout_rs_threshold": upper}
    if rule is None:
        settings = {"rollout_rs": "geometric", **settings}
    ev = evaluate(ctx.batch, with_changes(cfg, **settings))
    m, after = ctx.block.metrics, ev.metrics
    now = (f"{_rs_name(cfg)} rejects {value:.1%} of the tokens ({m['rollout_rs_seq_masked_fraction']:.1%} of the "
           f"sequences): the bounds sit inside the engine's mismatch")
    switch = "" if rule is not None else " (geometric RS instead of the divergence options, whose statistic has no " \
                                         "ratio bounds to compute)"
    text = (f"{now}. Widen them to keep {KEEP_SEQUENCES:.0%} of the sequences{switch}: {overrides(settings)}; on "
            f"this data RS then rejects {after['rollout_rs_seq_masked_fraction']:.1%} of the sequences "
            f"({after['rollout_rs_masked_fraction']:.1%} of the tokens).")
    return text, settings, {**_expected(ev, "rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"),
                            "kept_sequence_fraction": ev.kept_sequence_fraction}


def _rs_name(cfg: RolloutCorrectionConfig) -> str:
    rule = cfg.ratio_rejection
    if rule is not None:
        return f"{rule.option} RS [{rule.lower:g}, {rule.upper:g}]"
    return f"RS {', '.join(r.option for r in cfg.rejection_rules)}"


def keeping_bounds(low_stat: torch.Tensor, high_stat: torch.Tensor, keep: float) -> tuple[float, float]:
    """Ratio bounds [lower, upper], lower <= 1 <= upper, rejecting at most (1 - keep) of the
    sequences: those with exp(low_stat) < lower or exp(high_stat) > upper (log-ratio statistics,
    clamped as the correction clamps them), half the budget from each tail, rounded outwards."""
    n = low_stat.numel()
    budget = int((1.0 - keep) * n + 1e-9)
    from_low, from_high = budget // 2, budget - budget // 2
    low = float(low_stat.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).sort().values[from_low])
    high = float(high_stat.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).sort().values[n - 1 - from_high])
    # 1e-6 of slack: the correction compares float32 log-ratios, these are float64.
    return round_bound(min(math.exp(low - 1e-6), 1.0), down=True), round_bound(max(math.exp(high + 1e-6), 1.0),
                                                                               down=False)


def round_bound(x: float, down: bool) -> float:
    """`x` rounded down (or up) to two significant digits of its distance to 1 within [0.5, 2]
    (0.98721 -> 0.987, 1.0134 -> 1.014), of itself outside (0.0123 -> 0.012, 47.3 -> 48)."""
    if x == 1.0:
        return 1.0
    near = 0.5 <= x <= 2.0
    distance = x - 1.0 if near else x
    step = 10.0 ** (math.floor(math.log10(abs(distance))) - 1)
    quotient = round(distance / step, 9)   # 0.99 is -10 steps of 0.001, not -10.000000000000009
    digits = math.floor(quotient) if down else math.ceil(quotient)
    return float(f"{(1.0 if near else 0.0) + digits * step:.12g}")


# ---- KL trend ----

def _trend_value(ctx: Context) -> float | None:
    trend = ctx.trend
    if trend is None or not trend.has_trend:
        return None
    return trend.last_mean / max(trend.first_mean, KL_FLOOR)


def _recommend_trend(ctx: Context, value: float) -> tuple[str, dict[str, Any], dict[str, float]]:
    t = ctx.trend
    assert t is not None
    (a, b), (c, d) = t.first_steps, t.last_steps
    text = (f"rollout_corr/k3_kl rose from {t.first_mean:.3g} (mean of steps {a}-{b}) to {t.last_mean:.3g} (steps "
            f"{c}-{d}), {value:.1f}x the first (floored at {KL_FLOOR:g}); least-squares slope {t.slope:.3g} per step "
            f"over {len(t.steps)} steps ({t.source}). The engine drifts away from the trainer as training goes on: "
            f"check that every update reaches the engine (the weight sync after each step), that it runs the "
            f"precision you expect (rollout.precision), and compare with a run at a lower optim.lr. Run analyze on "
            f"the dumps of the last steps to size the correction for the mismatch there.")
    return text, {}, {}


def _expected(ev: Evaluation, *names: str) -> dict[str, float]:
    return {name: ev.metrics[name] for name in names}


_CHECKS = (
    Check("is_std_high", IS_STD_MAX, True, _is_metric("rollout_is_std"), _recommend_is_threshold),
    Check("ess_low", ESS_MIN, False, _is_metric("rollout_is_eff_sample_size"), _recommend_is_threshold),
    Check("veto_fraction_high", VETO_FRACTION_MAX, True, _veto_value, _recommend_veto),
    Check("is_mean_off", IS_MEAN_TOLERANCE, True, _mean_value, _recommend_batch_norm),
    Check("masked_fraction_high", MASKED_FRACTION_MAX, True, _masked_value, _recommend_rs_bounds),
    Check("kl_rising", KL_RISING_FACTOR, True, _trend_value, _recommend_trend),
)
assert tuple(c.name for c in _CHECKS) == CHECKS
