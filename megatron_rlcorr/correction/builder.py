"""What the families declare into: the token requests, the per-sequence series, the metrics.

A family (off-policy metrics, IS weights, rejection, the veto, ...) runs no tensor op. It names
the per-token quantities it needs (`tok`), the per-sequence series built from them (`rows`) and
its metrics as formulas of batch totals (`metric`); `plan.py` compiles all families' requests
into the three fixed vector programs of a call.

Per-sequence statistics (sums over the sequence's valid tokens on this rank, then over CP):
N tokens, S log-ratio, R rollout log-prob, C clamped log-ratio, RHO ratio, RHO2 squared ratio;
NE is 1 for a sequence with a valid token. N1 = max(N, 1) divides a sequence mean.
"""
from __future__ import annotations

from .linear import ONE, Lin
from .metrics import Formula, MetricProgram, ratio
from .rows import RowProgram
from .tokens import NE, TokenRequests

N, S, R, C = Lin.of("m"), Lin.of("lr"), Lin.of("rollout"), Lin.of("c")
RHO, RHO2 = Lin.of("rho"), Lin.of("rho^2")
N1 = N - NE + 1.0


class Builder:
    def __init__(self, token_rules: bool) -> None:
        self.tok = TokenRequests()
        self.rows = RowProgram(NE, N, Lin.of("kept") if token_rules else None)
        self.program = MetricProgram()
        self.tokens = self.rows.total(self.rows.n, self.rows.ne)   # valid tokens of the batch
        self.seqs = self.rows.total(self.rows.ne, self.rows.ne)    # non-empty sequences of the batch

    def per_seq(self, g: str) -> Lin:
        """Sum over the batch's sequences of a G row (one per sequence)."""
        return self.rows.total(g, self.rows.ne)

    def per_token(self, g: str) -> Lin:
        """Sum over the batch's sequences of a G row times the sequence's valid tokens."""
        return self.rows.total(g, self.rows.n)

    def token_mean(self, total: Lin) -> Formula:
        return ratio(total, self.tokens)

    def seq_mean(self, total: Lin) -> Formula:
        return ratio(total, self.seqs)

    def metric(self, name: str, value: Formula, *, other: Formula | None = None, default: float = 0.0,
               cond: Lin | None = None, public: bool = True) -> None:
        """A metric, `default` where `cond` is not positive: by default the batch's sequence count,
        or for a spread its sample count - 1."""
        if cond is None:
            cond = self.seqs if value.count is None else value.count - 1.0
        self.program.add(name, value, cond, default, other, public)

    def extreme(self, total: Lin) -> Formula:
        return ratio(total, ONE)
