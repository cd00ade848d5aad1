"""Configuration of the rollout correction (its contract: docs/api.md, `RolloutCorrectionConfig`).

`RolloutCorrectionConfig` keeps verl's field names, so the rollout_correction block of a verl YAML
loads unchanged (docs/coming-from-verl.md for the rest of a verl config). All validation happens
once, at construction; the correction's hot path only reads the parsed `rejection_rules` and plain
floats.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

ISLevel = Literal["token", "sequence"]
RatioRSLevel = Literal["token", "sequence", "geometric"]
Aggregate = Literal["token", "seq_sum", "seq_mean", "seq_max"]
Estimator = Literal["ratio", "k1", "k2", "k3"]

IS_LEVELS: tuple[str, ...] = ("token", "sequence")
RATIO_RS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
# A ratio level is the ratio rho itself aggregated as the seed does: token -> rho_t,
# sequence -> exp(sum), geometric -> exp(mean).
_RATIO_AGGREGATE: dict[str, Aggregate] = {"token": "token", "sequence": "seq_sum", "geometric": "seq_mean"}
DIVERGENCE_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)

_LEGACY_NAMES = {
    "bypass_old_logprob_for_rollout": "bypass_mode",
    "use_pure_rollout_correction": "use_policy_gradient",
}
_LOSS_TYPES = {"reinforce": True, "ppo_clip": False}


# How alike a name and a suggestion must be (difflib's ratio, 2 x matching characters / both lengths):
# a typo ("stpes" -> "steps" 0.8, "rollout_token_veto" -> "rollout_token_veto_threshold" 0.78) is
# above it; a name that only shares a prefix ("qwen9" -> "qwen3-8b", 0.62) is not suggested.
CLOSE_ENOUGH = 0.7


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    """' (did you mean "x"?)' for the closest of `choices`, or '' when none is close (CLOSE_ENOUGH)."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=CLOSE_ENOUGH)
    return f' (did you mean "{close[0]}"?)' if close else ""


@dataclass(frozen=True)
class RejectionRule:
    """One parsed rejection criterion; a token is kept only if every rule keeps it.

    Ratio rules and k1 rules keep iff lower <= rho <= upper, where log rho is the (clamped)
    per-token log-ratio, its sequence sum or its sequence mean. k2/k3 rules keep iff the
    statistic <= upper (lower is None).
    """

    option: str
    aggregate: Aggregate
    estimator: Estimator
    upper: float
    lower: float | None

    @property
    def is_sequence_level(self) -> bool:
        return self.aggregate != "token"


def _as_float(value: Any, name: str) -> float:
    """A number from Python or YAML (PyYAML reads `1e-4` as the string "1e-4")."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got the bool {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return number


def _as_positive(value: Any, name: str) -> float:
    number = _as_float(value, name)
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


def _as_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _split_options(rollout_rs: Any) -> list[str]:
    if isinstance(rollout_rs, str):
        options = [part.strip() for part in rollout_rs.split(",")]
    elif isinstance(rollout_rs, (list, tuple)):
        options = list(rollout_rs)
    else:
        raise ValueError(f"rollout_rs must be null, an option name, a list of options or a comma-separated "
                         f"string, got {rollout_rs!r}")
    known = RATIO_RS_LEVELS + DIVERGENCE_OPTIONS
    for option in options:
        if option not in known:
            raise ValueError(f"rollout_rs: unknown option {option!r}{did_you_mean(str(option), known)}; "
                             f"allowed: {', '.join(known)}")
    duplicates = sorted({o for o in options if options.count(o) > 1})
    if duplicates:
        raise ValueError(f"rollout_rs: option(s) {duplicates} given more than once")
    ratio = [o for o in options if o in RATIO_RS_LEVELS]
    if ratio and len(options) > 1:
        raise ValueError(f"rollout_rs: the ratio level {ratio[0]!r} cannot be combined with other options "
                         f"({options}); use one of {RATIO_RS_LEVELS} alone, or divergence options only")
    return options


def _split_thresholds(threshold: Any, n_options: int) -> list[Any]:
    """One threshold entry per option: a shared number, a list, or verl's "0.5_2.0,3.0" string."""
    if isinstance(threshold, (list, tuple)):
        entries = list(threshold)
    elif isinstance(threshold, str) and ("," in threshold or "_" in threshold):
        entries = [part.strip() for part in threshold.split(",")]
    else:
        return [threshold] * n_options
    if len(entries) == 1:
        return entries * n_options
    if len(entries) != n_options:
        raise ValueError(f"rollout_rs_threshold has {len(entries)} entries but rollout_rs names {n_options} "
                         f"option(s); give one entry per option, or a single number for all")
    return entries


def _parse_rule(option: str, entry: Any, lower_field: float | None) -> RejectionRule:
    name = f"rollout_rs_threshold (for {option})"
    if option in RATIO_RS_LEVELS:
        aggregate, estimator = _RATIO_AGGREGATE[option], "ratio"
    else:
        aggregate, estimator = option.rsplit("_", 1)[0], option.rsplit("_", 1)[1]
    if isinstance(entry, str) and "_" in entry:
        if estimator in ("k2", "k3"):
            raise ValueError(f"{name}: {entry!r} gives a lower bound, but {option} is a {estimator} option "
                             f"that only takes an upper bound")
        low_text, high_text = entry.split("_", 1)
        lower, upper = _as_positive(low_text, name + " lower"), _as_positive(high_text, name + " upper")
    else:
        upper = _as_positive(entry, name)
        lower = None if estimator in ("k2", "k3") else (lower_field if lower_field is not None else 1.0 / upper)
    if lower is not None and lower > upper:
        raise ValueError(f"{name}: the lower ratio bound {lower} exceeds the upper bound {upper}; with no "
                         f"rollout_rs_threshold_lower the lower bound is 1/upper, so an upper bound < 1 needs an "
                         f"explicit rollout_rs_threshold_lower")
    return RejectionRule(option, aggregate, estimator, upper, lower)  # type: ignore[arg-type]


def parse_rejection_rules(rollout_rs: Any, threshold: Any, threshold_lower: float | None) -> tuple[RejectionRule, ...]:
    if rollout_rs is None:
        return ()
    options = _split_options(rollout_rs)
    if not options:
        raise ValueError("rollout_rs: an empty option list; use null to disable rejection sampling")
    if threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold (the upper bound)")
    if threshold_lower is not None and all(o.endswith(("k2", "k3")) for o in options):
        raise ValueError("rollout_rs_threshold_lower applies to ratio and k1 options only, but rollout_rs "
                         f"{options} has only k2/k3 options; remove it")
    entries = _split_thresholds(threshold, len(options))
    return tuple(_parse_rule(o, e, threshold_lower) for o, e in zip(options, entries))


@dataclass(frozen=True, init=False)
class RolloutCorrectionConfig:
    """Rollout correction settings; `RolloutCorrectionConfig()` is disabled (metrics only).

    Fields (docs/api.md): rollout_is (None | "token" | "sequence"), rollout_is_threshold (C > 0),
    rollout_is_threshold_lower (None: truncate from above only; set: clip to [lower, C]),
    rollout_is_batch_normalize, rollout_rs (None, a ratio level "token" | "sequence" | "geometric",
    or divergence options), rollout_rs_threshold, rollout_rs_threshold_lower (None: 1/upper),
    rollout_token_veto_threshold, bypass_mode, use_policy_gradient.
    Legacy names accepted with a DeprecationWarning: bypass_old_logprob_for_rollout,
    use_pure_rollout_correction, loss_type ("reinforce" | "ppo_clip").
    """

    # IS weight level: "token" (each token's ratio pi_old / pi_rollout; in bypass mode pi_theta, detached,
    # takes pi_old's place) or "sequence" (the response's ratio, on all its tokens); None: no weights
    rollout_is: ISLevel | None = None
    rollout_is_threshold: float = 2.0  # C > 0: the weights are truncated at C from above
    # None: truncate at C only (the IS metrics use 1/C as the low mark); set (0 < lower <= C): clip to [lower, C]
    rollout_is_threshold_lower: float | None = None
    rollout_is_batch_normalize: bool = False  # rescale the truncated weights to mean 1 over the batch
    # Rejection sampling: a ratio level "token", "sequence" or "geometric", or divergence options
    # (token_k1, seq_max_k3, ...; a list or a comma-separated string); None: no rejection
    rollout_rs: str | tuple[str, ...] | None = None
    # RS upper bound (> 0), required when rollout_rs is set: one number, or one entry per divergence
    # option (a list, or a string like "0.5_2.0,3.0" where "L_U" gives a k1 option both bounds)
    rollout_rs_threshold: float | str | tuple[Any, ...] | None = None
    rollout_rs_threshold_lower: float | None = None  # RS lower ratio bound (ratio and k1 options); None: 1/upper
    # > 0: reject a whole sequence if any of its tokens has a ratio below it (in every mode); None: no veto
    rollout_token_veto_threshold: float | None = None
    bypass_mode: bool = False  # 2-policy mode: pi_old := pi_rollout, no old-log-prob forward pass; false: decoupled
    use_policy_gradient: bool = False  # REINFORCE-style policy-gradient loss instead of PPO-clip; needs bypass_mode
    rejection_rules: tuple[RejectionRule, ...] = field(default=(), init=False, repr=False, compare=False)

    def __init__(self, **options: Any) -> None:
        values = {f.name: f.default for f in _user_fields()}
        values.update(_resolve_names(options))
        for name, value in _validate(values).items():
            object.__setattr__(self, name, value)
        rules = parse_rejection_rules(self.rollout_rs, self.rollout_rs_threshold, self.rollout_rs_threshold_lower)
        object.__setattr__(self, "rejection_rules", rules)

    # ---- derived views used by the correction and the trainer ----
    @property
    def is_threshold_low_mark(self) -> float:
        """The low mark c of the IS metrics: the explicit lower clip, else 1/C."""
        lower = self.rollout_is_threshold_lower
        return lower if lower is not None else 1.0 / self.rollout_is_threshold

    @property
    def ratio_rejection(self) -> RejectionRule | None:
        rules = self.rejection_rules
        return rules[0] if rules and rules[0].estimator == "ratio" else None

    @property
    def needs_old_log_prob_pass(self) -> bool:
        """Decoupled (3-policy) mode recomputes pi_old with a forward pass; bypass mode does not."""
        return not self.bypass_mode

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in _user_fields()}
        for key in ("rollout_rs", "rollout_rs_threshold"):
            if isinstance(out[key], tuple):
                out[key] = list(out[key])
        return out

    # ---- loading ----
    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any] | None) -> "RolloutCorrectionConfig":
        """From a bare mapping or a recipe with an `algorithm.rollout_correction` block."""
        if mapping is None:
            return cls()
        if not isinstance(mapping, Mapping):
            raise ValueError(f"rollout correction settings must be a mapping, got {type(mapping).__name__}")
        if "algorithm" in mapping:
            mapping = mapping["algorithm"] or {}
        if isinstance(mapping, Mapping) and "rollout_correction" in mapping:
            mapping = mapping["rollout_correction"] or {}
        return cls(**dict(mapping))

    @classmethod
    def from_yaml(cls, path_or_text: str | Path) -> "RolloutCorrectionConfig":
        import yaml

        text = str(path_or_text)
        is_path = isinstance(path_or_text, Path) or ("\n" not in text and text.endswith((".yaml", ".yml")))
        if is_path:
            text = Path(path_or_text).read_text()
        return cls.from_dict(yaml.safe_load(text))

    # ---- presets (the seed's signatures) ----
    @classmethod
    def disabled(cls) -> "RolloutCorrectionConfig":
        return cls()

    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: float = 2.0,
                            rs_threshold_lower: float | None = None) -> "RolloutCorrectionConfig":
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="sequence",
                   rollout_rs_threshold=rs_threshold, rollout_rs_threshold_lower=rs_threshold_lower)

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: float | None = None,
                         veto_threshold: float | None = 1e-4) -> "RolloutCorrectionConfig":
        return cls(rollout_rs="geometric", rollout_rs_threshold=rs_threshold,
                   rollout_rs_threshold_lower=rs_threshold_lower, rollout_token_veto_threshold=veto_threshold)

    @classmethod
    def ppo_is_bypass(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        return cls(rollout_is="token", rollout_is_threshold=threshold, bypass_mode=True, use_policy_gradient=False)

    @classmethod
    def pg_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True, use_policy_gradient=True)

    @classmethod
    def pg_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: float | None = None,
              veto_threshold: float | None = 1e-4) -> "RolloutCorrectionConfig":
        return cls(rollout_rs="geometric", rollout_rs_threshold=rs_threshold,
                   rollout_rs_threshold_lower=rs_threshold_lower, rollout_token_veto_threshold=veto_threshold,
                   bypass_mode=True, use_policy_gradient=True)


PRESETS: tuple[str, ...] = ("disabled", "decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs",
                            "decoupled_geo_rs", "ppo_is_bypass", "pg_is", "pg_rs")


def preset(name: str, **kwargs: Any) -> RolloutCorrectionConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown rollout correction preset {name!r}{did_you_mean(name, PRESETS)}; "
                         f"available: {', '.join(PRESETS)}")
    return getattr(RolloutCorrectionConfig, name)(**kwargs)


def _user_fields() -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(RolloutCorrectionConfig) if f.init)


def _resolve_names(options: Mapping[str, Any]) -> dict[str, Any]:
    """Map legacy names onto fields (with a DeprecationWarning) and reject unknown keys."""
    names = [f.name for f in _user_fields()]
    resolved: dict[str, Any] = {}
    for key, value in options.items():
        if key in names:
            target, new_value = key, value
        elif key in _LEGACY_NAMES:
            target, new_value = _LEGACY_NAMES[key], value
        elif key == "loss_type":
            if value not in _LOSS_TYPES:
                raise ValueError(f"loss_type must be one of {sorted(_LOSS_TYPES)}, got {value!r}")
            target, new_value = "use_policy_gradient", _LOSS_TYPES[value]
        else:
            allowed = names + list(_LEGACY_NAMES) + ["loss_type"]
            raise ValueError(f"unknown rollout correction key {key!r}{did_you_mean(key, allowed)}; "
                             f"allowed keys: {', '.join(names)}")
        if target != key:
            warnings.warn(f"rollout correction key {key!r} is deprecated; use {target}: {new_value!r}",
                          DeprecationWarning, stacklevel=4)
        if target in resolved and resolved[target] != new_value:
            raise ValueError(f"{key}={value!r} conflicts with {target}={resolved[target]!r}; give only {target}")
        resolved[target] = new_value
    return resolved


def _validate(v: dict[str, Any]) -> dict[str, Any]:
    out = dict(v)
    if v["rollout_is"] not in (None,) + IS_LEVELS:
        raise ValueError(f"rollout_is must be null, \"token\" or \"sequence\", got {v['rollout_is']!r}"
                         f"{did_you_mean(str(v['rollout_is']), IS_LEVELS)}")
    out["rollout_is_threshold"] = _as_positive(v["rollout_is_threshold"], "rollout_is_threshold")
    if v["rollout_is_threshold_lower"] is not None:
        lower = _as_positive(v["rollout_is_threshold_lower"], "rollout_is_threshold_lower")
        if lower > out["rollout_is_threshold"]:
            raise ValueError(f"rollout_is_threshold_lower ({lower}) must not exceed rollout_is_threshold "
                             f"({out['rollout_is_threshold']})")
        out["rollout_is_threshold_lower"] = lower
    for name in ("rollout_is_batch_normalize", "bypass_mode", "use_policy_gradient"):
        out[name] = _as_bool(v[name], name)
    if out["use_policy_gradient"] and not out["bypass_mode"]:
        # verl documents that the policy-gradient loss requires bypass mode and otherwise runs PPO
        # without a word; running REINFORCE instead would be as silent.
        raise ValueError("use_policy_gradient=True (or the legacy loss_type: reinforce / use_pure_rollout_correction) "
                         "requires bypass_mode=True: set bypass_mode: true for the policy-gradient loss against "
                         "pi_rollout, or use_policy_gradient: false for PPO-clip with the decoupled correction")
    if out["rollout_is_batch_normalize"] and v["rollout_is"] is None:
        warnings.warn("rollout_is_batch_normalize has no effect with rollout_is=null (there are no weights)",
                      UserWarning, stacklevel=4)
    if isinstance(v["rollout_rs"], (list, tuple)):
        out["rollout_rs"] = tuple(v["rollout_rs"])
    threshold = v["rollout_rs_threshold"]
    if isinstance(threshold, (list, tuple)):  # a tuple is how a config stores a list (replace() passes it back)
        out["rollout_rs_threshold"] = tuple(threshold)
    elif threshold is not None and not (isinstance(threshold, str) and ("," in threshold or "_" in threshold)):
        out["rollout_rs_threshold"] = _as_positive(threshold, "rollout_rs_threshold")
    if v["rollout_rs_threshold_lower"] is not None:
        out["rollout_rs_threshold_lower"] = _as_positive(v["rollout_rs_threshold_lower"], "rollout_rs_threshold_lower")
    if v["rollout_rs"] is None and v["rollout_rs_threshold"] is not None:
        warnings.warn("rollout_rs_threshold is set but rollout_rs is null: no rejection sampling happens",
                      UserWarning, stacklevel=4)
    if v["rollout_token_veto_threshold"] is not None:
        out["rollout_token_veto_threshold"] = _as_positive(v["rollout_token_veto_threshold"],
                                                           "rollout_token_veto_threshold")
    return out
