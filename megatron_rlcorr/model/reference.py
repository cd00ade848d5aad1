"""The plain-torch forward of the policy architecture: the oracle for every model test.

One process, full weights in the neutral naming (weights.py), float32, no Megatron-Core: an
implementation written from the architecture's definition (config.py), against which the
parallel GPTModel, the rollout engines and the Hugging Face mapping are checked.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .architecture import DecoderShape, rotary_inv_freq
from .config import ModelConfig


def reference_forward(weights: Mapping[str, torch.Tensor], cfg: ModelConfig | DecoderShape,
                      tokens_BT: torch.Tensor, *, routing: list[torch.Tensor] | None = None,
                      replay_BTLK: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits [B, T, vocab_size] of the architecture (architecture.py), in plain torch.

    Positions are 0..T-1 for every row (right padding). With tied embeddings the output layer
    is embed.weight (lm_head.weight is not read). Differentiable with respect to `weights`.
    The independent reference for the parallel model and for rollout engines.

    MoE: `routing`, when given a list, receives each MoE layer's chosen experts (int64 [B, T, k],
    in descending router-logit order); `replay_BTLK` ([B, T, MoE layers, k]) routes every token
    to those experts instead, weighted by the live router (routing replay).
    """
    shape = cfg.decoder_shape if isinstance(cfg, ModelConfig) else cfg
    w = {name: t.float() for name, t in weights.items()}
    batch, seq = tokens_BT.shape
    n_heads, n_groups, hd = shape.num_attention_heads, shape.num_query_groups, shape.head_dim
    cos_TD, sin_TD = _rotary_cos_sin(seq, shape, tokens_BT.device)
    causal_TT = torch.ones(seq, seq, dtype=torch.bool, device=tokens_BT.device).tril()
    x_BTH = w["embed.weight"][tokens_BT]
    eps = shape.norm_epsilon
    for i in range(shape.num_layers):
        p = f"layers.{i}."
        h_BTH = _rms_norm(x_BTH, w[p + "attn_norm.weight"], eps)
        q, k, v = (F.linear(h_BTH, w[p + n + ".weight"], w.get(p + n + ".bias")) for n in ("q", "k", "v"))
        q_BTND, k_BTGD = q.view(batch, seq, n_heads, hd), k.view(batch, seq, n_groups, hd)
        if shape.qk_layernorm:  # per head, before the rotation
            q_BTND = _rms_norm(q_BTND, w[p + "q_norm.weight"], eps)
            k_BTGD = _rms_norm(k_BTGD, w[p + "k_norm.weight"], eps)
        q_BNTD = _rotate(q_BTND.transpose(1, 2), cos_TD, sin_TD)
        k_BGTD = _rotate(k_BTGD.transpose(1, 2), cos_TD, sin_TD)
        v_BGTD = v.view(batch, seq, n_groups, hd).transpose(1, 2)
        k_BNTD = k_BGTD.repeat_interleave(n_heads // n_groups, dim=1)
        v_BNTD = v_BGTD.repeat_interleave(n_heads // n_groups, dim=1)
        scores = q_BNTD @ k_BNTD.transpose(-1, -2) / math.sqrt(hd)
        probs = scores.masked_fill(~causal_TT, float("-inf")).softmax(dim=-1)
        attn_BTH = (probs @ v_BNTD).transpose(1, 2).reshape(batch, seq, n_heads * hd)
        x_BTH = x_BTH + F.linear(attn_BTH, w[p + "o.weight"])
        h_BTH = _rms_norm(x_BTH, w[p + "mlp_norm.weight"], eps)
        if shape.is_moe_layer(i):
            replay = None if replay_BTLK is None else replay_BTLK[:, :, shape.moe_layers.index(i)]
            chosen_BTK, mlp_BTH = _moe_block(w, p, h_BTH, shape, replay)
            x_BTH = x_BTH + mlp_BTH
            if routing is not None:
                routing.append(chosen_BTK)
        else:
            x_BTH = x_BTH + _swiglu(w, p, h_BTH)
    x_BTH = _rms_norm(x_BTH, w["final_norm.weight"], eps)
    return F.linear(x_BTH, w["embed.weight" if shape.tie_embeddings else "lm_head.weight"])


def _swiglu(w: Mapping[str, torch.Tensor], p: str, h: torch.Tensor) -> torch.Tensor:
    """down(silu(gate h) * up h) of the MLP whose weights are named `p` + gate/up/down.weight."""
    return F.linear(F.silu(F.linear(h, w[p + "gate.weight"])) * F.linear(h, w[p + "up.weight"]), w[p + "down.weight"])


def _moe_block(w: Mapping[str, torch.Tensor], p: str, h_BTH: torch.Tensor, shape: DecoderShape,
               replay_BTK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen experts [B, T, k], output [B, T, H]) of a MoE block (architecture.py's rule). Every
    expert runs on every token and is weighted by zero where not chosen: slow, and plainly right."""
    moe = shape.moe
    logits_BTE = F.linear(h_BTH, w[p + "router.weight"])
    if replay_BTK is None:
        chosen_BTK = logits_BTE.topk(moe.router_topk, dim=-1).indices
    else:
        chosen_BTK = replay_BTK.long()
    if moe.pre_softmax:
        weights_BTK = logits_BTE.softmax(dim=-1).gather(-1, chosen_BTK)
    else:
        weights_BTK = logits_BTE.gather(-1, chosen_BTK).softmax(dim=-1)
    out_BTH = torch.zeros_like(h_BTH)
    for e in range(moe.num_experts):
        weight_BT1 = (weights_BTK * (chosen_BTK == e)).sum(dim=-1, keepdim=True)
        out_BTH = out_BTH + weight_BT1 * _swiglu(w, f"{p}experts.{e}.", h_BTH)
    if moe.shared_expert_ffn_hidden_size is not None:
        gate_BT1 = torch.sigmoid(F.linear(h_BTH, w[p + "shared_gate.weight"]))
        out_BTH = out_BTH + gate_BT1 * _swiglu(w, p + "shared.", h_BTH)
    return chosen_BTK, out_BTH


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rotary_cos_sin(seq: int, shape: DecoderShape, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rotary_inv_freq(shape, device)
    angles_TD = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv_freq).repeat(1, 2)
    return angles_TD.cos(), angles_TD.sin()


def _rotate(x: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half (non-interleaved) convention."""
    first, second = x.chunk(2, dim=-1)
    return x * cos_TD + torch.cat([-second, first], dim=-1) * sin_TD
