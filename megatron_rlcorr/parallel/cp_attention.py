"""Causal core attention with context parallelism and packed sequences, without Transformer Engine.

Megatron-Core's own DotProductAttention refuses context parallelism ("only supported by
TEDotProductAttention") and packed sequences, and Transformer Engine needs CUDA. This module
takes its place in the local (non-TE) layer spec, at any CP size, so CP and packed (THD)
micro-batches run on the CPU (gloo) with the same layout as on GPUs: every CP rank holds Megatron's zigzag shard of each sequence (the sequence cut
into 2*cp chunks; rank r holds chunks r and 2*cp-1-r, see `parallel/context.py`).

Each rank all-gathers K and V over the CP group (backward: reduce-scatter of their gradients),
computes its queries against the whole sequence, and masks causally on GLOBAL token positions,
so no rank needs the tokens in order. Rotary embeddings are already applied by then: GPTModel
slices the rotary table with `get_pos_emb_on_this_cp_rank` (padded) or per sequence in
`_apply_rotary_pos_emb_thd` (packed), which select the same zigzag chunks.

Layouts: padded `[s, b, heads, head_dim]` (sbhd; causal mask only, no attention_mask), and packed
THD `[t, heads, head_dim]` with `PackedSeqParams(qkv_format="thd")`, each sequence padded to a
multiple of 2*cp (`cu_seqlens_q_padded`); tokens attend within their own sequence, one block per
sequence. GQA: K/V groups are shared by heads // groups query heads. Memory is
O(local_tokens * total_tokens) per head (padded) or per sequence (packed): meant for CPU
development and tests, not for long sequences.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .context import packed_cp_indices, zigzag_token_positions


class ContextParallelAttention(MegatronModule):
    """Drop-in `core_attention` for `SelfAttentionSubmodules` (same constructor as DotProductAttention)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"ContextParallelAttention supports causal self-attention only, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"ContextParallelAttention has no attention dropout; set attention_dropout=0 "
                             f"(got {dropout})")
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            raise ValueError("ContextParallelAttention needs pg_collection with a cp group (build the model with "
                             "pg_collection=groups.pg_collection)")
        self.cp_group = pg_collection.cp
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """sbhd: q [s, b, nh, d], k/v [s, b, ng, d] -> [s, b, nh*d]; thd: [t, ., d] -> [t, nh*d]."""
        if attention_bias is not None:
            raise ValueError("ContextParallelAttention does not take an attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_packed(query, key, value, packed_seq_params)
        if attention_mask is not None:
            raise ValueError("ContextParallelAttention applies the causal mask itself; pass attention_mask=None "
                             "(right padding needs no mask under causal attention)")
        return self._forward_padded(query, key, value)

    def _forward_padded(self, q_sbhd, k_sbgd, v_sbgd):
        cp_size, cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        seq_len = q_sbhd.shape[0] * cp_size
        k_all, v_all = _all_gather_seq(k_sbgd, self.cp_group), _all_gather_seq(v_sbgd, self.cp_group)
        q_pos = zigzag_token_positions(seq_len, cp_size, cp_rank, q_sbhd.device)
        k_pos = torch.cat([zigzag_token_positions(seq_len, cp_size, r, q_sbhd.device) for r in range(cp_size)])
        allowed_qk = k_pos[None, :] <= q_pos[:, None]
        # [s, b, h, d] -> [b, h, s, d]
        out_bhsd = self._attend(q_sbhd.permute(1, 2, 0, 3), k_all.permute(1, 2, 0, 3), v_all.permute(1, 2, 0, 3),
                                allowed_qk)
        s, b, h, d = q_sbhd.shape
        return out_bhsd.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def _forward_packed(self, q_thd, k_tgd, v_tgd, params: PackedSeqParams):
        cp_size, cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        cu_padded = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_padded = cu_padded.to(q_thd.device, torch.int64)
        num_local = q_thd.shape[0]
        k_all, v_all = _all_gather_seq(k_tgd, self.cp_group), _all_gather_seq(v_tgd, self.cp_group)
        # Global positions in the packed batch of every rank's tokens (the zigzag rule per sequence).
        positions = [packed_cp_indices(cu_padded, num_local * cp_size, cp_size, r) for r in range(cp_size)]
        local_cu = (cu_padded // cp_size).tolist()  # this host sync sizes the per-sequence blocks
        out = q_thd.new_empty(q_thd.shape[0], q_thd.shape[1] * q_thd.shape[2])
        # One block per sequence: cost sum(L_i^2), not (sum L_i)^2.
        for start, end in zip(local_cu, local_cu[1:]):
            if end == start:
                continue
            keys = [r * num_local + torch.arange(start, end, device=q_thd.device) for r in range(cp_size)]
            k_index = torch.cat(keys)
            k_pos = torch.cat([positions[r][start:end] for r in range(cp_size)])
            allowed_qk = k_pos[None, :] <= positions[cp_rank][start:end, None]
            # [t, h, d] -> [1, h, t, d]
            out_bhtd = self._attend(q_thd[start:end].transpose(0, 1)[None], k_all[k_index].transpose(0, 1)[None],
                                    v_all[k_index].transpose(0, 1)[None], allowed_qk)
            out[start:end] = out_bhtd[0].transpose(0, 1).reshape(end - start, -1)
        return out

    def _attend(self, q_bhqd, k_bgkd, v_bgkd, allowed_qk):
        """softmax(q k^T * scale, masked) v with float32 softmax; K/V groups shared by heads."""
        group_size = q_bhqd.shape[1] // k_bgkd.shape[1]
        k_bhkd = k_bgkd.repeat_interleave(group_size, dim=1)
        v_bhkd = v_bgkd.repeat_interleave(group_size, dim=1)
        scores = torch.matmul(q_bhqd, k_bhkd.transpose(-1, -2)).float() * self.softmax_scale
        scores = scores.masked_fill(~allowed_qk, float("-inf"))
        probs = F.softmax(scores, dim=-1).to(v_bhkd.dtype)
        return torch.matmul(probs, v_bhkd)


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every CP rank's `x` along dim 0 (rank order)."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllGatherSeq.apply(x, group)


class _AllGatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad_full):
        # Every rank's queries used every rank's keys: the gradient of this rank's shard is the
        # sum over ranks of their gradient for it.
        parts = [p.contiguous() for p in grad_full.chunk(dist.get_world_size(ctx.group), dim=0)]
        grad_local = torch.empty_like(parts[0])
        dist.reduce_scatter(grad_local, parts, group=ctx.group)
        return grad_local, None
