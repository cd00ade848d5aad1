"""Linear forms over named statistics, and the constant matrices built from them.

The correction runs as a few fixed vector programs whose per-entry parameters are constants: which
per-sequence sums a per-sequence series combines, which batch totals a metric divides. A `Lin` is
one such combination, `sum_k coef_k * stat_k + bias`; `matrix` turns a list of them into the
dense matrix and bias of one `addmm`. Constants are built once per configuration and device
(`to_device`) and never from data, so the call itself builds no tensor from Python numbers.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch


class Lin:
    """sum_k coef_k * stat_k + bias over named statistics (immutable)."""

    __slots__ = ("terms", "bias")

    def __init__(self, terms: Mapping[str, float] | None = None, bias: float = 0.0) -> None:
        self.terms = {name: float(c) for name, c in (terms or {}).items() if c != 0.0}
        self.bias = float(bias)

    @staticmethod
    def of(name: str, coef: float = 1.0) -> "Lin":
        return Lin({name: coef})

    def __add__(self, other: "Lin | float") -> "Lin":
        other = as_lin(other)
        terms = dict(self.terms)
        for name, coef in other.terms.items():
            terms[name] = terms.get(name, 0.0) + coef
        return Lin(terms, self.bias + other.bias)

    __radd__ = __add__

    def __neg__(self) -> "Lin":
        return self * -1.0

    def __sub__(self, other: "Lin | float") -> "Lin":
        return self + (-as_lin(other))

    def __rsub__(self, other: "Lin | float") -> "Lin":
        return as_lin(other) - self

    def __mul__(self, scale: float) -> "Lin":
        return Lin({name: c * scale for name, c in self.terms.items()}, self.bias * scale)

    __rmul__ = __mul__

    def key(self) -> tuple:
        """A hashable identity: equal forms share one row of a program."""
        return tuple(sorted(self.terms.items())), self.bias

    def __repr__(self) -> str:
        parts = [f"{c:g}*{n}" for n, c in sorted(self.terms.items())]
        return " + ".join(parts + ([f"{self.bias:g}"] if self.bias or not parts else []))


def as_lin(value: "Lin | float") -> Lin:
    return value if isinstance(value, Lin) else Lin({}, float(value))


ZERO, ONE = Lin(), Lin({}, 1.0)


def matrix(forms: Sequence[Lin], columns: Mapping[str, int], width: int,
           dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [len(forms), width], bias [len(forms), 1]) on the CPU with A @ x + bias = the forms."""
    a = torch.zeros(len(forms), width, dtype=dtype)
    bias = torch.zeros(len(forms), 1, dtype=dtype)
    for row, form in enumerate(forms):
        for name, coef in form.terms.items():
            a[row, columns[name]] += coef
        bias[row, 0] = form.bias
    return a, bias


def names_in(forms: Iterable[Lin]) -> set[str]:
    return {name for form in forms for name in form.terms}


def to_device(cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A constant on `device` without a synchronising copy: pinned memory, copied asynchronously
    (the caching host allocator keeps the pinned block until the copy has run)."""
    if device.type == "cpu":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)
