"""report.md: the analysis in words, from summary.json's mapping (run.py) and nothing else.

Why from the summary: the report and the JSON cannot disagree, and a report can be re-made from
an old summary.json. Order: what was read and under which block; the findings, each with its
recommendation and the overrides to paste; every check's value against its threshold; the
mismatch (divergences and ratio quantiles); the evaluated block; every preset on this data; the
k3 trend; the plots. Fractions are printed as percentages, other numbers with 3-4 significant
digits.
"""
from __future__ import annotations

from typing import Any, Mapping

from .findings import CHECKS
from .statistics import QUANTILES

PLOT_CAPTIONS = {
    "logratio_vs_prob.png": "token log-ratio against the engine's probability of the sampled token",
    "is_weights.png": "IS ratios per level (token, sequence, geometric) with the block's thresholds",
    "seq_logratio_vs_length.png": "sequence log-ratio sum against response length: where sequence IS saturates",
    "kept_vs_threshold.png": "fraction kept against the RS bound per level, and against the veto threshold",
    "metrics.png": "the run's correction metrics over the steps (metrics.jsonl)",
}
_WHEN = {"is_std_high": ">", "ess_low": "<", "veto_fraction_high": ">", "is_mean_off": "abs(mean - 1) >",
         "masked_fraction_high": ">", "kl_rising": "last/first >"}
_NOT_APPLICABLE = {"is_std_high": "no IS weights", "ess_low": "no IS weights", "veto_fraction_high": "no veto",
                   "is_mean_off": "no IS weights", "masked_fraction_high": "no rejection sampling",
                   "kl_rising": "no steps to compare (a scored file, or fewer than 4 steps)"}


def format_report(summary: Mapping[str, Any]) -> str:
    sections = [_header(summary), _findings(summary), _checks(summary), _mismatch(summary),
                _correction(summary), _presets(summary), _trend(summary), _plots(summary)]
    return "\n\n".join(s for s in sections if s) + "\n"


def _num(x: Any) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, (bool, int)):
        return str(x)
    return f"{x:.4g}"


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _header(s: Mapping[str, Any]) -> str:
    inp, c = s["input"], s["correction"]
    kinds = {"scored": "a scored rollout file", "dumps": "a dumps directory", "run": "a run directory"}
    steps = inp.get("steps")
    lines = [
        "# Rollout mismatch analysis",
        "",
        f"- input: `{inp['path']}` ({kinds.get(inp['kind'], inp['kind'])}, {len(inp['files'])} file(s)"
        + (f", steps {steps[0]}-{steps[-1]}" if steps else "") + ")",
        f"- {s['num_sequences']} sequences, {s['num_tokens']} valid response tokens",
        f"- evaluated under: {c['source']}: {c['description']}",
    ]
    invalid = s["statistics"].get("invalid_tokens", 0)
    if invalid:
        lines.append(f"- {invalid} token(s) with a non-finite or positive log-prob were left out, as the trainer "
                     f"masks them")
    return "\n".join(lines)


def _findings(s: Mapping[str, Any]) -> str:
    findings = s["findings"]
    if not findings:
        return ("## Findings\n\nNone: under this block every check is within its threshold on this data "
                "(values below).")
    lines = [f"## Findings ({len(findings)})"]
    for f in findings:
        rec = s["recommended"].get(f["check"], {})
        lines += ["", f"### {f['check']}: {_num(f['value'])} ({_WHEN[f['check']]} {_num(f['threshold'])})", "",
                  f["recommendation"]]
        if rec.get("overrides"):
            lines += ["", "```", rec["overrides"], "```"]
    return "\n".join(lines)


def _checks(s: Mapping[str, Any]) -> str:
    lines = ["## Checks", "", "| check | value | flagged when | result |", "|---|---|---|---|"]
    for name in CHECKS:
        c = s["checks"][name]
        if c["value"] is None:
            result = f"not applicable: {_NOT_APPLICABLE[name]}"
        else:
            result = "**flagged**" if c["flagged"] else "ok"
        lines.append(f"| {name} | {_num(c['value'])} | {_WHEN[name]} {_num(c['threshold'])} | {result} |")
    return "\n".join(lines)


def _mismatch(s: Mapping[str, Any]) -> str:
    st = s["statistics"]
    lines = [
        "## Mismatch",
        "",
        (f"Per token the trainer's log-prob differs from the engine's by {_num(st['log_ratio_mean'])} on average "
         f"(std {_num(st['log_ratio_std'])}, largest {_num(st['log_ratio_abs_max'])}); KL(engine || trainer) "
         f"k1 = {_num(st.get('kl'))}, k3 = {_num(st.get('k3_kl'))}; log-perplexity difference "
         f"{_num(st.get('log_ppl_diff'))} (mean absolute {_num(st.get('log_ppl_abs_diff'))}); chi-square "
         f"{_num(st.get('chi2_token'))} per token, {_num(st.get('chi2_seq'))} per sequence."),
        "",
        "| ratio | " + " | ".join(name for name, _ in QUANTILES) + " |",
        "|---|" + "---|" * len(QUANTILES),
    ]
    rows = (("token exp(lr_t)", "token_ratio"), ("sequence exp(S_i)", "sequence_ratio"),
            ("geometric exp(S_i/n_i)", "geometric_ratio"), ("response length", "response_length"))
    for label, key in rows:
        q = st.get(key) or {}
        lines.append(f"| {label} | " + " | ".join(_num(q.get(name)) for name, _ in QUANTILES) + " |")
    return "\n".join(lines)


def _correction(s: Mapping[str, Any]) -> str:
    c, m = s["correction"], s["correction"]["metrics"]
    kept = (f"{c['description']} (from {c['source']}). On this data it keeps {_pct(c['kept_token_fraction'])} of the "
            f"tokens and {_pct(c['kept_sequence_fraction'])} of the sequences; the kept tokens' weights have mean "
            f"{_num(c['weight_mean'])}, std {_num(c['weight_std'])}, max {_num(c['weight_max'])} "
            f"(ESS {_num(c['ess'])}).")
    lines = ["## The evaluated correction", "", kept]
    if "rollout_is_mean" in m:
        lines.append(f"IS metrics: rollout_is_mean {_num(m['rollout_is_mean'])}, rollout_is_std "
                     f"{_num(m['rollout_is_std'])}, rollout_is_eff_sample_size "
                     f"{_num(m['rollout_is_eff_sample_size'])}.")
    lines.append(f"Rejection: {_pct(c['rs_masked_fraction'])} of the tokens and {_pct(c['rs_seq_masked_fraction'])} "
                 f"of the sequences by RS; {_pct(c['veto_fraction'])} of the sequences vetoed.")
    return "\n".join(lines)


def _presets(s: Mapping[str, Any]) -> str:
    lines = ["## Presets on this data", "",
             "| preset | setting | tokens kept | sequences kept | ESS | weight mean | std | max |",
             "|---|---|---|---|---|---|---|---|"]
    for name, p in s["presets"].items():
        lines.append(f"| {name} | {p['description']} | {_pct(p['kept_token_fraction'])} | "
                     f"{_pct(p['kept_sequence_fraction'])} | {_num(p['ess'])} | {_num(p['weight_mean'])} | "
                     f"{_num(p['weight_std'])} | {_num(p['weight_max'])} |")
    return "\n".join(lines)


def _trend(s: Mapping[str, Any]) -> str:
    t = s.get("trend")
    if not t:
        return ""
    if "slope_per_step" not in t:
        return f"## k3 over the steps\n\n{len(t['steps'])} step(s) from {t['source']}: too few for a trend."
    return (f"## k3 over the steps\n\nFrom {t['source']}, {len(t['steps'])} steps: k3 {_num(t['first_mean'])} "
            f"over steps {t['first_steps'][0]}-{t['first_steps'][1]}, {_num(t['last_mean'])} over steps "
            f"{t['last_steps'][0]}-{t['last_steps'][1]}; slope {_num(t['slope_per_step'])} per step.")


def _plots(s: Mapping[str, Any]) -> str:
    if s.get("plots_error"):
        return f"## Plots\n\nNo plots: {s['plots_error']}"
    if not s.get("plots"):
        return ""
    lines = ["## Plots"]
    for name in s["plots"]:
        lines += ["", f"{PLOT_CAPTIONS.get(name, name)}:", "", f"![{name}]({name})"]
    return "\n".join(lines)
