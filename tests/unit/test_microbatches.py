"""Micro-batch plans (training/microbatches.py): packing into a token budget, the alignment rules
(zigzag CP, sequence parallelism, FP8), and the split / merge of per-token tensors."""
import pytest
import torch

from megatron_rlcorr.training.microbatches import (PackingRules, fewest_bins, pack_bins, pack_exactly, plan_packed,
                                                   plan_padded, round_up, sequence_lengths, sequence_multiple)


def _transformer_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    return TransformerConfig(**{**base, **kw})


# ---- alignment -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, expected", [
    (dict(), 1),
    (dict(context_parallel_size=2), 4),
    (dict(fp8="e4m3", bf16=True), 16),                            # FP8 GEMMs: 16 tokens per rank
    (dict(fp8="hybrid", fp8_recipe="tensorwise", bf16=True), 16),
    (dict(fp8="e4m3", fp8_recipe="mxfp8", bf16=True), 32),        # MXFP8's 32-element blocks
    (dict(fp8="e4m3", bf16=True, context_parallel_size=2), 32),   # 16 per CP rank
    (dict(tensor_model_parallel_size=2, sequence_parallel=True), 2),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2, fp8="e4m3",
          bf16=True), 64),                                         # 16 per rank of cp x tp
    (dict(tensor_model_parallel_size=4), 1),                       # TP alone does not split tokens
])
def test_sequence_multiple_from_the_model_config(kw, expected):
    assert sequence_multiple(_transformer_config(**kw)) == expected


def test_sequence_lengths_end_at_the_last_masked_in_position():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]])
    assert sequence_lengths(mask).tolist() == [3, 1, 5]  # an empty row still takes one token


# ---- packing -------------------------------------------------------------------------------------

def test_pack_bins_fits_the_budget_longest_first():
    lengths = [7, 3, 5, 2, 6, 1]
    bins = pack_bins(lengths, capacity=10, num_bins=3)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert all(b == sorted(b) for b in bins)
    assert pack_bins(lengths, capacity=7, num_bins=3) is None  # 24 tokens cannot fit 3 x 7
    assert pack_bins(lengths, capacity=10, num_bins=7) is None  # more bins than sequences


def test_fewest_bins_and_exact_counts():
    lengths = [9, 9, 9, 1, 1, 1]
    assert fewest_bins(lengths, 10) == 3
    for count in range(3, 7):
        bins = pack_exactly(lengths, 10, count)
        assert len(bins) == count and all(bins)
        assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
        assert sorted(i for b in bins for i in b) == list(range(6))


def test_pack_exactly_splits_bins_when_the_greedy_packing_misses(monkeypatch):
    """No case is known where the greedy packing fits k bins but not more; should one exist, the
    fewest bins are split instead (simulated here by refusing the requested count)."""
    from megatron_rlcorr.training import microbatches

    lengths = [6, 5, 4, 4, 3, 3, 3]
    greedy = microbatches.pack_bins
    monkeypatch.setattr(microbatches, "pack_bins", lambda ls, cap, n: None if n == 5 else greedy(ls, cap, n))
    bins = pack_exactly(lengths, 12, 5)
    assert len(bins) == 5 and all(bins)
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))


def test_long_tailed_lengths_pack_tightly():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.distributions.LogNormal(6.0, 0.8).sample((256,)).clamp(8, 4096).long().tolist()
    del gen
    capacity = 8192
    lower_bound = -(-sum(lengths) // capacity)
    assert fewest_bins(lengths, capacity) <= lower_bound + 1


# ---- plans -----------------------------------------------------------------------------------------

def _batch(lengths, width):
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        mask[i, max(0, n - 3):n] = 1
    values = torch.arange(len(lengths) * width, dtype=torch.float32).view(len(lengths), width) + 1
    return mask, values


def test_padded_plan_cuts_rows_and_merges_back():
    mask, values = _batch([5, 7, 2, 6], width=7)
    plan = plan_padded(sequence_lengths(mask), 7, micro_batch_size=2, multiple=4, cp_size=1, cp_rank=0,
                       cp_group=None, device=torch.device("cpu"))
    parts = plan.split(values)
    assert plan.num_microbatches == 2 and [p.shape for p in parts] == [(2, 8), (2, 8)]
    assert torch.equal(parts[1][0, :7], values[2]) and float(parts[1][0, 7]) == 0.0  # padded to 8
    assert torch.equal(plan.merge(parts, 7), values)
    assert plan.computed_tokens == 4 * 8 and int(plan.real_tokens) == 5 + 7 + 2 + 6


def test_padded_plan_rejects_a_micro_batch_size_that_does_not_divide():
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        plan_padded(torch.ones(4, dtype=torch.int64), 5, micro_batch_size=3, multiple=1, cp_size=1, cp_rank=0,
                    cp_group=None, device=torch.device("cpu"))


def test_packed_plan_packs_trims_and_merges_back():
    lengths = [5, 7, 2, 6, 1, 3]
    mask, values = _batch(lengths, width=7)
    rules = PackingRules(max_tokens=10, multiple=1)
    plan = plan_packed(sequence_lengths(mask), 7, rules, cp_size=1, cp_rank=0, cp_group=None, dp_group=None,
                       device=torch.device("cpu"))
    parts = plan.split(values)
    assert plan.is_packed and plan.num_microbatches == 3
    assert all(p.dim() == 1 and p.numel() <= 10 for p in parts)
    # Every sequence's tokens through its length, no padding: 24 tokens computed for 24 needed.
    assert plan.computed_tokens == sum(lengths) == int(plan.real_tokens)
    merged = plan.merge(parts, 7)
    keep = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    assert torch.equal(merged[keep], values[keep]) and float(merged[~keep].abs().sum()) == 0
    for mb, part in zip(plan.micro_batches, parts):
        params = mb.packed_seq_params
        assert params.qkv_format == "thd"
        assert int(params.cu_seqlens_q_padded[-1]) == part.numel() == int(params.cu_seqlens_q[-1])
        assert torch.equal(mb.cu_seqlens_local, params.cu_seqlens_q_padded)
        # positions restart at 0 in every sequence
        spans = params.cu_seqlens_q_padded.tolist()
        for start, end in zip(spans, spans[1:]):
            assert mb.positions[start:end].tolist() == list(range(end - start))


def test_packed_plan_under_cp_gives_each_rank_its_zigzag_share():
    from megatron_rlcorr.parallel.context import split_packed_for_cp

    lengths = [5, 7, 2, 6]
    mask, values = _batch(lengths, width=7)
    rules = PackingRules(max_tokens=8, multiple=4)
    seen = torch.zeros(4 * 8 + 1)
    for rank in range(2):
        plan = plan_packed(sequence_lengths(mask), 7, rules, cp_size=2, cp_rank=rank, cp_group=None, dp_group=None,
                           device=torch.device("cpu"))
        for mb, part in zip(plan.micro_batches, plan.split(values)):
            params = mb.packed_seq_params
            # each sequence's cells through its padded length (past its length: the batch's padding)
            padded_values = torch.nn.functional.pad(values, (0, plan.width - 7))
            whole = torch.cat([padded_values[i, :round_up(n, 4)] for i, n in zip(_rows(plan, mb), _lens(params))])
            assert torch.equal(part, split_packed_for_cp(whole, params.cu_seqlens_q_padded, 2, rank)[0])
            assert torch.equal(mb.cu_seqlens_local, params.cu_seqlens_q_padded // 2)
            seen.index_add_(0, mb.index, torch.ones(mb.index.numel()))
    # every cell of every padded sequence is read by exactly one CP rank
    assert plan.computed_tokens == sum(round_up(n, 4) for n in lengths)
    assert float(seen[:-1].max()) == 1.0


def _lens(params):
    cu = params.cu_seqlens_q.tolist()
    return [b - a for a, b in zip(cu, cu[1:])]


def _rows(plan, mb):
    """The rows a micro-batch's sequences come from (their first cell's row)."""
    spans = mb.packed_seq_params.cu_seqlens_q_padded.tolist()
    rows, position = [], 0
    for start, end in zip(spans, spans[1:]):
        rows.append(int(mb.index[position]) // plan.width)
        position += (end - start) // 2
    return rows


def test_packed_plan_with_pipelining_pads_every_micro_batch_to_one_size():
    lengths = [5, 7, 2, 6, 1, 3]
    mask, values = _batch(lengths, width=7)
    rules = PackingRules(max_tokens=10, multiple=1, equal_sizes=True, bins_multiple=2)
    plan = plan_packed(sequence_lengths(mask), 7, rules, cp_size=1, cp_rank=0, cp_group=None, dp_group=None,
                       device=torch.device("cpu"))
    parts = plan.split(values)
    assert plan.num_microbatches % 2 == 0
    assert len({p.numel() for p in parts}) == 1 and plan.seq_length == parts[0].numel()
    assert plan.computed_tokens == plan.num_microbatches * plan.seq_length
    # the grown padding reads the padding cell: zeros, and nothing is written back
    merged = plan.merge(parts, 7)
    keep = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    assert torch.equal(merged[keep], values[keep])


def test_packed_plan_names_the_budget_when_a_sequence_does_not_fit():
    mask, _ = _batch([5, 30], width=30)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=12 is too small.*at least 16"):
        plan_packed(sequence_lengths(mask), 30, PackingRules(max_tokens=12, multiple=4), cp_size=2, cp_rank=0,
                    cp_group=None, dp_group=None, device=torch.device("cpu"))


def test_split_rejects_a_tensor_of_another_batch():
    mask, values = _batch([5, 7], width=7)
    plan = plan_padded(sequence_lengths(mask), 7, micro_batch_size=1, multiple=1, cp_size=1, cp_rank=0,
                       cp_group=None, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit the mini-batch"):
        plan.split(values[:1])
