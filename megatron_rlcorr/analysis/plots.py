"""The analysis' PNG plots (matplotlib, the optional `plots` extra).

Why: a threshold is easiest to choose by looking at where the data sits against it. One file per
plot:
- logratio_vs_prob.png: each token's log-ratio (trainer - engine) against the engine's
  probability of the sampled token (log axis), as a density with the median and 5-95% band per
  probability bin: low-probability tokens are where low precision hurts most;
- is_weights.png: histograms of the IS ratio at each level (token exp(lr_t), sequence exp(S_i),
  geometric exp(S_i/n_i); log axes), with the evaluated block's truncation and RS bounds;
- seq_logratio_vs_length.png: each sequence's log-ratio sum S_i against its length, coloured by
  whether the block keeps it, with the sequence IS truncation (|S_i| = log C: beyond it sequence
  IS saturates) and the geometric RS bounds (S_i = n log U, n log L);
- kept_vs_threshold.png: the fraction kept against a symmetric RS bound U (lower 1/U) for each
  ratio level, and the fraction of sequences kept against the veto threshold;
- metrics.png (a run directory with metrics.jsonl only): the correction's metrics over the steps.
matplotlib is imported here only, inside the functions, through its object-oriented API
(`Figure.savefig`): no pyplot, no global backend. Without it `write_plots` raises
`PlotsUnavailable` saying how to install it; the rest of the analysis does not need it.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from .inputs import AnalysisInput
from .presets import Evaluation
from .statistics import LOG_RATIO_BOUND, Sequences, ratio, token_log_ratio

INSTALL_HINT = ("matplotlib is not installed, so no PNG plots were drawn (summary.json and report.md do not need "
                "it); install it with: pip install 'megatron-rlcorr[plots]'")
MAX_POINTS = 200_000     # tokens drawn in the density plot (a random subset beyond)
METRIC_PANELS = (
    ("rollout_corr/k3_kl", "k3 KL", True), ("rollout_corr/kl", "k1 KL", False),
    ("rollout_corr/log_ppl_abs_diff", "|log-PPL difference|", False),
    ("rollout_corr/chi2_seq", "chi2 per sequence", False),
    ("rollout_corr/rollout_is_mean", "IS weight mean", False),
    ("rollout_corr/rollout_is_eff_sample_size", "IS ESS", False),
    ("rollout_corr/rollout_rs_masked_fraction", "RS masked token fraction", False),
    ("rollout_corr/rollout_is_veto_fraction", "veto fraction", False),
    ("reward_mean", "reward", False), ("response_length_mean", "response length", False),
)


class PlotsUnavailable(RuntimeError):
    """matplotlib is missing (the message says how to install it)."""


def write_plots(out: Path, inp: AnalysisInput, seqs: Sequences, block: Evaluation) -> list[Path]:
    """Every plot of the module docstring into `out`; returns the files written."""
    figure_class = _figure_class()
    drawn = [
        ("logratio_vs_prob.png", lambda fig: _logratio_vs_prob(fig, inp)),
        ("is_weights.png", lambda fig: _is_weights(fig, inp, seqs, block)),
        ("seq_logratio_vs_length.png", lambda fig: _seq_vs_length(fig, inp, seqs, block)),
        ("kept_vs_threshold.png", lambda fig: _kept_vs_threshold(fig, inp, seqs, block)),
    ]
    if inp.kind == "run" and inp.metrics:
        drawn.append(("metrics.png", lambda fig: _metric_curves(fig, inp.metrics)))
    files = []
    for name, draw in drawn:
        fig = figure_class(figsize=(11, 6.5), layout="constrained")
        if draw(fig) is False:
            continue
        fig.savefig(out / name, dpi=110)
        files.append(out / name)
    return files


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotsUnavailable(INSTALL_HINT) from None
    return Figure


def _valid_tokens(inp: AnalysisInput) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine probability, log-ratio) of the valid tokens, at most MAX_POINTS of them."""
    valid = inp.batch.mask.bool()
    prob, lr = inp.batch.rollout_log_prob[valid].exp(), token_log_ratio(inp.batch)[valid]
    if lr.numel() > MAX_POINTS:
        pick = torch.randperm(lr.numel(), generator=torch.Generator().manual_seed(0))[:MAX_POINTS]
        prob, lr = prob[pick], lr[pick]
    return prob, lr


def _logratio_vs_prob(fig: Any, inp: AnalysisInput) -> None:
    prob, lr = _valid_tokens(inp)
    prob = prob.clamp(min=1e-12)
    ax = fig.subplots()
    cells = ax.hexbin(prob.numpy(), lr.numpy(), xscale="log", bins="log", gridsize=70, cmap="viridis", mincnt=1)
    fig.colorbar(cells, ax=ax, label="tokens per cell (log scale)")
    edges = torch.logspace(math.log10(float(prob.min())), 0.0, 25, dtype=torch.float64)
    centres, median, low, high = [], [], [], []
    for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
        inside = lr[(prob >= a) & (prob <= b)]
        if inside.numel() >= 5:
            q = torch.quantile(inside, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
            centres.append(math.sqrt(a * b))
            low.append(float(q[0]))
            median.append(float(q[1]))
            high.append(float(q[2]))
    if centres:
        ax.plot(centres, median, color="tab:red", lw=2, label="median per probability bin")
        ax.plot(centres, low, color="tab:red", lw=1, ls="--", label="5% and 95% per bin")
        ax.plot(centres, high, color="tab:red", lw=1, ls="--")
    ax.axhline(0.0, color="black", lw=0.8, ls="--")
    ax.set_xlabel("engine's probability of the sampled token, exp(rollout_log_prob)")
    ax.set_ylabel("log-ratio log p_trainer - log p_engine")
    ax.set_title(f"Per-token mismatch against the engine's token probability ({lr.numel()} tokens)")
    if centres:
        ax.legend(loc="best")


def _ratio_range(values: torch.Tensor, marks: list[float]) -> tuple[float, float]:
    """A log-axis range covering `values` and `marks`, at least [1/1.02, 1.02]."""
    low = min([float(values.min()), 1 / 1.02, *marks])
    high = max([float(values.max()), 1.02, *marks])
    return low / 10 ** 0.01, high * 10 ** 0.01


def _ratio_ticks(ax: Any, low: float, high: float) -> None:
    """Readable ticks on a log ratio axis: decades over a wide range, about five plain numbers over
    a narrow one (matplotlib would label crowded minor ticks there)."""
    from matplotlib.ticker import FixedLocator, LogLocator, MaxNLocator, NullFormatter, NullLocator

    if high / low > 100:
        ax.xaxis.set_major_locator(LogLocator(base=10, numticks=6))
    else:
        ax.xaxis.set_major_locator(FixedLocator(MaxNLocator(5).tick_values(low, high)))
    ax.xaxis.set_major_formatter(lambda x, _: f"{x:g}")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _is_weights(fig: Any, inp: AnalysisInput, seqs: Sequences, block: Evaluation) -> None:
    lr = token_log_ratio(inp.batch)[inp.batch.mask.bool()]
    levels = (("token", "token ratio exp(lr_t)", ratio(lr), "tokens"),
              ("sequence", "sequence ratio exp(S_i)", ratio(seqs.log_ratio_sum), "sequences"),
              ("geometric", "geometric ratio exp(S_i / n_i)", ratio(seqs.log_ratio_mean), "sequences"))
    axes = fig.subplots(1, 3)
    for ax, (level, title, values, unit) in zip(axes, levels):
        marks = _marks(block, level)
        data_low, data_high = _ratio_range(values, [])
        edges = torch.logspace(math.log10(data_low), math.log10(data_high), 61, dtype=torch.float64)
        ax.hist(values.numpy(), bins=edges.numpy(), color="tab:blue", alpha=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        low, high = _ratio_range(values, [x for x, _, _ in marks])
        ax.set_xlim(low, high)
        _ratio_ticks(ax, low, high)
        for x, label, colour in marks:
            ax.axvline(x, color=colour, ls="--", lw=1.2, label=label)
        ax.axvline(1.0, color="black", lw=0.6)
        ax.set_title(title)
        ax.set_xlabel("ratio p_trainer / p_engine (log scale)")
        ax.set_ylabel(f"{unit} (log scale)")
        if marks:
            ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"IS ratios per level; dashed: the evaluated block ({block.config.rollout_is or 'no'} IS, "
                 f"{block.config.rollout_rs or 'no'} RS)")


def _marks(block: Evaluation, level: str) -> list[tuple[float, str, str]]:
    """(x, label, colour) of the block's thresholds that act on `level`'s ratio."""
    cfg, marks = block.config, []
    if cfg.rollout_is == level:
        marks.append((cfg.rollout_is_threshold, f"IS truncation C={cfg.rollout_is_threshold:g}", "tab:red"))
        if cfg.rollout_is_threshold_lower is not None:
            marks.append((cfg.rollout_is_threshold_lower, f"IS lower {cfg.rollout_is_threshold_lower:g}", "tab:red"))
    rule = cfg.ratio_rejection
    if rule is not None and rule.option == level:
        marks += [(rule.upper, f"RS upper {rule.upper:g}", "tab:green"),
                  (rule.lower, f"RS lower {rule.lower:g}", "tab:green")]
    return marks


def _seq_vs_length(fig: Any, inp: AnalysisInput, seqs: Sequences, block: Evaluation) -> None:
    ax = fig.subplots()
    n, s = seqs.num_tokens, seqs.log_ratio_sum
    kept = block.sequence_kept[block.nonempty]
    for mask, label, colour in ((kept, "kept by the block", "tab:blue"), (~kept, "rejected by the block", "tab:red")):
        if mask.any():
            ax.scatter(n[mask].numpy(), s[mask].numpy(), s=9, alpha=0.5, color=colour, label=label)
    low, high = float(s.min()), float(s.max())
    span = max(high - low, 1e-6)
    shown = [low, high]
    cfg = block.config
    if cfg.rollout_is == "sequence":
        for y, style, what in ((math.log(cfg.rollout_is_threshold), "--", "sequence IS truncates above: S = log C"),
                               (math.log(cfg.is_threshold_low_mark), ":", "IS low mark: S = log c")):
            on_plot = low - 3 * span <= y <= high + 3 * span   # far-away marks would flatten the data
            shown += [y] if on_plot else []
            label = f"{what} = {y:.3g}" + ("" if on_plot else " (off the plot)")
            ax.axhline(y, color="tab:orange", ls=style, label=label)
    rule = cfg.ratio_rejection
    if rule is not None and rule.option == "geometric":
        lengths = torch.linspace(float(n.min()), float(n.max()), 400, dtype=torch.float64)
        ax.plot(lengths.numpy(), (lengths * math.log(rule.upper)).numpy(), color="tab:green", ls="--",
                label=f"geometric RS bounds: S = n log {rule.upper:g} and n log {rule.lower:g}")
        ax.plot(lengths.numpy(), (lengths * math.log(rule.lower)).numpy(), color="tab:green", ls="--")
    ax.set_ylim(min(shown) - 0.1 * span, max(shown) + 0.1 * span)
    ax.axhline(0.0, color="black", lw=0.6)
    if float(n.max()) > 20 * float(n.min()):
        ax.set_xscale("log")
    ax.set_xlabel("response length n_i (valid tokens)" + (" (log scale)" if ax.get_xscale() == "log" else ""))
    ax.set_ylabel("sequence log-ratio sum S_i = sum_t (log p_trainer - log p_engine)")
    ax.set_title(f"Sequence log-ratio against length ({len(seqs)} sequences): the sum grows with n, so sequence "
                 f"IS saturates on long responses")
    ax.legend(fontsize=8, loc="best")


def _kept_vs_threshold(fig: Any, inp: AnalysisInput, seqs: Sequences, block: Evaluation) -> None:
    left, right = fig.subplots(1, 2)
    log_bounds = torch.logspace(-6, math.log10(LOG_RATIO_BOUND), 200, dtype=torch.float64)
    lr = token_log_ratio(inp.batch)[inp.batch.mask.bool()].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    curves = (("token (tokens kept)", lr.abs()), ("sequence (sequences kept)", seqs.log_ratio_sum.abs()),
              ("geometric (sequences kept)", seqs.log_ratio_mean.abs()))
    for label, stat in curves:
        left.plot(log_bounds.numpy(), _fraction_at_most(stat, log_bounds).numpy(), lw=2, label=label)
    rule = block.config.ratio_rejection
    if rule is not None:
        at = max(math.log(rule.upper), -math.log(rule.lower))
        left.axvline(at, color="gray", ls="--", label=f"the block's {rule.option} RS: log U = {at:.3g}")
    left.axhline(0.95, color="black", ls=":", lw=1, label="95%")
    left.set_xscale("log")
    left.set_ylim(-0.02, 1.02)
    left.set_xlabel("RS bound, as log U (keeps 1/U <= ratio <= U; log scale)")
    left.set_ylabel("fraction kept")
    left.set_title("Ratio rejection sampling per level")
    left.legend(fontsize=8, loc="best")
    veto = torch.logspace(-12, 0, 200, dtype=torch.float64)
    kept = _fraction_at_most(-seqs.min_log_ratio, -veto.log())   # kept iff min lr_t >= log v
    right.plot(veto.numpy(), kept.numpy(), lw=2, color="tab:purple")
    if block.config.rollout_token_veto_threshold is not None:
        v = block.config.rollout_token_veto_threshold
        right.axvline(v, color="gray", ls="--", label=f"the block's veto {v:.0e}")
    right.axhline(0.99, color="black", ls=":", lw=1, label="99%")
    right.legend(fontsize=8, loc="lower left")
    right.set_xscale("log")
    right.set_ylim(-0.02, 1.02)
    right.set_xlabel("veto threshold v (rejects a sequence with any token ratio < v; log scale)")
    right.set_ylabel("fraction of sequences kept")
    right.set_title("Token veto")


def _fraction_at_most(values: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """float64 [len(bounds)]: the fraction of `values` <= each bound."""
    ordered = values.double().sort().values
    return torch.searchsorted(ordered, bounds, right=True).double() / max(ordered.numel(), 1)


def _metric_curves(fig: Any, metrics: list[dict[str, Any]]) -> bool:
    panels = []
    for key, label, log in METRIC_PANELS:
        points = [(r["step"], float(r[key])) for r in metrics
                  if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
        if points:
            panels.append((key, label, log and all(v > 0 for _, v in points), points))
    if not panels:
        return False
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (key, label, log, points) in zip(axes, panels):
        steps, values = zip(*points)
        ax.plot(steps, values, lw=1.5, marker="." if len(points) < 60 else None)
        if log:
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_title(label + (" (log scale)" if log else ""), fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(key.removeprefix("rollout_corr/"), fontsize=8)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle("Run metrics (metrics.jsonl)")
    return True
