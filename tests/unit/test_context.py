import inspect

import pytest
import torch

from megatron_rlcorr.parallel.context import (
    cp_pad_multiple,
    merge_from_cp,
    merge_packed_from_cp,
    pack_sequences,
    packed_cp_indices,
    packed_valid_mask,
    pad_to_multiple,
    split_for_cp,
    split_packed_for_cp,
    zigzag_token_positions,
)
from tests.gpu.te import require_transformer_engine


def zigzag_positions_by_hand(seq_len, cp_size, cp_rank):
    chunk = seq_len // (2 * cp_size)
    first = list(range(cp_rank * chunk, (cp_rank + 1) * chunk))
    last_chunk = 2 * cp_size - 1 - cp_rank
    return first + list(range(last_chunk * chunk, (last_chunk + 1) * chunk))


# ---- padded ----

@pytest.mark.parametrize("cp_size", [2, 4])
def test_zigzag_positions(cp_size):
    for rank in range(cp_size):
        expected = zigzag_positions_by_hand(8 * cp_size, cp_size, rank)
        assert zigzag_token_positions(8 * cp_size, cp_size, rank).tolist() == expected
    # cp=2, s=8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_token_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_token_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_padded_split_merge_round_trip(cp_size, dtype):
    gen = torch.Generator().manual_seed(cp_size)
    full = (10 * torch.randn(3, 8 * cp_size, 2, generator=gen)).to(dtype)
    shards = [split_for_cp(full, cp_size, r, seq_dim=1) for r in range(cp_size)]
    for rank, shard in enumerate(shards):
        assert shard.dtype == dtype and shard.shape == (3, 8, 2)
        assert torch.equal(shard, full[:, zigzag_positions_by_hand(8 * cp_size, cp_size, rank)])
    assert torch.equal(merge_from_cp(shards, cp_size, seq_dim=1), full)


def test_padded_split_on_other_dims():
    full_sb = torch.arange(2 * 16).reshape(16, 2)  # [s, b]
    shards = [split_for_cp(full_sb, 4, r, seq_dim=0) for r in range(4)]
    assert shards[1][:, 0].tolist() == [2 * p for p in zigzag_positions_by_hand(16, 4, 1)]
    assert torch.equal(merge_from_cp(shards, 4, seq_dim=0), full_sb)


def test_pad_to_multiple_then_split_odd_length():
    tokens = torch.arange(1, 12).reshape(1, 11)
    padded = pad_to_multiple(tokens, 8, seq_dim=1, value=-1)
    assert padded.shape == (1, 16) and padded[0, 11:].tolist() == [-1] * 5
    assert pad_to_multiple(padded, 8) is padded
    shards = [split_for_cp(padded, 4, r) for r in range(4)]
    assert torch.equal(merge_from_cp(shards, 4), padded)
    with pytest.raises(ValueError, match="pad_to_multiple"):
        split_for_cp(tokens, 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        split_for_cp(padded, 2, 2)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, while importing megatron
@pytest.mark.parametrize("cp_size", [2, 4])
def test_padded_split_equals_megatron_get_batch_on_this_cp_rank(cp_size, monkeypatch):
    from megatron.core import parallel_state, utils

    gen = torch.Generator().manual_seed(3)
    seq_len = 4 * cp_size * 3
    batch = {
        "tokens": torch.randint(0, 100, (2, seq_len), generator=gen),
        "labels": torch.randint(0, 100, (2, seq_len), generator=gen),
        "loss_mask": torch.rand(2, seq_len, generator=gen) > 0.3,
        "rollout_log_probs": -torch.rand(2, seq_len, generator=gen),
        "attention_mask": torch.rand(2, 1, seq_len, seq_len, generator=gen) > 0.5,
    }
    # megatron-core 0.16 reads the CP size and rank from parallel_state; 0.19 takes is_hybrid_cp
    # and a cp_group (default WORLD) whose size and rank it asks torch.distributed for.
    takes_group = "is_hybrid_cp" in inspect.signature(utils.get_batch_on_this_cp_rank).parameters
    cp_group = object()  # stands for the CP group: no process group exists here
    for rank in range(cp_size):
        if takes_group:
            monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: _of(group, cp_group, cp_size))
            monkeypatch.setattr(torch.distributed, "get_rank", lambda group: _of(group, cp_group, rank))
            theirs = utils.get_batch_on_this_cp_rank({k: v.clone() for k, v in batch.items()}, is_hybrid_cp=False,
                                                     cp_group=cp_group)
        else:
            monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp_size)
            monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: rank)
            theirs = utils.get_batch_on_this_cp_rank({k: v.clone() for k, v in batch.items()})
        for key, value in batch.items():
            seq_dim = 2 if key == "attention_mask" else 1
            assert torch.equal(split_for_cp(value, cp_size, rank, seq_dim=seq_dim), theirs[key]), key


def _of(group, cp_group, value):
    assert group is cp_group, "Megatron-Core asked about a group other than the CP group it was given"
    return value


# ---- packed (THD) ----

def thd_indices_by_hand(padded_lengths, cp_size, cp_rank):
    """Global packed positions of a rank's tokens: its two zigzag chunks of each sequence, in order."""
    out, start = [], 0
    for length in padded_lengths:
        out += [start + p for p in zigzag_positions_by_hand(length, cp_size, cp_rank)]
        start += length
    return out


def test_cp_pad_multiple():
    assert cp_pad_multiple(1) == 1
    assert cp_pad_multiple(2) == 4
    assert cp_pad_multiple(4) == 8
    assert cp_pad_multiple(1, token_alignment=16) == 16
    assert cp_pad_multiple(2, token_alignment=16) == 32   # each rank's share (L/2) a multiple of 16
    assert cp_pad_multiple(2, token_alignment=32) == 64   # MXFP8
    assert cp_pad_multiple(2, tp_size=4, sequence_parallel=True) == 8
    assert cp_pad_multiple(2, tp_size=3, sequence_parallel=True, token_alignment=16) == 96
    assert cp_pad_multiple(4, tp_size=2) == 8          # no sequence parallelism: TP does not split tokens


def test_pack_sequences_pads_each_sequence():
    seqs = [torch.arange(1, 6), torch.arange(10, 13), torch.arange(20, 28)]  # lengths 5, 3, 8
    packed = pack_sequences(seqs, 4, pad_value=-1)
    assert packed.cu_seqlens.tolist() == [0, 5, 8, 16]
    assert packed.cu_seqlens_padded.tolist() == [0, 8, 12, 20]
    assert packed.cu_seqlens.dtype == packed.cu_seqlens_padded.dtype == torch.int32
    assert packed.values.tolist() == [1, 2, 3, 4, 5, -1, -1, -1, 10, 11, 12, -1, *range(20, 28)]
    valid = packed_valid_mask(packed.cu_seqlens_padded, packed.cu_seqlens)
    assert torch.equal(valid, packed.values != -1)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_packed_split_merge_round_trip_odd_lengths(cp_size):
    gen = torch.Generator().manual_seed(cp_size)
    lengths = [7, 1, 13, 2 * cp_size, 5]
    multiple = cp_pad_multiple(cp_size)
    seqs = [torch.randn(n, 3, generator=gen) for n in lengths]  # trailing dims travel along
    packed = pack_sequences(seqs, multiple)
    padded_lengths = (packed.cu_seqlens_padded[1:] - packed.cu_seqlens_padded[:-1]).tolist()
    assert all(n % (2 * cp_size) == 0 for n in padded_lengths)

    shards = []
    for rank in range(cp_size):
        local, local_cu = split_packed_for_cp(packed.values, packed.cu_seqlens_padded, cp_size, rank)
        assert torch.equal(local, packed.values[thd_indices_by_hand(padded_lengths, cp_size, rank)])
        assert local_cu.tolist() == [c // cp_size for c in packed.cu_seqlens_padded.tolist()]
        shards.append(local)
    assert torch.equal(merge_packed_from_cp(shards, packed.cu_seqlens_padded, cp_size), packed.values)

    # Every field of the batch is split alike: the mask marks the same tokens after the split.
    mask = pack_sequences([torch.ones(n, dtype=torch.bool) for n in lengths], multiple).values
    local_mask, _ = split_packed_for_cp(mask, packed.cu_seqlens_padded, cp_size, 1)
    local_valid, _ = split_packed_for_cp(packed_valid_mask(packed.cu_seqlens_padded, packed.cu_seqlens),
                                         packed.cu_seqlens_padded, cp_size, 1)
    assert torch.equal(local_mask, local_valid)


def test_packed_split_of_one_sequence_equals_padded_split():
    values = torch.arange(24)
    cu = torch.tensor([0, 24], dtype=torch.int32)
    for rank in range(3):
        local, _ = split_packed_for_cp(values, cu, 3, rank)
        assert torch.equal(local, split_for_cp(values, 3, rank, seq_dim=0))


def test_packed_split_along_dim_1_for_megatron_thd_batches():
    packed = pack_sequences([torch.arange(3), torch.arange(5)], 4)
    tokens_1n = packed.values.unsqueeze(0)  # Megatron's THD micro-batches are [1, N]
    local, _ = split_packed_for_cp(tokens_1n, packed.cu_seqlens_padded, 2, 0, seq_dim=1)
    assert local.shape == (1, 6)
    assert local[0].tolist() == packed.values[thd_indices_by_hand([4, 8], 2, 0)].tolist()


def test_packed_split_rejects_misaligned_sequences():
    values = torch.arange(12)
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size=4"):
        split_packed_for_cp(values, torch.tensor([0, 6, 12], dtype=torch.int32), 2, 0)
    with pytest.raises(ValueError, match="packed length 12"):
        split_packed_for_cp(values, torch.tensor([0, 4, 8], dtype=torch.int32), 2, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("cp_size", [2, 4])
def test_packed_indices_equal_transformer_engine(cp_size):
    require_transformer_engine()  # on a CUDA machine a missing Transformer Engine fails, naming the fix
    import transformer_engine_torch as tex
    lengths = [7, 1, 13, 2 * cp_size, 5]
    packed = pack_sequences([torch.zeros(n) for n in lengths], cp_pad_multiple(cp_size))
    cu = packed.cu_seqlens_padded.cuda()
    total = int(cu[-1])
    for rank in range(cp_size):
        theirs = tex.thd_get_partitioned_indices(cu, total, cp_size, rank)
        assert packed_cp_indices(cu, total, cp_size, rank).tolist() == theirs.tolist()
