"""Phase 3: every metric from the batch totals in one fixed chain of vector ops.

A metric is `pow(n0/d0 - (n1/d1) * (n2/d2), p)` of linear forms of the totals (`Formula`): a
ratio (n1 = 0), a variance (p = 1) or a standard deviation (p = 1/2); optionally the larger of
two such candidates; and a default where its condition (a linear form) is not positive, e.g. an
empty batch. All metrics run at once:

  z = nan_to_num(zbuf)          the totals (infinite sums -> +-BIG, so 0 * z stays 0)
  P = addmm(bias, M, z)         the six forms and the condition of every candidate
  v = pow(n0/d0 - (n1/d1)(n2/d2), p), max over the candidates
  v = nan_to_num(where(cond > 0, v, default))   (0/0 of an empty spread -> 0)
and the float32 metrics dict is one cast and an unbind (views) of v.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .linear import ONE, ZERO, Lin, matrix, names_in, to_device
from .rows import BIG, RowProgram

DENSE_LIMIT = 1 << 21  # entries of the dense map before the totals are first compacted


@dataclass
class Formula:
    n0: Lin
    d0: Lin = ONE
    n1: Lin = ZERO
    d1: Lin = ONE
    n2: Lin = ZERO
    d2: Lin = ONE
    root: bool = False
    count: Lin | None = None  # a spread's sample count: the metric is 0 unless it is above 1

    def forms(self) -> list[Lin]:
        return [self.n0, self.n1, self.n2, self.d0, self.d1, self.d2]


def ratio(num: Lin, den: Lin = ONE) -> Formula:
    return Formula(num, den)


def variance(sum_sq: Lin, total: Lin, weight: Lin, weight_less_one: Lin | None = None, *, root: bool = True) -> Formula:
    """sum_sq / W' - (total / W) * (total / W'), W' = W - 1 for the unbiased spread (else W).
    sum_sq and total are taken around any common shift (the batch maximum: equal values give 0);
    0 for a weight of at most 1 (one token, or one sequence)."""
    w1 = weight if weight_less_one is None else weight_less_one
    return Formula(sum_sq, w1, total, weight, total, w1, root=root, count=weight)


@dataclass
class Metric:
    name: str
    value: Formula
    cond: Lin
    default: float = 0.0
    other: Formula | None = None
    public: bool = True


@dataclass
class MetricProgram:
    metrics: list[Metric] = field(default_factory=list)

    def add(self, name: str, value: Formula, cond: Lin, default: float = 0.0, other: Formula | None = None,
            public: bool = True) -> None:
        self.metrics.append(Metric(name, value, cond, default, other, public))

    def index(self, name: str) -> int:
        return next(i for i, m in enumerate(self.metrics) if m.name == name)

    def compile(self, rows: RowProgram) -> None:
        order = [m for m in self.metrics if m.public] + [m for m in self.metrics if not m.public]
        self.metrics = order
        self.public = [m.name for m in order if m.public]
        self.candidates = 2 if any(m.other is not None for m in order) else 1
        cands = [[m.value, m.other or m.value][:self.candidates] for m in order]
        forms = [f.forms()[i] for i in range(6) for fs in cands for f in fs]
        forms += [m.cond for m in order]
        index = {key: rows.zbuf_index(key) for key in names_in(forms)}
        used = sorted(set(index.values()))
        # A large configuration maps only the totals it uses (one gather more).
        self.compact = len(forms) * rows.zbuf_size > DENSE_LIMIT
        if self.compact:
            position = {i: j for j, i in enumerate(used)}
            index = {key: position[i] for key, i in index.items()}
        a, bias = matrix(forms, index, len(used) if self.compact else rows.zbuf_size)
        f64 = torch.float64
        self._cpu = {"a": a, "bias": bias, "used": torch.tensor(used, dtype=torch.int64),
                     "p": torch.tensor([0.5 if f.root else 1.0 for fs in cands for f in fs], dtype=f64),
                     "default": torch.tensor([m.default for m in order], dtype=f64)}
        self.roots = any(f.root for fs in cands for f in fs)
        self._device: dict[torch.device, dict[str, torch.Tensor]] = {}

    def prepare(self, device: torch.device) -> None:
        if device not in self._device:
            self._device[device] = {k: to_device(v, device) for k, v in self._cpu.items()}

    def run(self, zbuf: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(float64 values of every metric in `metrics` order, {public name: 0-d float32})."""
        k = self._device[zbuf.device]
        n, c = len(self.metrics), self.candidates
        z = torch.nan_to_num(zbuf, nan=0.0, posinf=BIG, neginf=-BIG)
        if self.compact:
            z = z[k["used"]]
        p = torch.addmm(k["bias"], k["a"], z.unsqueeze(1)).view(-1)
        parts = p[:6 * n * c].view(6, n * c)
        r = torch.div(parts[:3], parts[3:])
        v = torch.addcmul(r[0], r[1], r[2], value=-1.0)
        if self.roots:
            v = torch.pow(v, k["p"])
        if c > 1:
            v = v.view(n, c).amax(-1)
        v = torch.where(p[6 * n * c:] > 0, v, k["default"])
        v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
        public = v[:len(self.public)].float()
        return v, dict(zip(self.public, public.unbind()))
