"""Phase 2, sequence -> batch: every per-sequence series of every family in one `[J, rows]`
matrix, taken through one fixed chain of ops, and summed over the batch in one product.

A series is `num / div` of linear forms of the per-sequence statistics (`tokens.py`), clamped
to its bounds and, for `expm1` series, passed through expm1 (exp(x) - 1: 0 for an empty
sequence, and no cancellation in a ratio's deviation from 1). All series are rows of Z:

  X = addmm(bias, A, stats)       numerators, divisors and the empty-row offset: one matmul
  Z = X_num / X_div; clamp_; expm1_ (a suffix of the rows)
  Ind = Z > thresholds            0/1 indicators (a contiguous block of the rows)
  any = max of decision indicators (a sequence rule or the veto rejects the sequence)
  Mx = max over non-empty sequences of each row (empty ones pushed to -BIG by the offset)
  D = Z - Mx * ne                 deviations from the batch maximum, for the spreads
  T = G @ W^T                     every batch sum: G = [Ind, n*D, any, D, Z], W = [D, ne, n, kept]

Sums over sequences are products with a weight row (ne: 1 per non-empty sequence; n: its
tokens; kept: its tokens kept by the token rules), so empty sequences drop out without a mask
op. Spreads are sums of squared deviations from the batch maximum, combined with their sums in
the metrics: equal values give exactly 0, and the shift is a value of the data. The batch
totals are `zbuf = [T.flatten(), Mx]`; every metric is a linear form of them (`metrics.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .linear import ONE, Lin, matrix, names_in, to_device

BIG = 1e300  # the max of an empty set of sequences; finite so that linear maps stay NaN-free
TAGS = ("lost", "rs", "veto")  # decision rows, in this order in Z


@dataclass
class Series:
    num: Lin
    div: Lin = ONE
    lo: float = -math.inf
    hi: float = math.inf
    expm1: bool = False
    above: float | None = None   # the row's indicator threshold
    tag: str | None = None       # a decision row: "lost" (tokens lost to token rules), "rs", "veto"
    dev: bool = False            # deviations needed (a spread)
    ndev: bool = False           # token-weighted deviations needed
    name: str = field(default="", compare=False)

    def key(self) -> tuple:
        return (self.num.key(), self.div.key(), self.lo, self.hi, self.expm1, self.above, self.tag)

    def group(self) -> int:
        """Position class in Z: plain, decisions by tag, indicators, indicators with spreads,
        spreads; then the expm1 rows: spreads, indicators with spreads, indicators, plain."""
        if self.expm1:
            return 10 + (0 if self.above is None and self.dev else 1 if self.dev else
                         2 if self.above is not None else 3)
        if self.tag is not None:
            return 1 + TAGS.index(self.tag)
        if self.above is None:
            return 8 if self.dev else 0
        return 7 if self.dev else 6


class RowProgram:
    """Registers series (by value: equal series share a row) and runs the chain."""

    def __init__(self, ne: Lin, n: Lin, kept: Lin | None) -> None:
        self.series: dict[tuple, Series] = {}
        self.any_rows: dict[str, tuple[str, ...]] = {}
        self.weights = [self.add(ne), self.add(n)] + ([self.add(kept)] if kept is not None else [])

    # ---- registration ----
    def add(self, num: Lin, div: Lin = ONE, lo: float = -math.inf, hi: float = math.inf,
            expm1: bool = False, above: float | None = None, tag: str | None = None) -> str:
        s = Series(num, div, lo, hi, expm1, above, tag)
        s = self.series.setdefault(s.key(), s)
        if not s.name:
            s.name = f"z{len(self.series) - 1}"
        return s.name

    def any_of(self, name: str, tags: tuple[str, ...]) -> str:
        """A G row: 1 where a decision row with one of `tags` has indicator 1."""
        self.any_rows[name] = tags
        return name

    def _get(self, name: str) -> Series:
        return next(s for s in self.series.values() if s.name == name)

    def total(self, g: str, weight: str) -> Lin:
        """Sum over the batch's sequences of G row g times a weight row (`ne`, `n`, `kept`, or
        'dev:' + series). G rows: a series, 'ind:' / 'dev:' / 'ndev:' + series, an `any_of` row."""
        for ref in (g, weight):
            kind, _, name = ref.rpartition(":")
            if kind in ("dev", "ndev"):
                self._get(name).dev = True
            if kind == "ndev":
                self._get(name).ndev = True
        return Lin.of(f"T:{g}|{weight}")

    def maximum(self, name: str) -> Lin:
        """max over the batch's non-empty sequences of a series (-BIG for none)."""
        return Lin.of(f"M:{name}")

    @property
    def ne(self) -> str:
        return self.weights[0]

    @property
    def n(self) -> str:
        return self.weights[1]

    @property
    def kept(self) -> str:
        return self.weights[-1]

    # ---- compilation ----
    def compile(self, stat_names: list[str]) -> None:
        """Fix the row order, so that every op of the chain runs on one contiguous block of rows,
        and build the constants."""
        first = [self._get(w) for w in self.weights]
        self.order = first + sorted((s for s in self.series.values() if s not in first), key=Series.group)
        self.row = {s.name: i for i, s in enumerate(self.order)}
        j = len(self.order)
        self.exp0 = next((i for i, s in enumerate(self.order) if s.expm1), j)
        self.ind = _span([i for i, s in enumerate(self.order) if s.above is not None])
        self.dev = _span([i for i, s in enumerate(self.order) if s.dev])
        self.ndev = _span([i for i, s in enumerate(self.order) if s.ndev])
        self.any_span = {}
        for name, tags in self.any_rows.items():
            rows = [i for i, s in enumerate(self.order) if s.tag in tags]
            assert rows and rows == list(range(rows[0], rows[-1] + 1)), f"{name}: {tags} rows are not contiguous"
            self.any_span[name] = _span(rows)
        for s in self.order:  # a deviation is Z - Mx * ne: Z must vanish for an empty sequence
            assert not s.dev or (not s.num.bias and s.lo <= 0.0 <= s.hi), f"spread of {s} is not 0 when empty"
        n_ind, n_nd, n_dev = (b - a for a, b in (self.ind, self.ndev, self.dev))
        # G = [Ind, ndev, any rows, D, Z]; W = [D, ne, n, (kept)] is a contiguous block of G
        self.g_nd = n_ind
        self.g_any = {name: n_ind + n_nd + i for i, name in enumerate(self.any_rows)}
        self.g_dev = n_ind + n_nd + len(self.any_rows)
        self.g_z = self.g_dev + n_dev
        self.num_g = self.g_z + j
        self.num_w = n_dev + len(first)
        cols = {name: i for i, name in enumerate(stat_names)}
        forms = [s.num for s in self.order] + [s.div for s in self.order] + [BIG * Lin.of("max:m") - BIG]
        missing = names_in(forms) - set(cols)
        assert not missing, f"statistics no token slot provides: {missing}"
        a, bias = matrix(forms, cols, len(stat_names))
        f64 = torch.float64
        self._cpu = {
            "a": a, "bias": bias,
            "lo": torch.tensor([[s.lo] for s in self.order], dtype=f64),
            "hi": torch.tensor([[s.hi] for s in self.order], dtype=f64),
            "above": torch.tensor([[math.inf if s.above is None else s.above]
                                   for s in self.order[self.ind[0]:self.ind[1]]], dtype=f64),
        }
        self._device: dict[torch.device, dict[str, torch.Tensor]] = {}

    def zbuf_index(self, key: str) -> int:
        """Position of a total ('T:g|w' or 'M:series') in zbuf = [T.flatten(), Mx]."""
        if key.startswith("M:"):
            return self.num_g * self.num_w + self.row[key[2:]]
        g, w = key[2:].split("|")
        return self._g_row(g) * self.num_w + self._w_col(w)

    def _g_row(self, g: str) -> int:
        if g in self.g_any:
            return self.g_any[g]
        kind, _, name = g.rpartition(":")
        r = self.row[name]
        offset = {"ind": (0, self.ind), "ndev": (self.g_nd, self.ndev), "dev": (self.g_dev, self.dev),
                  "": (self.g_z, (0, 0))}[kind]
        return offset[0] + r - offset[1][0]

    def _w_col(self, w: str) -> int:
        if w.startswith("dev:"):
            return self.row[w[4:]] - self.dev[0]
        return (self.dev[1] - self.dev[0]) + self.weights.index(w)

    @property
    def zbuf_size(self) -> int:
        return self.num_g * self.num_w + len(self.order)

    def prepare(self, device: torch.device) -> None:
        if device not in self._device:
            self._device[device] = {k: to_device(v, device) for k, v in self._cpu.items()}

    # ---- the chain ----
    def run(self, stats: torch.Tensor, dp_max, dp_sum) -> tuple[torch.Tensor, torch.Tensor]:
        """(zbuf, G) from the per-sequence statistics [S, rows] (CP-reduced). dp_max / dp_sum
        all-reduce a tensor in place over the DP group (MAX before the deviations, SUM after)."""
        k, j, rows = self._device[stats.device], len(self.order), stats.shape[1]
        x = torch.addmm(k["bias"], k["a"], stats)
        g = torch.empty(self.num_g, rows, dtype=torch.float64, device=stats.device)
        z = g[self.g_z:]
        torch.div(x[:j], x[j:2 * j], out=z)
        z.clamp_(k["lo"], k["hi"])
        if self.exp0 < j:
            z[self.exp0:].expm1_()
        a, b = self.ind
        if b > a:
            torch.gt(z[a:b], k["above"], out=g[:b - a])
        for name, (s, e) in self.any_span.items():
            torch.amax(g[s - a:e - a], 0, out=g[self.g_any[name]])
        zbuf = torch.empty(self.zbuf_size, dtype=torch.float64, device=stats.device)
        mx = zbuf[self.num_g * self.num_w:]
        if rows:
            torch.amax(torch.add(z, x[2 * j]), -1, out=mx)
        else:
            mx.fill_(-BIG)
        dp_max(mx)
        s, e = self.dev
        if e > s:
            torch.addr(z[s:e], mx[s:e], z[self.row[self.ne]], alpha=-1.0, out=g[self.g_dev:self.g_z])
        s2, e2 = self.ndev
        if e2 > s2:
            dev = g[self.g_dev + s2 - s:self.g_dev + e2 - s]
            torch.mul(dev, z[self.row[self.n]], out=g[self.g_nd:self.g_nd + e2 - s2])
        w = g[self.g_dev:self.g_z + len(self.weights)]
        torch.mm(g, w.t(), out=zbuf[:self.num_g * self.num_w].view(self.num_g, self.num_w))
        dp_sum(zbuf[:self.num_g * self.num_w])
        return zbuf, g

    def z_row(self, g: torch.Tensor, name: str) -> torch.Tensor:
        return g[self.g_z + self.row[name]]

    def any_row(self, g: torch.Tensor, name: str) -> torch.Tensor:
        return g[self.g_any[name]]


def _span(indices: list[int]) -> tuple[int, int]:
    return (min(indices), max(indices) + 1) if indices else (0, 0)
