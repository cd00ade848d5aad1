"""Policy loss under DP=2 x CP=2 (gloo, 4 ranks) equals one process on the whole mini-batch.

Rank = 2 * dp_rank + cp_rank. Each DP rank holds half the sequences as two micro-batches; each
CP rank holds Megatron's zigzag share of every sequence, padded [B, T] or packed THD.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_rlcorr.training.losses import LossConfig, global_loss_normalizers, policy_loss, reduce_metric_partials
from megatron_rlcorr.parallel.context import (
    cp_pad_multiple,
    merge_from_cp,
    merge_packed_from_cp,
    pack_sequences,
    split_for_cp,
    split_packed_for_cp,
)
from tests.dist import run_distributed
from tests.unit.test_losses import make_batch as make_loss_batch

DP, CP = 2, 2
T = 12
# Valid tokens per sequence: an empty one, and short ones whose tokens all sit on CP rank 0
# (zigzag chunks of 3: rank 0 holds positions 0-2 and 9-11).
LENGTHS = [12, 3, 0, 7, 1, 10, 5, 2]
MICRO_BATCH_ROWS = 2
TENSORS = ("log_prob", "old_log_prob", "advantages", "is_weights", "entropy", "loss_mask")
CASES = [(loss_type, agg) for loss_type in ("ppo_clip", "policy_gradient")
         for agg in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")]


def make_batch():
    return make_loss_batch(seed=11, lengths=LENGTHS, seq_len=T)


def config(loss_type, agg_mode):
    return LossConfig(loss_type=loss_type, loss_agg_mode=agg_mode, entropy_coeff=0.01)


def loss_and_grads(mb, cfg, normalizer, cu_seqlens=None):
    leaves = {k: mb[k].clone().requires_grad_() for k in ("log_prob", "entropy")}
    out = policy_loss(leaves["log_prob"], mb["old_log_prob"], mb["advantages"], mb["loss_mask"], cfg,
                      normalizer=normalizer, is_weights=mb["is_weights"], entropy=leaves["entropy"],
                      cu_seqlens=cu_seqlens)
    out.loss.backward()
    return out, leaves["log_prob"].grad, leaves["entropy"].grad


def my_micro_batches(dp_rank):
    batch = make_batch()
    rows = range(dp_rank * len(LENGTHS) // DP, (dp_rank + 1) * len(LENGTHS) // DP)
    starts = list(rows)[::MICRO_BATCH_ROWS]
    return [{k: v[s:s + MICRO_BATCH_ROWS] for k, v in batch.items()} for s in starts]


def pack_valid_tokens(mb):
    """Packed THD micro-batch of each row's valid tokens, padded for CP (garbage at padding)."""
    mask = mb["loss_mask"] != 0
    packed = {}
    for name in TENSORS:
        rows = [mb[name][i][mask[i]] for i in range(mask.shape[0])]
        fill = 0.0 if name == "loss_mask" else float("nan")
        packed[name] = pack_sequences(rows, cp_pad_multiple(CP), pad_value=fill)
    return {k: p.values for k, p in packed.items()}, packed["loss_mask"].cu_seqlens_padded


def _dp_cp_worker(rank, world_size):
    dp_rank, cp_rank = divmod(rank, CP)
    cp_groups = [dist.new_group([2 * d, 2 * d + 1]) for d in range(DP)]
    dp_groups = [dist.new_group([c, c + CP]) for c in range(CP)]
    groups = dict(cp_group=cp_groups[dp_rank], dp_group=dp_groups[cp_rank])
    micro_batches = my_micro_batches(dp_rank)

    results = {}
    for loss_type, agg in CASES:
        cfg = config(loss_type, agg)
        # padded: zigzag split of every [B, T] tensor
        local = [{k: split_for_cp(v, CP, cp_rank, seq_dim=1) for k, v in mb.items()} for mb in micro_batches]
        norms = global_loss_normalizers([mb["loss_mask"] for mb in local], agg, **groups)
        outs = [loss_and_grads(mb, cfg, n) for mb, n in zip(local, norms)]
        results[("padded", loss_type, agg)] = _summarize(outs, groups)

        # packed: THD micro-batches, TE's per-sequence zigzag split
        local, local_cus, full_cus = [], [], []
        for mb in micro_batches:
            packed, cu_padded = pack_valid_tokens(mb)
            split = {k: split_packed_for_cp(v, cu_padded, CP, cp_rank) for k, v in packed.items()}
            local.append({k: v[0] for k, v in split.items()})
            local_cus.append(split["loss_mask"][1])
            full_cus.append(cu_padded)
        norms = global_loss_normalizers([mb["loss_mask"] for mb in local], agg, cu_seqlens=local_cus, **groups)
        outs = [loss_and_grads(mb, cfg, n, cu) for mb, n, cu in zip(local, norms, local_cus)]
        results[("packed", loss_type, agg)] = _summarize(outs, groups) + (full_cus,)
    return results


def _summarize(outs, groups):
    loss = sum(o.loss.detach() for o, _, _ in outs)
    metrics = reduce_metric_partials([o.metrics for o, _, _ in outs], **groups)
    return loss, [g for _, g, _ in outs], [g for _, _, g in outs], metrics


def reference(loss_type, agg):
    batch = make_batch()
    (normalizer,) = global_loss_normalizers([batch["loss_mask"]], agg)
    out, grad_lp, grad_h = loss_and_grads(batch, config(loss_type, agg), normalizer)
    return out.loss.detach(), grad_lp, grad_h, reduce_metric_partials([out.metrics])


def merged_padded_grads(results, key, which):
    """[B, T] gradient of the whole mini-batch from every rank's zigzag shards."""
    rows = []
    for dp_rank in range(DP):
        shards = [results[2 * dp_rank + c][key][which] for c in range(CP)]
        rows += [merge_from_cp([s[m] for s in shards], CP, seq_dim=1) for m in range(len(shards[0]))]
    return torch.cat(rows)


def merged_packed_grads(results, key, which):
    """Valid-token gradients, in (row, position) order, from every rank's packed THD shards."""
    values = []
    for dp_rank in range(DP):
        per_rank = [results[2 * dp_rank + c][key] for c in range(CP)]
        full_cus = per_rank[0][4]
        for m, cu_padded in enumerate(full_cus):
            merged = merge_packed_from_cp([r[which][m] for r in per_rank], cu_padded, CP)
            for i, start in enumerate(cu_padded[:-1].tolist()):
                row = dp_rank * len(LENGTHS) // DP + m * MICRO_BATCH_ROWS + i
                values.append(merged[start:start + LENGTHS[row]])
    return torch.cat(values)


@pytest.mark.distributed
def test_dp2_cp2_padded_and_packed_equal_one_process():
    results = run_distributed(_dp_cp_worker, DP * CP)
    valid = make_batch()["loss_mask"] != 0
    for loss_type, agg in CASES:
        ref_loss, ref_grad_lp, ref_grad_h, ref_metrics = reference(loss_type, agg)
        for layout in ("padded", "packed"):
            key = (layout, loss_type, agg)
            total = sum(r[key][0] for r in results)  # micro-batch losses add up over all ranks
            torch.testing.assert_close(total, ref_loss, rtol=1e-5, atol=1e-7, msg=f"{key} loss")
            if layout == "padded":
                grad_lp, grad_h = (merged_padded_grads(results, key, w) for w in (1, 2))
                assert torch.all(grad_lp[~valid] == 0) and torch.all(grad_h[~valid] == 0)
                expected_lp, expected_h = ref_grad_lp, ref_grad_h
            else:
                grad_lp, grad_h = (merged_packed_grads(results, key, w) for w in (1, 2))
                expected_lp, expected_h = ref_grad_lp[valid], ref_grad_h[valid]
            torch.testing.assert_close(grad_lp, expected_lp, rtol=1e-5, atol=1e-8, msg=f"{key} grad")
            torch.testing.assert_close(grad_h, expected_h, rtol=1e-5, atol=1e-8, msg=f"{key} entropy grad")
            for r in results:  # every rank reports the mini-batch metrics
                assert r[key][3].keys() == ref_metrics.keys()
                for name, value in ref_metrics.items():
                    torch.testing.assert_close(r[key][3][name], value, rtol=1e-5, atol=1e-7, msg=name)
