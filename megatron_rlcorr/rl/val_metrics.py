"""Validation metrics: verl's `process_validation_metrics`, and the unbiased pass@k estimator.

What. A validation generates N samples per prompt and scores each; every numeric variable the
reward reports ("reward", the score, plus every numeric field of a reward's mapping, e.g. "acc")
becomes, per prompt, then averaged over the prompts of each data source:
- `mean@N` and, for N > 1, `std@N` (population std over the N samples);
- for k in 2, 4, 8, ... below N, and N itself: `best@k/mean`, `best@k/std` (the mean and std over
  bootstrap draws of the largest value among k samples drawn with replacement), `worst@k/...`
  (the smallest), and, when the reward returns a `pred` (its extracted answer), `maj@k/...` (the
  value of the majority answer among the k: its first sample's, ties going to the answer seen
  first in the draw).
Bootstrap: `n_bootstrap` draws of k indices from a generator seeded by `seed`, afresh for every
(prompt, k), so a prompt's numbers depend on its own samples only (not on the order of the
prompts, so not on the parallel layout); best, worst and maj of one (prompt, k) share the draws.

Names, as verl logs them: `<section>/<data_source>/<variable>/<metric>`, where the section is
`val-core` for the core variable's (`acc` when the reward returns it, else `reward`) mean@N,
best@N/* and maj@N/*, and `val-aux` for everything else.

Beyond verl: pass@k = 1 - C(N - c, k) / C(N, k), the unbiased estimate of the probability that at
least one of k samples is right (Chen et al. 2021), from a prompt's c right samples out of N (right:
the reward's `acc`, else score >= 1, as in training), averaged over the prompts, for k = 1 and the
k above; named `<section>/<data_source>/acc/pass@k`, `val-core` for k = N (pass@1 is the share of
right samples).

Memory: the bootstrap holds n_bootstrap x k indices per (prompt, k) at a time.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from numbers import Real
from typing import Any

import torch

N_BOOTSTRAP = 1000
BOOTSTRAP_SEED = 42  # verl's
CORE_PREFIXES = ("mean@", "best@", "maj@")


def subset_sizes(n: int) -> list[int]:
    """The k of best@k / worst@k / maj@k for N = n samples: 2, 4, 8, ... below n, then n ([] for n <= 1)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn without replacement,
    hold at least one of the c right ones (a product, so no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _codes(preds: Sequence[Any]) -> torch.Tensor:
    """Each prediction's index among the distinct ones, in order of first appearance."""
    index: dict[Any, int] = {}
    keys = [p if isinstance(p, Hashable) else repr(p) for p in preds]
    return torch.tensor([index.setdefault(key, len(index)) for key in keys], dtype=torch.int64)


def _majority(values_BK: torch.Tensor, codes_BK: torch.Tensor) -> torch.Tensor:
    """Per row, the value of the first sample whose prediction is the most frequent in the row:
    the majority's first value, a tie going to the prediction that appears first."""
    counts_BV = torch.zeros(codes_BK.shape[0], int(codes_BK.max()) + 1, dtype=torch.int64)
    counts_BV.scatter_add_(1, codes_BK, torch.ones_like(codes_BK))
    count_BK = counts_BV.gather(1, codes_BK)
    first_BK = count_BK == count_BK.max(dim=1, keepdim=True).values
    position_B = first_BK.to(torch.int64).argmax(dim=1)  # argmax returns the first maximum
    return values_BK.gather(1, position_B[:, None]).squeeze(1)


def _mean_std(x: torch.Tensor) -> tuple[float, float]:
    return float(x.mean()), float(x.std(correction=0))


def prompt_metrics(values: Sequence[float], preds: Sequence[Any] | None = None, *, seed: int = BOOTSTRAP_SEED,
                   n_bootstrap: int = N_BOOTSTRAP) -> dict[str, float]:
    """One prompt's metrics of one variable over its N samples (module docstring)."""
    values_N = torch.tensor([float(v) for v in values], dtype=torch.float64)
    n = values_N.numel()
    metrics = {f"mean@{n}": float(values_N.mean())}
    if n <= 1:
        return metrics
    metrics[f"std@{n}"] = float(values_N.std(correction=0))
    codes_N = _codes(preds) if preds is not None else None
    for k in subset_sizes(n):
        generator = torch.Generator().manual_seed(seed)
        idx_BK = torch.randint(0, n, (n_bootstrap, k), generator=generator)
        drawn_BK = values_N[idx_BK]
        metrics[f"best@{k}/mean"], metrics[f"best@{k}/std"] = _mean_std(drawn_BK.max(dim=1).values)
        metrics[f"worst@{k}/mean"], metrics[f"worst@{k}/std"] = _mean_std(drawn_BK.min(dim=1).values)
        if codes_N is not None:
            metrics[f"maj@{k}/mean"], metrics[f"maj@{k}/std"] = _mean_std(_majority(drawn_BK, codes_N[idx_BK]))
    return metrics


def _is_number(value: Any) -> bool:
    return isinstance(value, (Real, bool)) and not isinstance(value, str)


def _group(data_sources: Sequence[str], prompt_ids: Sequence[Hashable]) -> dict[str, dict[Hashable, list[int]]]:
    """data source -> prompt -> its sample indices, in order of first appearance."""
    groups: dict[str, dict[Hashable, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, prompt) in enumerate(zip(data_sources, prompt_ids, strict=True)):
        groups[source][prompt].append(i)
    return groups


def _average(per_prompt: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the prompts that have it."""
    collected: dict[str, list[float]] = defaultdict(list)
    for metrics in per_prompt:
        for name, value in metrics.items():
            collected[name].append(value)
    return {name: math.fsum(values) / len(values) for name, values in collected.items()}


def process_validation_metrics(data_sources: Sequence[str], prompt_ids: Sequence[Hashable],
                               infos: Mapping[str, Sequence[Any]], *, seed: int = BOOTSTRAP_SEED,
                               n_bootstrap: int = N_BOOTSTRAP) -> dict[str, dict[str, dict[str, float]]]:
    """{data source: {variable: {metric: value averaged over its prompts}}} (verl's structure).

    Sample i belongs to data_sources[i] and prompt prompt_ids[i]; infos[var][i] is its value of
    each variable. Variables whose values are not all numbers (a `pred` string) get no metrics;
    `pred`, when present, is what maj@k votes on."""
    for name, values in infos.items():
        if len(values) != len(data_sources):
            raise ValueError(f"validation metrics: {name!r} has {len(values)} values for {len(data_sources)} samples")
    preds = infos.get("pred")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for source, prompts in _group(data_sources, prompt_ids).items():
        per_var: dict[str, list[dict[str, float]]] = defaultdict(list)
        for rows in prompts.values():
            prompt_preds = None if preds is None else [preds[i] for i in rows]
            for var, values in infos.items():
                prompt_values = [values[i] for i in rows]
                if all(_is_number(v) for v in prompt_values):
                    per_var[var].append(prompt_metrics(prompt_values, prompt_preds, seed=seed,
                                                       n_bootstrap=n_bootstrap))
        out[source] = {var: _average(metrics) for var, metrics in per_var.items()}
    return out


def pass_at_k_metrics(data_sources: Sequence[str], prompt_ids: Sequence[Hashable],
                      correct: Sequence[bool]) -> dict[str, dict[int, float]]:
    """{data source: {k: pass@k averaged over its prompts}} for k = 1 and subset_sizes(N)."""
    out: dict[str, dict[int, float]] = {}
    for source, prompts in _group(data_sources, prompt_ids).items():
        per_prompt = []
        for rows in prompts.values():
            n, c = len(rows), sum(bool(correct[i]) for i in rows)
            per_prompt.append({str(k): pass_at_k(n, c, k) for k in dict.fromkeys([1, *subset_sizes(n)])})
        out[source] = {int(k): value for k, value in _average(per_prompt).items()}
    return out


def _k_of(metric: str) -> int:
    """The sample count a metric name refers to: 4 for mean@4, best@4/std, pass@4."""
    return int(metric.split("@")[1].split("/")[0])


def validation_metrics(data_sources: Sequence[str], prompt_ids: Sequence[Hashable],
                       infos: Mapping[str, Sequence[Any]], correct: Sequence[bool], *, seed: int = BOOTSTRAP_SEED,
                       n_bootstrap: int = N_BOOTSTRAP) -> dict[str, float]:
    """The flat, named metrics of a validation (module docstring): verl's plus pass@k."""
    nested = process_validation_metrics(data_sources, prompt_ids, infos, seed=seed, n_bootstrap=n_bootstrap)
    passes = pass_at_k_metrics(data_sources, prompt_ids, correct)
    flat: dict[str, float] = {}
    for source, per_var in nested.items():
        core_var = "acc" if "acc" in per_var else "reward"
        for var, metrics in per_var.items():
            n_max = max(_k_of(name) for name in metrics)
            for name, value in metrics.items():
                core = var == core_var and name.startswith(CORE_PREFIXES) and _k_of(name) == n_max
                flat[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = value
        n_max = max(passes[source])
        for k, value in passes[source].items():
            flat[f"{'val-core' if k == n_max else 'val-aux'}/{source}/acc/pass@{k}"] = value
    return flat
