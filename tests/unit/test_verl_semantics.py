"""Golden test of advantages, policy losses, loss aggregation and KL penalties against verl's
DEFINITIONS.

The expected values come from a reference written here from the formulas alone (verl is neither
imported nor copied): plain Python float64 over one sequence and one token at a time, with the
gradient of every per-token quantity derived by hand (so the reference does not lean on torch's
autograd either). Because every aggregation is linear in the per-token values, the gradient of the
mini-batch loss w.r.t. a token's log-prob is that token's aggregation weight (the aggregation of a
one-hot input) times its per-token derivative.

The fixed mini-batch has 6 sequences of very different lengths, two of them empty (no valid token),
split into micro-batches of 1, 2 and 3 rows; masked positions (holes, padding) hold NaN/inf in every
input; hand-picked tokens have |log_prob - old_log_prob| > 20 (ratio clamp), dual clipping, clipping
above and below, and k3's value clamp. Inputs are float32 (what ours computes in); the reference
reads the same float32 values exactly as float64.
"""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_rlcorr.rl.advantages import ADV_EPS, group_advantages
from megatron_rlcorr.training.kl import KL_TYPES, KLLossSettings, kl_penalty
from megatron_rlcorr.training.losses import (
    LOSS_AGG_MODES,
    LOSS_TYPES,
    LossConfig,
    global_loss_normalizers,
    policy_loss,
    reduce_metric_partials,
)

NAN, INF = float("nan"), float("inf")
GARBAGE = (NAN, INF, -INF)
F_SCALE = 16.0         # seq-mean-token-sum-norm's loss_scale_factor
ENTROPY_COEFF = 0.05
K3 = KLLossSettings(enabled=True, coef=0.1, type="low_var_kl")
FIELDS = ("log_prob", "old_log_prob", "advantages", "is_weights", "entropy", "ref_log_prob")

# (positions, valid positions) of each sequence: a masked hole, padded tails, two empty sequences,
# a one-token sequence.
LAYOUT = [
    (12, [p for p in range(11) if p != 4]),  # 10 valid tokens
    (3, []),                                 # empty (first row of micro-batch 2)
    (3, [0, 1, 2]),
    (8, list(range(7))),
    (2, []),                                 # empty (middle row of micro-batch 3)
    (3, [1]),                                # a single valid token between garbage
]
NUM_RESPONSE_TOKENS = 21
SPLIT = (1, 2, 3)
# (sequence, position): (log_prob, old_log_prob, advantage)
PICKED = {
    (0, 0): (-0.2, -24.7, -0.7),  # log-ratio +24.5: ratio clamped to e^20, then dual clip
    (0, 1): (-24.5, -0.5, 0.9),   # log-ratio -24: ratio clamped to e^-20, unclipped, no gradient
    (0, 2): (-0.5, -2.0, -1.3),   # ratio e^1.5 = 4.48 > c = 3: dual clip
    (0, 3): (-1.0, -1.5, 0.8),    # ratio 1.65 > 1.28: clipped above
    (0, 5): (-1.2, -0.6, -0.4),   # ratio 0.55 < 0.8: clipped below
    (0, 6): (-0.7, -0.75, 0.3),   # ratio 1.05: inside the clip range
    (3, 2): (-0.3, -2.3, -0.5),   # ratio e^2: dual clip in another micro-batch
}
# (sequence, position): ref_log_prob - log_prob
KL_PICKED = {
    (0, 6): 3.0,     # k3 = e^3 - 4 = 16.1: clamped to 10, no gradient
    (3, 4): -30.0,   # k3's log-ratio clamped to -20 (value clamp too)
    (2, 1): -2.0,    # k3 = e^-2 + 1 = 1.14
}
# Rejection: (sequence -> rejected positions); sequence 5 loses all its tokens.
REJECTED = {0: [0, 2], 3: [5], 5: [1]}


# ---- the fixed mini-batch ----

def make_sequences(seed: int = 0, *, logp_garbage: bool = True, rejected: dict | None = None) -> list[dict]:
    """The 6 sequences: float32 1-D tensors with garbage at masked positions. "mask" (after
    rejection) and "response" (before) are bool. logp_garbage=False puts a finite garbage in log_prob."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i, (n, valid) in enumerate(LAYOUT):
        response = torch.zeros(n, dtype=torch.bool)
        response[valid] = True
        logp = -0.1 - 2.9 * torch.rand(n, generator=gen)
        s = {"log_prob": logp, "old_log_prob": logp - 0.4 * torch.randn(n, generator=gen),
             "advantages": torch.randn(n, generator=gen), "is_weights": 0.2 + 1.8 * torch.rand(n, generator=gen),
             "entropy": 3 * torch.rand(n, generator=gen), "ref_log_prob": logp + 0.5 * torch.randn(n, generator=gen)}
        for (j, t), (lp, old, adv) in PICKED.items():
            if j == i:
                s["log_prob"][t], s["old_log_prob"][t], s["advantages"][t] = lp, old, adv
                s["ref_log_prob"][t] = lp + 0.3
        for (j, t), delta in KL_PICKED.items():
            if j == i:
                s["ref_log_prob"][t] = s["log_prob"][t] + delta
        garbage = torch.tensor([GARBAGE[k % 3] for k in range(n)])
        for name in FIELDS:
            fill = torch.full((n,), 7.5e3) if name == "log_prob" and not logp_garbage else garbage
            s[name] = torch.where(response, s[name], fill)
        mask = response.clone()
        mask[(rejected or {}).get(i, [])] = False
        s["mask"], s["response"] = mask, response
        seqs.append(s)
    return seqs


def microbatches(seqs: list[dict], split: tuple[int, ...], packed: bool = False,
                 logp_pad: float = NAN) -> list[dict]:
    """Padded [rows, T] micro-batches (T = the longest row, padding NaN / False; log_prob: logp_pad),
    or packed [N] ones with "cu_seqlens". "rows" lists the sequence indices of each."""
    out, start = [], 0
    for size in split:
        rows = list(range(start, start + size))
        start += size
        width = max(seqs[i]["mask"].numel() for i in rows)
        batch = {"rows": rows}
        for key in FIELDS + ("mask", "response"):
            parts = [seqs[i][key] for i in rows]
            if packed:
                batch[key] = torch.cat(parts)
            else:
                fill = False if key in ("mask", "response") else logp_pad if key == "log_prob" else NAN
                batch[key] = torch.stack([torch.cat([p, torch.full((width - p.numel(),), fill)]) for p in parts])
        if packed:
            lengths = torch.tensor([seqs[i]["mask"].numel() for i in rows])
            batch["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int()
        out.append(batch)
    return out


# ---- the reference: verl's definitions, a token at a time (value, d value / d log_prob) ----

def ref_ppo_token(lp: float, old: float, adv: float, cfg: LossConfig) -> tuple[float, float, bool, bool]:
    """PPO-clip with dual clip: (loss, gradient, clip active, dual clip active)."""
    d = lp - old
    ratio = math.exp(min(max(d, -20.0), 20.0))
    d_ratio = ratio if -20.0 < d < 20.0 else 0.0      # clamp: no gradient outside
    low, high = 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high
    unclipped, clipped = -adv * ratio, -adv * min(max(ratio, low), high)
    clip = clipped > unclipped                        # only when the ratio is outside [low, high]
    loss, grad = (clipped, 0.0) if clip else (unclipped, -adv * d_ratio)
    dual = adv < 0 and loss > -adv * cfg.clip_ratio_c
    if dual:
        loss, grad = -adv * cfg.clip_ratio_c, 0.0
    return loss, grad, clip, dual


def ref_kl_token(lp: float, ref: float, kl_type: str) -> tuple[float, float]:
    """Per-token KL estimate and its derivative w.r.t. log_prob; "+" types take k2's gradient."""
    base, d = kl_type.removesuffix("+"), lp - ref
    if base in ("kl", "k1"):
        value, grad = d, 1.0
    elif base == "abs":
        value, grad = abs(d), math.copysign(1.0, d)
    elif base in ("mse", "k2"):
        value, grad = d * d / 2, d
    else:  # low_var_kl / k3
        x = min(max(ref - lp, -20.0), 20.0)
        value, grad = math.exp(x) - x - 1, (1.0 - math.exp(x)) if -20.0 < ref - lp < 20.0 else 0.0
        if not -10.0 <= value <= 10.0:
            value, grad = min(max(value, -10.0), 10.0), 0.0
    return value, (d if kl_type.endswith("+") else grad)


def ref_agg(values: list[list[float]], mode: str, counts: list[int] | None = None) -> float:
    """verl's aggregation of the mini-batch: values[i] are sequence i's (kept) token values; counts[i]
    its token count for the denominators (default: len(values[i]))."""
    counts = [len(v) for v in values] if counts is None else counts
    seqs = [i for i, n in enumerate(counts) if n > 0]   # sequences with >= 1 valid token
    if not seqs:
        return 0.0
    total = math.fsum(x for v in values for x in v)
    if mode == "token-mean":
        return total / sum(counts)
    if mode == "seq-mean-token-sum":
        return math.fsum(math.fsum(values[i]) for i in seqs) / len(seqs)
    if mode == "seq-mean-token-mean":
        return math.fsum(math.fsum(values[i]) / counts[i] for i in seqs) / len(seqs)
    assert mode == "seq-mean-token-sum-norm"
    return total / (len(seqs) * F_SCALE)


def ref_weights(values: list[list[float]], mode: str, counts: list[int] | None) -> list[list[float]]:
    """d agg / d value of each token: the aggregation of a one-hot input (agg is linear)."""
    def one_hot(i, t):
        return [[1.0 if (j, s) == (i, t) else 0.0 for s in range(len(v))] for j, v in enumerate(values)]
    return [[ref_agg(one_hot(i, t), mode, counts) for t in range(len(v))] for i, v in enumerate(values)]


def reference(seqs: list[dict], cfg: LossConfig, *, isw: bool = False, entropy: bool = False,
              kl: KLLossSettings | None = None, bypass: bool = False) -> dict:
    """Loss, terms, metrics and gradients (w.r.t. log_prob and entropy, per position) of the mini-batch.
    bypass: the denominators count the response tokens before rejection."""
    kept = [[t for t in range(s["mask"].numel()) if s["mask"][t]] for s in seqs]
    counts = [int(s["response"].sum()) for s in seqs] if bypass else None
    get = [{k: s[k].tolist() for k in FIELDS} for s in seqs]
    pg, pg_grad, ent, kls, kl_grad = [], [], [], [], []
    ppo_kl, clipfrac, lower = [], [], []
    for g, ts in zip(get, kept):
        pg.append([]), pg_grad.append([]), ent.append([]), kls.append([]), kl_grad.append([])
        for t in ts:
            lp, old, adv, w = g["log_prob"][t], g["old_log_prob"][t], g["advantages"][t], g["is_weights"][t]
            if cfg.loss_type == "ppo_clip":
                loss, grad, clip, dual = ref_ppo_token(lp, old, adv, cfg)
                clipfrac.append(clip), lower.append(dual)
            else:
                loss, grad = -adv * lp, -adv
            w = w if isw else 1.0
            pg[-1].append(loss * w), pg_grad[-1].append(grad * w), ent[-1].append(g["entropy"][t])
            ppo_kl.append(-min(max(lp - old, -20.0), 20.0))
            if kl is not None:
                value, grad = ref_kl_token(lp, g["ref_log_prob"][t], kl.type)
                kls[-1].append(value), kl_grad[-1].append(grad)
    mode = cfg.loss_agg_mode
    weights = ref_weights(pg, mode, counts)
    terms = {"pg_loss": ref_agg(pg, mode, counts)}
    coeff = ENTROPY_COEFF if entropy else 0.0
    if entropy:
        terms["entropy_loss"] = -coeff * ref_agg(ent, mode, counts)
    if kl is not None:
        terms["kl_loss"] = ref_agg(kls, mode, counts)
    grads, ent_grads = [], []
    for s, ts, w_i, pg_g, kl_g in zip(seqs, kept, weights, pg_grad, kl_grad):
        grad, ent_grad = [0.0] * s["mask"].numel(), [0.0] * s["mask"].numel()
        for k, t in enumerate(ts):
            grad[t] = w_i[k] * (pg_g[k] + (kl.coef * kl_g[k] if kl is not None else 0.0))
            ent_grad[t] = -coeff * w_i[k]
        grads.append(grad), ent_grads.append(ent_grad)
    n = len(ppo_kl)
    metrics = {"ppo_kl": math.fsum(ppo_kl) / n}
    if cfg.loss_type == "ppo_clip":
        metrics |= {"pg_clipfrac": sum(clipfrac) / n, "pg_clipfrac_lower": sum(lower) / n}
    if entropy:
        metrics["entropy"] = math.fsum(x for e in ent for x in e) / n
    loss = terms["pg_loss"] + terms.get("entropy_loss", 0.0) + (kl.coef * terms["kl_loss"] if kl else 0.0)
    return {"loss": loss, "terms": terms, "metrics": metrics, "grad": grads, "entropy_grad": ent_grads,
            "num_dual_clipped": sum(lower)}


# ---- ours ----

def run_ours(seqs: list[dict], split: tuple[int, ...], cfg: LossConfig, *, isw: bool = False, entropy: bool = False,
             kl: KLLossSettings | None = None, bypass: bool = False, packed: bool = False,
             logp_pad: float = NAN) -> dict:
    """Our mini-batch loss (sum of the micro-batch losses, each back-propagated as in gradient
    accumulation), terms, metric means and gradients mapped back to each sequence's positions."""
    batches = microbatches(seqs, split, packed, logp_pad)
    norm_key = "response" if bypass else "mask"
    normalizers = global_loss_normalizers([b[norm_key].float() for b in batches], cfg.loss_agg_mode,
                                          cu_seqlens=[b["cu_seqlens"] for b in batches] if packed else None,
                                          loss_scale_factor=F_SCALE)
    loss, terms, partials = 0.0, {}, []
    grads, ent_grads = [None] * len(seqs), [None] * len(seqs)
    for b, norm in zip(batches, normalizers):
        lp, ent, w = (b[k].clone().requires_grad_() for k in ("log_prob", "entropy", "is_weights"))
        out = policy_loss(lp, b["old_log_prob"], b["advantages"], b["mask"].float(), cfg, normalizer=norm,
                          is_weights=w if isw else None, entropy=ent if entropy else None,
                          ref_log_prob=b["ref_log_prob"] if kl else None, kl=kl,
                          cu_seqlens=b["cu_seqlens"] if packed else None)
        assert out.loss.dtype == torch.float32
        out.loss.backward()
        assert w.grad is None, "IS weights must be detached"
        loss += out.loss.item()
        for name, value in out.terms.items():
            terms[name] = terms.get(name, 0.0) + value.item()
        partials.append(out.metrics)
        ent_grad = ent.grad if ent.grad is not None else torch.zeros_like(ent)
        offset = 0
        for r, i in enumerate(b["rows"]):
            n = seqs[i]["mask"].numel()
            if packed:
                grads[i], ent_grads[i] = lp.grad[offset:offset + n], ent_grad[offset:offset + n]
                offset += n
            else:
                grads[i], ent_grads[i] = lp.grad[r, :n], ent_grad[r, :n]
                assert torch.all(lp.grad[r, n:] == 0) and torch.all(ent_grad[r, n:] == 0), "padding got gradient"
    metrics = {k: v.item() for k, v in reduce_metric_partials(partials).items()}
    return {"loss": loss, "terms": terms, "metrics": metrics, "grad": grads, "entropy_grad": ent_grads}


def assert_matches(ours: dict, ref: dict, rtol: float = 2e-5) -> None:
    assert math.isfinite(ours["loss"])
    assert ours["loss"] == pytest.approx(ref["loss"], rel=rtol, abs=1e-7)
    assert ours["terms"].keys() == ref["terms"].keys()
    for name, value in ref["terms"].items():
        assert ours["terms"][name] == pytest.approx(value, rel=rtol, abs=1e-7), name
    assert ours["metrics"].keys() == ref["metrics"].keys()
    for name, value in ref["metrics"].items():
        assert ours["metrics"][name] == pytest.approx(value, rel=rtol, abs=1e-7), name
    for key in ("grad", "entropy_grad"):
        for i, (g, expected) in enumerate(zip(ours[key], ref[key])):
            torch.testing.assert_close(g.double(), torch.tensor(expected, dtype=torch.float64), rtol=rtol,
                                       atol=1e-8, msg=lambda m, key=key, i=i: f"{key} of sequence {i}: {m}")


def loss_cfg(mode: str = "token-mean", loss_type: str = "ppo_clip", entropy: bool = False) -> LossConfig:
    return LossConfig(loss_type=loss_type, clip_ratio=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                      loss_agg_mode=mode, loss_scale_factor=F_SCALE,
                      entropy_coeff=ENTROPY_COEFF if entropy else 0.0)


SEQS = make_sequences()
EXTRAS = {
    "plain": {},
    "is_weights": {"isw": True},
    "entropy": {"entropy": True},
    "kl": {"kl": K3},
    "all": {"isw": True, "entropy": True, "kl": K3},
}


# ---- advantages ----

def ref_group_advantages(rewards: list[float], estimator: str, norm_by_std: bool = True,
                         eps: float = 1e-6) -> list[float]:
    """verl's GRPO ((r - mean) / (unbiased std + eps), or r - mean) and RLOO (r - mean of the others)."""
    n = len(rewards)
    if estimator == "rloo":
        return [r - math.fsum(rewards[:i] + rewards[i + 1:]) / (n - 1) for i, r in enumerate(rewards)]
    mean = statistics.fmean(rewards)
    if not norm_by_std:
        return [r - mean for r in rewards]
    std = statistics.stdev(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


REWARDS_GN = torch.tensor([
    [0.3, -1.2, 2.5, 0.0, 0.7, 1.1],
    [1.0, 0.0, 0.0, 1.0, 1.0, 0.0],
    [2 / 3] * 6,                            # all equal, not representable
    [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    [0.1, 0.1, 0.1, 0.1, 0.1, 0.6],         # one differs: informative
], dtype=torch.float32)


@pytest.mark.parametrize("estimator,norm_by_std", [("grpo", True), ("grpo", False), ("rloo", True)])
def test_group_advantages_match_definition(estimator, norm_by_std):
    """GRPO: (r - mean) / (unbiased std + 1e-6) or r - mean; RLOO: r - mean of the other n - 1."""
    ours = group_advantages(REWARDS_GN, estimator, norm_by_std=norm_by_std)
    expected = torch.tensor([ref_group_advantages(g, estimator, norm_by_std) for g in REWARDS_GN.tolist()],
                            dtype=torch.float64)
    assert ADV_EPS == 1e-6
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=2e-6)
    assert torch.all(ours[2] == 0)


@pytest.mark.parametrize("value", [2 / 3, 0.1])
def test_all_equal_group_gets_exactly_zero(value):
    """verl: a group with equal rewards has advantage 0 (exact here; verl's float32 formula leaves an ulp / eps)."""
    rewards = torch.full((1, 8), value, dtype=torch.float32)
    for estimator, norm in [("grpo", True), ("grpo", False), ("rloo", True)]:
        assert torch.equal(group_advantages(rewards, estimator, norm_by_std=norm), torch.zeros(1, 8))
    # Why the special case: the naive float32 formula divides a one-ulp mean error by std + eps = eps
    # (+0.056 for 8 x 2/3, -0.0074 for 8 x 0.1 with torch's float32 mean).
    naive = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)
    assert naive.abs().min() > 1e-3, naive


def test_grpo_epsilon_is_1e_minus_6():
    """GRPO's eps = 1e-6 in the denominator: rewards (0, 1e-6) give +-0.2929, not +-0.7071 (eps = 0)."""
    rewards = torch.tensor([[0.0, 1e-6]], dtype=torch.float32)
    ours = group_advantages(rewards, "grpo")[0].double()
    group = rewards[0].tolist()
    with_eps = torch.tensor(ref_group_advantages(group, "grpo", eps=1e-6), dtype=torch.float64)
    without_eps = torch.tensor(ref_group_advantages(group, "grpo", eps=0.0), dtype=torch.float64)
    torch.testing.assert_close(ours, with_eps, rtol=1e-5, atol=0)
    assert with_eps[1].item() == pytest.approx(0.29289, abs=1e-4)
    assert (ours - without_eps).abs().min() > 0.4


# ---- per-token PPO-clip ----

@pytest.mark.parametrize("lp,old,adv,clip,dual", [
    (-1.0, -1.05, 0.7, False, False),   # inside the clip range
    (-1.0, -1.5, 0.8, True, False),     # clipped above
    (-1.2, -0.6, -0.4, True, False),    # clipped below
    (-0.5, -2.0, -1.3, False, True),    # dual clip (ratio 4.48 > 3)
    (-0.2, -24.7, -0.7, False, True),   # log-ratio 24.5 clamped to 20, dual clip
    (-0.2, -24.7, 0.7, True, False),    # log-ratio 24.5 clamped, clipped above
    (-24.5, -0.5, 0.9, False, False),   # log-ratio -24 clamped to -20: value -A e^-20, no gradient
])
def test_ppo_clip_single_token(lp, old, adv, clip, dual):
    """verl's PPO-clip token loss max(-A r, -A clip(r, 1-0.2, 1+0.2)), dual clip min(., -3A) for A < 0,
    r = exp(clamp(logp - old, -20, 20)); pg_clipfrac, pg_clipfrac_lower and ppo_kl of that token."""
    cfg = LossConfig()  # defaults: clip_ratio 0.2 both sides, c = 3
    assert (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c) == (0.2, 0.2, 3.0)
    t = {k: torch.tensor([[v]]) for k, v in (("lp", lp), ("old", old), ("adv", adv))}
    lp_leaf = t["lp"].clone().requires_grad_()
    (norm,) = global_loss_normalizers([torch.ones(1, 1)], "token-mean")
    out = policy_loss(lp_leaf, t["old"], t["adv"], torch.ones(1, 1), cfg, normalizer=norm)
    out.loss.backward()
    value, grad, ref_clip, ref_dual = ref_ppo_token(*(t[k].item() for k in ("lp", "old", "adv")), cfg)
    assert (ref_clip, ref_dual) == (clip, dual)  # the case is what it says
    assert out.loss.item() == pytest.approx(value, rel=1e-5, abs=0)
    if grad == 0.0:
        assert lp_leaf.grad.item() == 0.0
    else:
        assert lp_leaf.grad.item() == pytest.approx(grad, rel=1e-5, abs=0)
    metrics = {k: v.item() for k, v in reduce_metric_partials([out.metrics]).items()}
    assert metrics["pg_clipfrac"] == float(clip) and metrics["pg_clipfrac_lower"] == float(dual)
    log_ratio = t["lp"].item() - t["old"].item()
    assert metrics["ppo_kl"] == pytest.approx(-min(max(log_ratio, -20.0), 20.0), rel=1e-5)


# ---- the mini-batch loss: value, terms, metrics, gradients ----

@pytest.mark.parametrize("extras", EXTRAS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_matches_verl(mode, loss_type, extras):
    """verl's token losses (PPO-clip with dual clip / REINFORCE, IS weights after clipping, detached),
    aggregation over the mini-batch (micro-batches 1 + 2 + 3 rows), entropy bonus and KL loss (k3):
    value, terms, metrics and gradients w.r.t. log_prob and entropy; garbage at masked positions."""
    opts = EXTRAS[extras]
    cfg = loss_cfg(mode, loss_type, entropy=opts.get("entropy", False))
    ref = reference(SEQS, cfg, **opts)
    if loss_type == "ppo_clip":
        assert ref["num_dual_clipped"] >= 2 and ref["metrics"]["pg_clipfrac"] > 0
    assert_matches(run_ours(SEQS, SPLIT, cfg, **opts), ref)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_independent_of_micro_batch_split(mode):
    """verl's aggregation is over the mini-batch: micro-batches of 1, 2, the whole batch and 1+2+3
    rows give the same loss and gradient (for seq-mean-token-sum-norm verl's own per-micro-batch
    sum / F would scale with the micro-batch size; ours equals sum / (sequences x F) for all)."""
    cfg = loss_cfg(mode, "ppo_clip", entropy=True)
    ref = reference(SEQS, cfg, isw=True, entropy=True, kl=K3)
    losses = []
    for split in [(1,) * 6, (2, 2, 2), (6,), SPLIT]:
        ours = run_ours(SEQS, split, cfg, isw=True, entropy=True, kl=K3)
        assert_matches(ours, ref)
        losses.append(ours["loss"])
    assert max(losses) - min(losses) <= 1e-6 * abs(ref["loss"])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_packed_layout_matches_verl(mode):
    """The same definitions with packed [N] micro-batches and cu_seqlens."""
    cfg = loss_cfg(mode, "ppo_clip", entropy=True)
    ref = reference(SEQS, cfg, isw=True, entropy=True, kl=K3)
    assert_matches(run_ours(SEQS, SPLIT, cfg, isw=True, entropy=True, kl=K3, packed=True), ref)


def test_seq_mean_token_sum_norm_formula():
    """Dr. GRPO: sum of the token losses / (sequences with >= 1 valid token x F), spelled out."""
    cfg = loss_cfg("seq-mean-token-sum-norm", "policy_gradient")
    total = math.fsum(-a * lp for s in SEQS for lp, a, m in
                      zip(s["log_prob"].tolist(), s["advantages"].tolist(), s["mask"].tolist()) if m)
    for split in [(1,) * 6, (2, 2, 2), (6,)]:
        assert run_ours(SEQS, split, cfg)["loss"] == pytest.approx(total / (4 * F_SCALE), rel=2e-5)


# ---- KL ----

KL_POINTS = [(-1.0, -1.3), (-2.0, -0.6), (-0.5, -2.5), (-4.0, -1.0), (-0.1, -30.1), (-31.0, -1.0), (-1.0, -1.0 + 1e-3)]


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_kl_estimators_match_definitions(kl_type):
    """verl's kl_penalty: k1 d, abs |d|, k2 d^2/2, k3 clamp(e^x - x - 1, +-10) with x = clamp(-d, +-20);
    "+" types: the base value with k2's gradient d."""
    lp = torch.tensor([p[0] for p in KL_POINTS], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([p[1] for p in KL_POINTS], dtype=torch.float64)
    value = kl_penalty(lp, ref, kl_type)
    value.sum().backward()
    expected = [ref_kl_token(a, b, kl_type) for a, b in KL_POINTS]
    torch.testing.assert_close(value.detach(), torch.tensor([e[0] for e in expected], dtype=torch.float64))
    torch.testing.assert_close(lp.grad, torch.tensor([e[1] for e in expected], dtype=torch.float64))


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_kl_loss_matches_verl(kl_type):
    """KL loss term: loss += coef * agg(kl estimate over valid tokens); terms["kl_loss"] = agg(kl).
    (log_prob's masked and padded positions hold a finite garbage here; NaN/inf there: next test.)"""
    kl = KLLossSettings(enabled=True, coef=0.2, type=kl_type)
    seqs = make_sequences(logp_garbage=False)
    cfg = loss_cfg("seq-mean-token-mean", "ppo_clip")
    assert_matches(run_ours(seqs, SPLIT, cfg, kl=kl, logp_pad=7.5e3), reference(seqs, cfg, kl=kl))


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_kl_loss_ignores_garbage_log_prob(kl_type):
    """Masked positions never reach the loss or its gradient, with the KL loss on (NaN/inf in log_prob).
    (k2 and the "+" types failed this while kl_penalty got the unmasked log_prob: k2's backward
    d x 0 is NaN at a masked NaN/inf position.)"""
    kl = KLLossSettings(enabled=True, coef=0.2, type=kl_type)
    cfg = loss_cfg("token-mean", "ppo_clip")
    assert_matches(run_ours(SEQS, SPLIT, cfg, kl=kl), reference(SEQS, cfg, kl=kl))


# ---- rejection ----

@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_decoupled_rejection_leaves_numerator_and_normaliser(mode, loss_type):
    """Decoupled mode: rejected tokens leave the sum and the counts (a fully rejected sequence no
    longer counts as a sequence): the definitions applied to the post-rejection mask."""
    seqs = make_sequences(rejected=REJECTED)
    assert sum(bool(s["mask"].any()) for s in seqs) == 3
    cfg = loss_cfg(mode, loss_type, entropy=True)
    ref = reference(seqs, cfg, isw=True, entropy=True, kl=K3)
    assert_matches(run_ours(seqs, SPLIT, cfg, isw=True, entropy=True, kl=K3), ref)
    assert ref["loss"] != pytest.approx(reference(SEQS, cfg, isw=True, entropy=True, kl=K3)["loss"])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_bypass_rejection_normalises_by_all_response_tokens(loss_type):
    """Bypass mode, token-mean: sum of the kept tokens' losses / number of ALL response tokens
    (normaliser from the pre-rejection mask, post-rejection mask to policy_loss)."""
    seqs = make_sequences(rejected=REJECTED)
    cfg = loss_cfg("token-mean", loss_type)
    ours = run_ours(seqs, SPLIT, cfg, isw=True, bypass=True)
    ref = reference(seqs, cfg, isw=True, bypass=True)
    assert_matches(ours, ref)
    kept = []
    for s in seqs:
        for t in range(s["mask"].numel()):
            if s["mask"][t]:
                lp, old, adv, w = (s[k][t].item() for k in ("log_prob", "old_log_prob", "advantages", "is_weights"))
                loss = ref_ppo_token(lp, old, adv, cfg)[0] if loss_type == "ppo_clip" else -adv * lp
                kept.append(loss * w)
    assert len(kept) == NUM_RESPONSE_TOKENS - 4
    assert ours["loss"] == pytest.approx(math.fsum(kept) / NUM_RESPONSE_TOKENS, rel=2e-5)
