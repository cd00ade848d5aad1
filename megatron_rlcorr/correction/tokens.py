"""Phase 1, token -> sequence: every per-token quantity of a block in one buffer, reduced per
sequence in one pass.

The families ask for per-token quantities (`TokenRequests`); `TokenPhase` lays them out as the
slots of one float64 buffer `[K, *tokens]`, each group of slots written by ONE op:

  [lr, rollout]           old - rollout (the float32 difference) and the rollout log-prob, finite
  [-c, c, c_w0, ...]      clamp20(lr) (and its negative with a token-level ratio family), and lr
                          clamped to each token-level ratio family's [log lo, log hi]
  m                       the 0/1 mask
  [inv_rho, rho, w0, ...] exp of [-c, c, c_w0, ...] (1/rho: the minimum of rho is 1 / the
                          maximum of 1/rho, a nonnegative value)
  [rho^2, w0^2, ...]      squares
  c2, c4, k3, k3sq        divergence statistics (c^2, c^4, expm1(c) - c, its square), when asked
  x>t ...                 indicators (rho, c, c2 or k3 above a threshold), the veto indicator,
  trunc, kept             the truncated IS weight, the tokens every token rule keeps

Masked positions hold finite garbage: one batched product with the mask sums every slot over
each sequence's valid tokens (`Segments.row_sums`). The per-sequence statistic named after a
slot is that sum (`m` is the token count). Maxima are taken of nonnegative values times the
mask, where a masked position (0) cannot be the maximum; a signed statistic or a minimum goes
through a nonnegative affine transform (`TokenRequests.max_of`), or for a nonnegative statistic
through 1 / (1 + x) (`TokenRequests.min_of`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .linear import Lin, to_device
from .segments import Segments

LOG_RATIO_BOUND = 20.0  # the clamp of docs/math.md ("Notation"): exp stays finite in float32
INF_STANDIN = 1e30      # +-inf -> +-1e30 and NaN -> 0, so that a 0 mask clears masked garbage
EXTRA_SLOTS = ("c2", "c4", "k3", "k3sq")
NE = Lin.of("max:m")    # 1 for a sequence with a valid token on this rank, else 0


def at_least(value: float) -> float:
    """The largest float64 below `value`: x > at_least(v) is x >= v for float64 x."""
    return math.nextafter(value, -math.inf)


@dataclass
class TokenRequests:
    """What the families need per token. Each method returns the per-sequence statistic."""

    ratio_bounds: list[tuple[float, float]] = field(default_factory=list)  # (lo, hi) of each w
    thresholds: dict[str, list[float]] = field(default_factory=dict)       # slot -> t of "slot > t"
    extra: set[str] = field(default_factory=set)                           # of EXTRA_SLOTS
    transforms: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # slot -> (a, b)
    inverses: list[str] = field(default_factory=list)                      # slots: max of 1 / (1 + x)
    keep_rules: list[tuple[str | None, str]] = field(default_factory=list)  # (>= indicator, > indicator)
    veto_log: float | None = None
    trunc: tuple[float | None, float] | None = None

    def w(self, lo: float, hi: float) -> tuple[Lin, Lin]:
        """(sum of w, sum of w^2) over valid tokens, w = clamp(rho, lo, hi)."""
        if (lo, hi) not in self.ratio_bounds:
            self.ratio_bounds.append((lo, hi))
        i = self.ratio_bounds.index((lo, hi))
        return Lin.of(f"w{i}"), Lin.of(f"w{i}^2")

    def slot(self, name: str) -> Lin:
        """Sum of an extra slot: c2 = c^2, c4 = c^4, k3 = expm1(c) - c, k3sq = k3^2."""
        self.extra.update({"c4": ("c2", "c4"), "k3sq": ("k3", "k3sq")}.get(name, (name,)))
        return Lin.of(name)

    def above(self, source: str, threshold: float) -> Lin:
        """Valid tokens with source > threshold (source: rho, c, c2 or k3)."""
        if source in EXTRA_SLOTS:
            self.slot(source)
        values = self.thresholds.setdefault(source, [])
        if threshold not in values:
            values.append(threshold)
        return Lin.of(f"{source}>{threshold!r}")

    def max_of(self, source: str, a: float, b: float) -> Lin:
        """max over valid tokens of b * source (0 for a sequence without any), taken as the maximum
        of a + b * source, which must be >= 0 at every position."""
        if source in EXTRA_SLOTS:
            self.slot(source)
        pairs = self.transforms.setdefault(source, [])
        if (a, b) not in pairs:
            pairs.append((a, b))
        return Lin.of(f"max:{source}:{a!r}:{b!r}") - a * NE

    def min_of(self, source: str) -> tuple[Lin, Lin]:
        """(num, div): num / div is the min over valid tokens of a source >= 0 (0 for a sequence
        without tokens), from M = the maximum of 1 / (1 + source): min = 1 / M - 1, exact to
        float64 rounding also for tiny values."""
        self.slot(source)
        if source not in self.inverses:
            self.inverses.append(source)
        m = Lin.of(f"max:1/(1+{source})")
        return NE - m, m - NE + 1.0

    def keep(self, at_least_low: Lin | None, above_high: Lin) -> None:
        """A token rule: it keeps a token iff the `>=` indicator is 1 (None: always) and the `>` one 0."""
        rule = (None if at_least_low is None else _name(at_least_low), _name(above_high))
        if rule not in self.keep_rules:
            self.keep_rules.append(rule)

    def veto(self, log_threshold: float) -> Lin:
        self.veto_log = log_threshold
        return Lin.of("veto")

    def truncated(self, lower: float | None, upper: float) -> Lin:
        self.trunc = (lower, upper)
        return Lin.of("trunc")


def _name(stat: Lin) -> str:
    (name,) = stat.terms
    return name


class TokenPhase:
    """The slot layout of a `TokenRequests` and the ops that fill and reduce it."""

    def __init__(self, req: TokenRequests) -> None:
        self.req = req
        self.slots: list[str] = []
        # With a token-level ratio family the exp block also holds 1/rho and the clamped ratios w.
        self.pairs = bool(req.ratio_bounds)
        widths = [f"w{i}" for i in range(len(req.ratio_bounds))]
        self._add("lr", "rollout", *(["-c"] if self.pairs else []), "c", *(f"c_{w}" for w in widths), "m")
        self.exp0 = len(self.slots)
        self._add(*(["inv_rho"] if self.pairs else []), "rho", *widths)
        self.sq0 = len(self.slots)
        bases = ["rho"] + widths
        self._add(*(f"{base}^2" for base in bases), *(s for s in EXTRA_SLOTS if s in req.extra))
        self.above_at: dict[str, int] = {}  # source -> its first indicator slot
        for src, ts in req.thresholds.items():
            self.above_at[src] = len(self.slots)
            self._add(*(f"{src}>{t!r}" for t in ts))
        if req.veto_log is not None:
            self._add("veto")
        if req.trunc is not None:
            self._add("trunc")
        if req.keep_rules:
            self._add("kept")
        self.max_names = ["max:m"] + (["max:inv_rho", "max:rho"] if self.pairs else [])
        self.max_names += [f"max:{src}:{a!r}:{b!r}" for src, pairs in req.transforms.items() for a, b in pairs]
        self.max_names += [f"max:1/(1+{src})" for src in req.inverses]
        self._cpu = self._constants()
        self._device: dict[torch.device, dict[str, torch.Tensor]] = {}

    def _add(self, *names: str) -> None:
        self.slots.extend(names)

    def at(self, name: str) -> int:
        return self.slots.index(name)

    @property
    def stat_names(self) -> list[str]:
        """The rows of the per-sequence buffer: every slot's sum, then the maxima."""
        return self.slots + self.max_names

    @property
    def num_sums(self) -> int:
        return len(self.slots)

    def _constants(self) -> dict[str, torch.Tensor]:
        lows, highs = [-LOG_RATIO_BOUND], [LOG_RATIO_BOUND]
        for lo, hi in self.req.ratio_bounds:  # clamp(rho, lo, hi) = exp(clamp(lr, log lo, log hi))
            lows.append(min(max(math.log(lo), -LOG_RATIO_BOUND), LOG_RATIO_BOUND))
            highs.append(min(max(math.log(hi), -LOG_RATIO_BOUND), LOG_RATIO_BOUND))
        if self.pairs:  # -c = clamp20(-lr): 1/rho's exponent
            lows.insert(0, -LOG_RATIO_BOUND)
            highs.insert(0, LOG_RATIO_BOUND)
        out = {"c_lo": lows, "c_hi": highs, "signs": [-1.0] + [1.0] * (len(lows) - 1)}
        out.update({f"t_{src}": ts for src, ts in self.req.thresholds.items()})
        out.update({f"a_{src}": [a for a, _ in p] for src, p in self.req.transforms.items()})
        out.update({f"b_{src}": [b for _, b in p] for src, p in self.req.transforms.items()})
        return {name: torch.tensor(values, dtype=torch.float64) for name, values in out.items()}

    def prepare(self, device: torch.device, mask_dtype: torch.dtype | None = None) -> None:
        """The constants on `device`, and the zero of `mask_dtype` (`_zero`) when given."""
        if device not in self._device:
            self._device[device] = {k: to_device(v, device) for k, v in self._cpu.items()}
        key = f"zero_{mask_dtype}"
        if mask_dtype is not None and key not in self._device[device]:
            # shape [1], not 0-d: torch.compile may take a 0-d CPU tensor for a number and guard its value
            self._device[device][key] = to_device(torch.zeros(1, dtype=mask_dtype), device)

    def new_buffers(self, like: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(basis, max values) for blocks of `shape` tokens."""
        basis = torch.empty(len(self.slots), *shape, dtype=torch.float64, device=like.device)
        maxes = (torch.empty(len(self.max_names), *shape, dtype=torch.float64, device=like.device)
                 if len(self.max_names) > 1 else None)
        return basis, maxes

    # ---- the ops ----
    def fill(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, basis: torch.Tensor,
             seg: Segments) -> None:
        """Every slot of one block (old, rollout float32 [*tokens]; basis float64 [K, *tokens])."""
        b, k, shape = basis, self._device[basis.device], old.shape
        lr, c, m = self.at("lr"), self.at("c"), self.at("m")
        torch.sub(old, rollout, out=b[lr])
        b[lr + 1].copy_(rollout)
        b[lr:lr + 2].nan_to_num_(0.0, INF_STANDIN, -INF_STANDIN)
        clamped = b[lr + 2:m]
        if self.pairs:  # [-lr, lr, lr, ...] clamped to each slot's bounds
            torch.mul(b[lr], _col(k["signs"], shape), out=clamped)
            clamped.clamp_(_col(k["c_lo"], shape), _col(k["c_hi"], shape))
        else:
            torch.clamp(b[lr], -LOG_RATIO_BOUND, LOG_RATIO_BOUND, out=b[c])
        torch.ne(mask, self._zero(mask), out=b[m])
        if seg.is_packed:  # tokens after cu_seqlens[-1] belong to no sequence
            b[m].mul_(seg.in_sequence)
        torch.exp(clamped, out=b[self.exp0:self.sq0])
        base = b[self.exp0 + 1:self.sq0] if self.pairs else b[self.exp0:self.sq0]
        torch.mul(base, base, out=b[self.sq0:self.sq0 + base.shape[0]])
        self._extra_slots(b)
        for src, ts in self.req.thresholds.items():
            at = self.above_at[src]
            torch.gt(b[self.at(src)].expand(len(ts), *shape), _col(k[f"t_{src}"], shape), out=b[at:at + len(ts)])
        if self.req.veto_log is not None:
            torch.lt(b[lr], self.req.veto_log, out=b[self.at("veto")])
        if self.req.trunc is not None:
            torch.clamp(b[self.at("rho")], *self.req.trunc, out=b[self.at("trunc")])
        if self.req.keep_rules:
            self._token_keep(b)

    def _zero(self, mask: torch.Tensor) -> torch.Tensor:
        """A zero of the mask's dtype (shape [1]): compared with it, the mask needs no conversion op."""
        self.prepare(mask.device, mask.dtype)
        return self._device[mask.device][f"zero_{mask.dtype}"]

    def _extra_slots(self, b: torch.Tensor) -> None:
        extra, at = self.req.extra, self.at
        if "c2" in extra:
            torch.mul(b[at("c")], b[at("c")], out=b[at("c2")])
        if "c4" in extra:
            torch.mul(b[at("c2")], b[at("c2")], out=b[at("c4")])
        if "k3" in extra:  # expm1(c) - c in float64: tiny values keep their digits
            torch.expm1(b[at("c")], out=b[at("k3")]).sub_(b[at("c")])
        if "k3sq" in extra:
            torch.mul(b[at("k3")], b[at("k3")], out=b[at("k3sq")])

    def _token_keep(self, b: torch.Tensor) -> None:
        kept = b[self.at("kept")]
        kept.copy_(b[self.at("m")])
        for low, high in self.req.keep_rules:
            if low is not None:
                kept.mul_(b[self.at(low)])
            kept.addcmul_(kept, b[self.at(high)], value=-1.0)  # kept * (1 - [x > high])

    def maxima(self, basis: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        """[Kmax, *tokens] nonnegative values, 0 at masked positions, whose per-sequence maxima
        are the max statistics (`values`: the buffer from `new_buffers`)."""
        b, k, shape = basis, self._device[basis.device], basis.shape[1:]
        m = self.at("m")
        if values is None:
            return b[m:m + 1]  # m * m = m
        row = 3 if self.pairs else 1
        torch.mul(b[m:m + row], b[m], out=values[:row])
        for src, pairs in self.req.transforms.items():
            part = values[row:row + len(pairs)]
            torch.addcmul(_col(k[f"a_{src}"], shape), b[self.at(src)].expand(len(pairs), *shape),
                          _col(k[f"b_{src}"], shape), out=part).mul_(b[m])
            row += len(pairs)
        for src in self.req.inverses:
            torch.div(b[m], torch.add(b[self.at(src)], 1.0), out=values[row])
            row += 1
        return values


def _col(values: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """[k] -> [k, 1, ...] broadcasting over a block's token dimensions."""
    return values.view(-1, *([1] * len(shape)))
