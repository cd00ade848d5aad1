import math

import pytest
import torch

from megatron_rlcorr.training.losses import (LossConfig, LossNormalizer, aggregate_loss, aggregate_over_batch,
                                             global_loss_normalizers, policy_loss, reduce_metric_partials)

AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
CONFIGS = {
    "ppo_dual_clip": dict(loss_type="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
    "ppo_no_dual_clip": dict(loss_type="ppo_clip", clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=None),
    "policy_gradient": dict(loss_type="policy_gradient"),
}
LENGTHS = [9, 4, 0, 7, 1, 6]  # valid tokens of each sequence (one empty)
T = 9


# ---- data and a float64 reference written token by token ----

def make_batch(seed=0, lengths=LENGTHS, seq_len=T):
    """Padded [B, T] batch whose masked positions hold garbage; valid tokens form a prefix of each row."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(lengths), seq_len)
    mask = torch.arange(seq_len) < torch.tensor(lengths).unsqueeze(1)
    batch = {
        "log_prob": -2 * torch.rand(shape, generator=gen),
        "old_log_prob": -2 * torch.rand(shape, generator=gen),
        "advantages": torch.randn(shape, generator=gen),
        "is_weights": 2 * torch.rand(shape, generator=gen),
        "entropy": 3 * torch.rand(shape, generator=gen),
    }
    batch["old_log_prob"][0, :3] = batch["log_prob"][0, :3] + torch.tensor([2.0, -3.0, 30.0])  # big ratios
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e4])
    for name, value in batch.items():
        fill = garbage[torch.randint(0, 4, shape, generator=gen)]
        batch[name] = torch.where(mask, value, fill)
    batch["loss_mask"] = mask.float()
    return batch


def reference_token_loss(lp, old, adv, w, cfg):
    """Per-token loss of the valid tokens of one sequence, one token at a time (float64 scalars)."""
    losses = []
    for t in range(lp.numel()):
        a = adv[t]
        if cfg.loss_type == "policy_gradient":
            loss = -a * lp[t]
        else:
            ratio = torch.exp(torch.clamp(lp[t] - old[t], -20, 20))
            clipped_ratio = torch.clamp(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
            loss = torch.maximum(-a * ratio, -a * clipped_ratio)
            if cfg.clip_ratio_c is not None and a < 0:
                loss = torch.minimum(loss, -a * cfg.clip_ratio_c)
        losses.append(loss * w[t] if w is not None else loss)
    return losses


def reference_loss(sequences, cfg, num_tokens, num_seqs, use_weights=True, entropy_coeff=0.0):
    """sequences: list of dicts of float64 valid-token tensors, one per sequence."""
    def aggregate(per_seq_token_values):
        if cfg.loss_agg_mode == "token-mean":
            return sum(sum(v) for v in per_seq_token_values) / num_tokens
        if cfg.loss_agg_mode == "seq-mean-token-sum":
            return sum(sum(v) for v in per_seq_token_values) / num_seqs
        return sum(sum(v) / len(v) for v in per_seq_token_values if len(v)) / num_seqs

    token_losses = [reference_token_loss(s["log_prob"], s["old_log_prob"], s["advantages"],
                                         s["is_weights"] if use_weights else None, cfg) for s in sequences]
    loss = aggregate(token_losses)
    if entropy_coeff:
        loss = loss - entropy_coeff * aggregate([list(s["entropy"]) for s in sequences])
    return loss


def valid_sequences(batch, requires_grad=("log_prob", "entropy")):
    """float64 leaf tensors of each row's valid tokens (for the reference and its gradient)."""
    mask = batch["loss_mask"] != 0
    sequences = []
    for i in range(mask.shape[0]):
        seq = {}
        for name in ("log_prob", "old_log_prob", "advantages", "is_weights", "entropy"):
            seq[name] = batch[name][i][mask[i]].double()
            if name in requires_grad:
                seq[name].requires_grad_()
        sequences.append(seq)
    return sequences


def scatter_rows(values_per_row, mask):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, values in enumerate(values_per_row):
        if values is not None:  # None: an empty sequence, which the reference never touched
            out[i][mask[i] != 0] = values
    return out


def run_ours(batch, cfg, normalizer, *, use_weights=True, cu_seqlens=None, keys=None):
    leaves = {name: batch[name].clone().requires_grad_() for name in ("log_prob", "entropy")}
    out = policy_loss(leaves["log_prob"], batch["old_log_prob"], batch["advantages"], batch["loss_mask"],
                      cfg, normalizer=normalizer, is_weights=batch["is_weights"] if use_weights else None,
                      entropy=leaves["entropy"], cu_seqlens=cu_seqlens)
    out.loss.backward()
    return out, leaves["log_prob"].grad, leaves["entropy"].grad


# ---- value and gradient against the reference ----

@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("use_weights", [True, False])
def test_padded_loss_and_gradient_match_reference(agg_mode, config, use_weights):
    cfg = LossConfig(loss_agg_mode=agg_mode, entropy_coeff=0.01, **CONFIGS[config])
    batch = make_batch()
    (normalizer,) = global_loss_normalizers([batch["loss_mask"]], agg_mode)
    out, grad_lp, grad_h = run_ours(batch, cfg, normalizer, use_weights=use_weights)

    seqs = valid_sequences(batch)
    num_tokens, num_seqs = sum(LENGTHS), sum(n > 0 for n in LENGTHS)
    ref = reference_loss(seqs, cfg, num_tokens, num_seqs, use_weights, entropy_coeff=0.01)
    ref.backward()
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    torch.testing.assert_close(out.loss.double(), ref.detach(), rtol=1e-5, atol=1e-7)
    mask = batch["loss_mask"]
    torch.testing.assert_close(grad_lp.double(), scatter_rows([s["log_prob"].grad for s in seqs], mask),
                               rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_h.double(), scatter_rows([s["entropy"].grad for s in seqs], mask),
                               rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("config", ["ppo_dual_clip", "policy_gradient"])
def test_packed_layout_equals_padded_layout(agg_mode, config):
    cfg = LossConfig(loss_agg_mode=agg_mode, **CONFIGS[config])
    batch = make_batch(seed=1)
    mask = batch["loss_mask"] != 0
    # Pack each row's valid tokens followed by 2 padding tokens (garbage, mask 0).
    pieces = {name: [] for name in batch}
    cu, pad = [0], 2
    for i, n in enumerate(LENGTHS):
        for name, value in batch.items():
            pieces[name].append(torch.cat([value[i][mask[i]], value[i, :pad] if name != "loss_mask"
                                           else torch.zeros(pad)]))
        cu.append(cu[-1] + n + pad)
    packed = {name: torch.cat(p) for name, p in pieces.items()}
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)

    (norm_padded,) = global_loss_normalizers([batch["loss_mask"]], agg_mode)
    (norm_packed,) = global_loss_normalizers([packed["loss_mask"]], agg_mode, cu_seqlens=[cu_seqlens])
    assert norm_packed.num_tokens == norm_padded.num_tokens == sum(LENGTHS)
    if agg_mode != "token-mean":
        assert torch.equal(norm_packed.seq_token_counts, norm_padded.seq_token_counts)
    out_padded, grad_padded, _ = run_ours(batch, cfg, norm_padded)
    out_packed, grad_packed, _ = run_ours(packed, cfg, norm_packed, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(out_packed.loss, out_padded.loss, rtol=1e-6, atol=0)
    packed_valid = packed["loss_mask"] != 0
    torch.testing.assert_close(grad_packed[packed_valid], grad_padded[mask], rtol=1e-6, atol=1e-9)
    assert torch.all(grad_packed[~packed_valid] == 0)


def test_metric_partials_match_reference():
    cfg = LossConfig(loss_type="ppo_clip", clip_ratio_high=0.28, clip_ratio_c=3.0)
    batch = make_batch(seed=2)
    (normalizer,) = global_loss_normalizers([batch["loss_mask"]], "token-mean")
    out, _, _ = run_ours(batch, cfg, normalizer)
    seqs = valid_sequences(batch, requires_grad=())
    lp, old, adv, h = (torch.cat([s[k] for s in seqs]) for k in ("log_prob", "old_log_prob", "advantages", "entropy"))
    ratio = torch.exp(lp - old)
    clipped = ratio.clamp(0.8, 1.28)
    expected = {
        "pg_clipfrac": (-adv * clipped > -adv * ratio).sum(),
        "pg_clipfrac_lower": ((adv < 0) & (torch.maximum(-adv * ratio, -adv * clipped) > -3.0 * adv)).sum(),
        # verl's ppo_kl: of the log-ratio clamped to [-20, 20] (one token here has a log-ratio of -30)
        "ppo_kl": (old - lp).clamp(-20, 20).sum(),
        "entropy": h.sum(),
    }
    assert set(out.metrics) == set(expected)
    assert expected["pg_clipfrac_lower"] > 0 and expected["pg_clipfrac"] > 0
    for name, value in expected.items():
        total, count = out.metrics[name]
        assert count == sum(LENGTHS)
        torch.testing.assert_close(total.double(), value.double(), rtol=1e-5, atol=1e-5)
    means = reduce_metric_partials([out.metrics, out.metrics])
    torch.testing.assert_close(means["ppo_kl"].double(), (old - lp).clamp(-20, 20).mean(), rtol=1e-5, atol=1e-6)


# ---- invariance to micro-batching ----

@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("config", ["ppo_dual_clip", "policy_gradient"])
def test_gradient_is_invariant_to_micro_batch_split(agg_mode, config):
    cfg = LossConfig(loss_agg_mode=agg_mode, entropy_coeff=0.02, **CONFIGS[config])
    batch = make_batch(seed=3)
    (whole,) = global_loss_normalizers([batch["loss_mask"]], agg_mode)
    out_whole, grad_whole, grad_h_whole = run_ours(batch, cfg, whole)

    rows = [[0, 1], [2], [3, 4, 5]]  # micro-batch 2 is the empty sequence alone
    micro = [{k: v[r] for k, v in batch.items()} for r in rows]
    normalizers = global_loss_normalizers([mb["loss_mask"] for mb in micro], agg_mode)
    results = [run_ours(mb, cfg, norm) for mb, norm in zip(micro, normalizers)]
    assert results[1][0].loss == 0  # exactly: an all-masked micro-batch
    total = sum(r[0].loss for r in results)
    torch.testing.assert_close(total, out_whole.loss, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), grad_whole, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(torch.cat([r[2] for r in results]), grad_h_whole, rtol=1e-6, atol=1e-9)


# ---- edge cases ----

@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("config", CONFIGS)
def test_all_masked_mini_batch_gives_zero_loss_and_zero_finite_gradient(agg_mode, config):
    cfg = LossConfig(loss_agg_mode=agg_mode, entropy_coeff=0.01, **CONFIGS[config])
    batch = make_batch(seed=4, lengths=[0, 0, 0])
    (normalizer,) = global_loss_normalizers([batch["loss_mask"]], agg_mode)
    out, grad_lp, grad_h = run_ours(batch, cfg, normalizer)
    assert out.loss.item() == 0.0
    assert torch.equal(grad_lp, torch.zeros_like(grad_lp)) and torch.equal(grad_h, torch.zeros_like(grad_h))
    for total, count in out.metrics.values():
        assert total.item() == 0.0 and count.item() == 0.0
    assert all(v.item() == 0.0 for v in reduce_metric_partials([out.metrics]).values())


def test_is_weights_are_detached():
    batch = make_batch(seed=5)
    weights = batch["is_weights"].clone().requires_grad_()
    (normalizer,) = global_loss_normalizers([batch["loss_mask"]], "token-mean")
    out = policy_loss(batch["log_prob"].clone().requires_grad_(), batch["old_log_prob"], batch["advantages"],
                      batch["loss_mask"], LossConfig(), normalizer=normalizer, is_weights=weights)
    out.loss.backward()
    assert weights.grad is None


def test_bool_mask_and_bf16_inputs():
    batch = make_batch(seed=6)
    cfg = LossConfig(loss_agg_mode="seq-mean-token-mean")
    (normalizer,) = global_loss_normalizers([batch["loss_mask"] != 0], cfg.loss_agg_mode)
    bf16 = {k: (v.bfloat16() if k != "loss_mask" else v != 0) for k, v in batch.items()}
    out, _, _ = run_ours(bf16, cfg, normalizer)
    as_fp32 = {k: (v.float() if k != "loss_mask" else v) for k, v in bf16.items()}
    ref, _, _ = run_ours(as_fp32, cfg, normalizer)
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)


# ---- validation ----

@pytest.mark.parametrize("kwargs, field", [
    (dict(loss_type="reinforce"), "loss_type"),
    (dict(loss_agg_mode="seq-mean"), "loss_agg_mode"),
    (dict(clip_ratio_low=1.0), "clip_ratio_low"),
    (dict(clip_ratio_low=-0.1), "clip_ratio_low"),
    (dict(clip_ratio_high=-0.1), "clip_ratio_high"),
    (dict(clip_ratio_high=math.inf), "clip_ratio_high"),
    (dict(clip_ratio_c=1.0), "clip_ratio_c"),
    (dict(entropy_coeff=math.nan), "entropy_coeff"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LossConfig(**kwargs)


def test_missing_inputs_are_reported():
    batch = make_batch()
    token_norm = LossNormalizer(torch.tensor(10.0))
    args = (batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["loss_mask"])
    with pytest.raises(ValueError, match="num_seqs"):
        policy_loss(*args, LossConfig(loss_agg_mode="seq-mean-token-sum"), normalizer=token_norm)
    with pytest.raises(ValueError, match="old_log_prob"):
        policy_loss(args[0], None, *args[2:], LossConfig(), normalizer=token_norm)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(*args, LossConfig(entropy_coeff=0.1), normalizer=token_norm)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(args[0], args[1], args[2][:, :3], args[3], LossConfig(), normalizer=token_norm)
    # policy gradient does not need old_log_prob
    out = policy_loss(args[0], None, *args[2:], LossConfig(loss_type="policy_gradient"), normalizer=token_norm)
    assert "ppo_kl" not in out.metrics and torch.isfinite(out.loss)


# ---- aggregate_over_batch (actor/entropy's aggregation) ----

def verl_agg_loss(values, mask, agg_mode, loss_scale_factor=None):
    """verl's agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=...) on a whole padded
    [B, T] batch (dp_size 1, no global counts given), written out in float64; masked values are
    zeroed first (verl multiplies by the mask, and its masked entries are finite)."""
    mask = mask.double()
    values = torch.where(mask != 0, values.double(), 0.0)
    seq_sums, seq_tokens = (values * mask).sum(-1), mask.sum(-1)
    nonempty = (seq_tokens > 0).double()
    if agg_mode == "token-mean":
        return (values * mask).sum() / mask.sum()
    if agg_mode == "seq-mean-token-sum":
        return (seq_sums * nonempty).sum() / nonempty.sum()
    if agg_mode == "seq-mean-token-mean":
        return (seq_sums / (seq_tokens + 1e-8) * nonempty).sum() / nonempty.sum()
    assert agg_mode == "seq-mean-token-sum-norm"
    factor = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return seq_sums.sum() / factor  # no sequence count: not the loss's sum / (sequences x F)


@pytest.mark.parametrize("agg_mode", [*AGG_MODES, "seq-mean-token-sum-norm"])
def test_aggregate_over_batch_is_agg_loss_of_the_valid_tokens(agg_mode):
    """verl's agg_loss(values, mask, mode), written sequence by sequence in float64 (the empty
    sequence counts in no mode; seq-mean-token-sum-norm: sum / F, as verl's trainer reports
    actor/entropy); garbage at masked positions never reaches it."""
    batch = make_batch(seed=4)
    seqs = [s["entropy"].double() for s in valid_sequences(batch, requires_grad=())]
    nonempty = [s for s in seqs if s.numel()]
    factor = 5.0
    expected = {
        "token-mean": sum(s.sum() for s in seqs) / sum(s.numel() for s in seqs),
        "seq-mean-token-sum": sum(s.sum() for s in nonempty) / len(nonempty),
        "seq-mean-token-mean": sum(s.mean() for s in nonempty) / len(nonempty),
        "seq-mean-token-sum-norm": sum(s.sum() for s in nonempty) / factor,
    }[agg_mode]
    got = aggregate_over_batch(batch["entropy"], batch["loss_mask"], agg_mode, loss_scale_factor=factor)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)


AGG_SHAPES = {  # valid tokens of each row, padded width
    "one_row": ([3], 4),
    "two_rows": ([2, 5], 5),
    "two_rows_one_empty": ([0, 4], 6),
    "small": ([1, 1, 2], 3),
    "default": (LENGTHS, T),
    "wide": ([17, 3, 30, 0, 8, 12, 1, 25], 32),
}


@pytest.mark.parametrize("agg_mode", [*AGG_MODES, "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("loss_scale_factor", [None, 7.0, 64.0])
@pytest.mark.parametrize("shape", sorted(AGG_SHAPES))
def test_aggregate_over_batch_matches_verl_agg_loss(shape, loss_scale_factor, agg_mode):
    """Every mode, several batch shapes (one and two rows too, where a sequence count of 2 would
    show as a factor of 2), an explicit loss_scale_factor and None (verl's default: the padded
    width): the formula of verl's agg_loss, written out in verl_agg_loss."""
    lengths, width = AGG_SHAPES[shape]
    batch = make_batch(seed=len(lengths) + width, lengths=lengths, seq_len=width)
    got = aggregate_over_batch(batch["entropy"], batch["loss_mask"], agg_mode, loss_scale_factor=loss_scale_factor)
    expected = verl_agg_loss(batch["entropy"], batch["loss_mask"], agg_mode, loss_scale_factor)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-12)


def test_seq_mean_token_sum_norm_metric_is_not_the_loss():
    """The loss divides by sequences x F (this project's mini-batch normaliser); the metric by F
    alone (verl's agg_loss): on a batch of two valid sequences they differ by exactly 2."""
    batch = make_batch(seed=11, lengths=[3, 5], seq_len=6)
    mask = batch["loss_mask"]
    (normalizer,) = global_loss_normalizers([mask], "seq-mean-token-sum-norm", loss_scale_factor=6.0)
    loss_value = aggregate_loss(torch.where(mask != 0, batch["entropy"], 0.0), "seq-mean-token-sum-norm", normalizer)
    metric = aggregate_over_batch(batch["entropy"], mask, "seq-mean-token-sum-norm", loss_scale_factor=6.0)
    torch.testing.assert_close(metric, 2 * loss_value, rtol=1e-6, atol=0)
