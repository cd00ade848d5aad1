"""The embedded rollout engine: a batched KV-cache sampler for Qwen2/LLaMA/Qwen-MoE-style decoders in pure torch.

It stands in for vLLM: a separate implementation of the trainer's architecture that receives the
trainer's weights after every step and runs them with its own numerics, so the trainer and the
rollout engine disagree on token probabilities the way they do in production.

Architecture: model.architecture.DecoderShape (GQA, optional q/k/v bias, optional per-head q/k
RMSNorm, LLaMA-3 rope scaling, mixture-of-experts layers). Weights come in the neutral naming of
model.weights (`neutral_weight_shapes`), lm_head.weight included (the embedding again for tied models).

Mixture of experts (`DecoderShape.moe`): a MoE layer routes by architecture.py's rule, as
model/reference.py does: router logits in the engine's dtype (bf16 in bf16 and fp8 mode, float32 in
fp32 mode: vLLM computes the gate in the model dtype), top-k by logit (descending, ties to the lower
index as torch.topk), weights = softmax (float32) over the top-k logits, or over all experts with
`pre_softmax`; the shared expert (Qwen2-MoE) adds sigmoid(shared_gate . x) times its SwiGLU. Each
expert runs only on the tokens routed to it (grouped by expert, outputs weighted and summed in
float32 with index_add, then cast to the engine's dtype).

Recorded routing: every generation fills RolloutBatch.routed_experts (per sample [len(response),
MoE layers, top-k], base.routed_experts_dtype: uint8 for <= 256 experts, else int16; experts in
descending router-logit order). Row j is the forward at input position len(prompt) - 1 + j: the
prefill's last prompt position for j = 0, then the decode step that consumed response token j - 1.
prompt_routed_experts holds the prefill's rows of positions 0..len(prompt) - 2 ([len(prompt) - 1,
MoE layers, top-k]). Only the top-k indices are kept, as small integers: (prompt + response - 1)
x MoE layers x k bytes a sample for uint8. Dense models: both None.

Precision modes:
- fp32: weights, activations and norms in float32.
- bf16: weights and activations in bfloat16; RMSNorm statistics in float32 then cast to bf16
  before the weight multiply; attention via SDPA on bf16 inputs; log-probs from the bf16 logits
  cast to float32 (with `fp32_lm_head`, model.fp32_lm_head, the output layer runs in float32 on
  the bf16 hidden states, as the trainer's then does).
- fp8: like bf16, but every decoder linear weight (q, k, v, o, gate, up, down; in MoE layers
  every routed expert's gate, up and down and the shared expert's) is per-tensor e4m3
  quantised-dequantised at load time (precision.fp8_e4m3_qdq), as an FP8 engine does with online
  weight quantisation. Embedding, norms, biases, lm_head, the MoE router and the shared-expert
  gate stay bf16 (vLLM does not quantise its MoE gates), and activations are not quantised
  (weight-only emulation).

Policy lag (`policy_lag` K, rollout.policy_lag): the asynchronous-RL mismatch, emulated. Every
`load_weights` delivers the trainer's newest weights (the trainer loads once before step 1 and
once after every step); the engine generates, scores and reports log-probs with the set it was
given K loads before the latest, i.e. the policy of K steps ago, clipped at the first load (the
first K steps sample with the initial weights). It keeps the K + 1 most recent sets, each
converted as above (precision emulation unchanged): K + 1 copies of the model in the engine's
dtype (2 bytes a parameter in bf16 and fp8, 4 in fp32). The history is not checkpointed: a resumed
run starts it again from its first load. K = 0 keeps one set and is the engine without lag.

Vocabulary: with `token_vocab_size` (ModelConfig.token_vocab_size, the tokenizer's size where the
checkpoint pads its vocabulary beyond it) the output layer keeps only that many rows, so the rows
beyond the tokenizer are never sampled and take no part in any log-softmax, as in the trainer
(whose logits there are PADDED_VOCAB_LOGIT, which add exactly 0 to its softmax sums).

Sequences are left-padded into one batch; positions start at 0 at each prompt's first token.
The batch in and out (padding, RolloutBatch, recorded routing) is embedded_batch.py's; drawing a
token from the logits (temperature, top-k, top-p, reported log-probs) is token_sampling.py's.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.architecture import DecoderShape, rotary_inv_freq
from ..model.weights import neutral_weight_shapes
from ..parallel.cpu import outside_cuda_redirect
from .base import LogprobsMode, Precision, RolloutBatch, routed_experts_dtype, weight_dtype
from .embedded_batch import attach_routing, left_pad, to_batch
from .precision import fp8_e4m3_qdq
from .token_sampling import sample_tokens

# Quantised in fp8 mode (by the name before ".weight"); a MoE layer's router and shared_gate are not.
_LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


def random_weights(shape: DecoderShape, *, generator: torch.Generator | None = None,
                   std: float = 0.02) -> dict[str, torch.Tensor]:
    """A random float32 state dict in the neutral naming: N(0, std) matrices and biases, unit norms."""
    weights = {}
    for name, dims in neutral_weight_shapes(shape).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(dims)
        else:
            weights[name] = torch.randn(dims, generator=generator) * std
    return weights


@dataclass
class _Moe:
    router: torch.Tensor                 # [E, H]
    gate_up_EFH: torch.Tensor            # [E, 2 Fe, H]: every expert's gate and up, stacked
    down_EHF: torch.Tensor               # [E, H, Fe]
    shared_gate_up: torch.Tensor | None  # [2 Fs, H] (Qwen2-MoE's shared expert)
    shared_down: torch.Tensor | None     # [H, Fs]
    shared_gate: torch.Tensor | None     # [1, H]


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [q_dim + 2 kv_dim, H]: q, k and v fused into one matmul
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim], with qk_layernorm
    k_norm: torch.Tensor | None
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor | None  # [2F, H]; None in a MoE layer
    down: torch.Tensor | None
    moe: _Moe | None = None


@dataclass
class _Weights:
    embed: torch.Tensor
    layers: list[_Layer]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


@dataclass
class _KVCache:
    k: list[torch.Tensor]  # per layer [B, groups, S_max, head_dim]
    v: list[torch.Tensor]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


class EmbeddedEngine:
    """Rollout engine running the decoder in-process with fp32, bf16 or emulated fp8 numerics."""

    def __init__(self, shape: DecoderShape, *, precision: Precision = "fp32",
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int = 0,
                 logprobs: LogprobsMode = "tempered", device: torch.device | str = "cpu",
                 policy_lag: int = 0, token_vocab_size: int | None = None, fp32_lm_head: bool = False) -> None:
        if precision not in ("fp32", "bf16", "fp8"):
            raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp8', got {precision!r}")
        if logprobs not in ("tempered", "processed"):
            raise ValueError(f"logprobs must be 'tempered' or 'processed', got {logprobs!r}")
        if isinstance(policy_lag, bool) or not isinstance(policy_lag, int) or policy_lag < 0:
            raise ValueError(f"policy_lag (rollout.policy_lag) must be an integer >= 0, got {policy_lag!r}")
        if token_vocab_size is not None and not 1 <= token_vocab_size <= shape.vocab_size:
            raise ValueError(f"token_vocab_size={token_vocab_size} must be in [1, vocab_size={shape.vocab_size}] "
                             "(model.token_vocab_size: the tokenizer's rows of the vocabulary)")
        self.shape = shape
        self.precision = precision
        self.sampled_vocab_size = token_vocab_size or shape.vocab_size  # rows that can get probability
        # Several ids may end a response (Qwen's <|im_end|> and <|endoftext|>).
        self.eos_ids = tuple([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or ())
        self.pad_token_id = pad_token_id
        self.logprobs_mode = logprobs
        self.device = torch.device(device)
        self.dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        self.fp32_lm_head = fp32_lm_head  # model.fp32_lm_head: the output layer in float32
        self._inv_freq = rotary_inv_freq(shape, self.device)
        self.weights: _Weights | None = None  # in the engine's precision, q/k/v and gate/up fused
        self.policy_lag = policy_lag
        self._history: deque[_Weights] = deque(maxlen=policy_lag + 1)  # oldest first; weights = [0]

    # ---- weights -------------------------------------------------------------------------------

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the weights should arrive in (base.weight_dtype)."""
        return weight_dtype(self.precision)

    def load_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace all weights from a mapping or a stream of (neutral name, full tensor) pairs
        (model/weight_stream.py), converting each tensor as it arrives. A tied model's
        lm_head.weight may be left out. The old weights stay until the new set is complete. With a
        policy lag K the set generation uses becomes the one loaded K loads ago (module docstring)."""
        expected = neutral_weight_shapes(self.shape)
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        w: dict[str, torch.Tensor] = {}
        for name, tensor in pairs:
            dims = expected.get(name)
            if dims is None:
                raise ValueError(f"load_weights: unexpected weight {name!r} (names as in "
                                 "model.weights.neutral_weight_shapes of the engine's DecoderShape)")
            if tuple(tensor.shape) != dims or not tensor.is_floating_point():
                raise ValueError(f"load_weights: {name} must be a float tensor of shape {dims}, got "
                                 f"{tensor.dtype} {tuple(tensor.shape)}")
            w[name] = self._convert(name, tensor)
        if self.shape.tie_embeddings and "lm_head.weight" not in w and "embed.weight" in w:
            w["lm_head.weight"] = w["embed.weight"]
        missing = [k for k in expected if k not in w]
        if missing:
            raise ValueError(f"load_weights: missing {missing[:5]}{'...' if len(missing) > 5 else ''} (names as in "
                             "model.weights.neutral_weight_shapes of the engine's DecoderShape)")
        layers = [self._fuse_layer(w, i) for i in range(self.shape.num_layers)]
        self._history.append(_Weights(embed=w["embed.weight"], layers=layers, final_norm=w["final_norm.weight"],
                                      lm_head=self._output_weight(self._sampled_rows(w["lm_head.weight"]))))
        self.weights = self._history[0]  # the latest for K = 0, else K loads old (or the first)

    @property
    def weights_age(self) -> int:
        """How many loads older than the latest the weights in use are (min(K, loads - 1))."""
        return max(len(self._history) - 1, 0)

    def _sampled_rows(self, lm_head: torch.Tensor) -> torch.Tensor:
        """The output layer's rows that can get probability (a view: a tied head shares the embedding)."""
        return lm_head[: self.sampled_vocab_size] if self.sampled_vocab_size < lm_head.shape[0] else lm_head

    def _output_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """fp32_lm_head: a float32 copy of the (engine-precision) output weight, converted once per load."""
        return weight.float().contiguous() if self.fp32_lm_head else weight

    def _convert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().to(self.device, torch.float32)
        is_decoder_linear = name.endswith(".weight") and name.split(".")[-2] in _LINEAR_NAMES
        if self.precision == "fp8" and is_decoder_linear:
            tensor = fp8_e4m3_qdq(tensor)
        return tensor.to(self.dtype).contiguous()

    def _fuse_layer(self, w: dict[str, torch.Tensor], index: int) -> _Layer:
        # pop: each part is freed as soon as its fused copy exists
        p = f"layers.{index}."
        parts = {name[len(p):]: w.pop(name) for name in [n for n in w if n.startswith(p)]}
        bias = torch.cat([parts["q.bias"], parts["k.bias"], parts["v.bias"]]) if self.shape.add_qkv_bias else None
        moe = self._fuse_moe(parts) if self.shape.is_moe_layer(index) else None
        return _Layer(attn_norm=parts["attn_norm.weight"],
                      qkv=torch.cat([parts["q.weight"], parts["k.weight"], parts["v.weight"]]), qkv_bias=bias,
                      q_norm=parts.get("q_norm.weight"), k_norm=parts.get("k_norm.weight"), o=parts["o.weight"],
                      mlp_norm=parts["mlp_norm.weight"],
                      gate_up=None if moe else torch.cat([parts["gate.weight"], parts["up.weight"]]),
                      down=None if moe else parts["down.weight"], moe=moe)

    def _fuse_moe(self, parts: dict[str, torch.Tensor]) -> _Moe:
        experts = range(self.shape.moe.num_experts)
        gate_up = torch.stack([torch.cat([parts.pop(f"experts.{e}.gate.weight"), parts.pop(f"experts.{e}.up.weight")])
                               for e in experts])
        down = torch.stack([parts.pop(f"experts.{e}.down.weight") for e in experts])
        if self.shape.moe.shared_expert_ffn_hidden_size is None:
            return _Moe(parts["router.weight"], gate_up, down, None, None, None)
        return _Moe(router=parts["router.weight"], gate_up_EFH=gate_up, down_EHF=down,
                    shared_gate_up=torch.cat([parts["shared.gate.weight"], parts["shared.up.weight"]]),
                    shared_down=parts["shared.down.weight"], shared_gate=parts["shared_gate.weight"])

    # ---- model ---------------------------------------------------------------------------------

    def _new_cache(self, batch: int, max_len: int) -> _KVCache:
        dims = (batch, self.shape.num_query_groups, max_len, self.shape.head_dim)
        layers = range(self.shape.num_layers)
        return _KVCache(k=[torch.zeros(dims, dtype=self.dtype, device=self.device) for _ in layers],
                        v=[torch.zeros(dims, dtype=self.dtype, device=self.device) for _ in layers])

    def _rope(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions_BT.unsqueeze(-1).float() * self._inv_freq  # [B, T, hd/2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [B, 1, T, hd]
        return angles.cos(), angles.sin()

    def _apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)

    def _attention(self, x_BTH: torch.Tensor, layer: _Layer, idx: int, rope: tuple[torch.Tensor, torch.Tensor],
                   mask_B1TS: torch.Tensor, cache: _KVCache, start: int) -> torch.Tensor:
        s = self.shape
        batch, seq, _ = x_BTH.shape
        q_dim, kv_dim = s.num_attention_heads * s.head_dim, s.num_query_groups * s.head_dim
        q, k, v = F.linear(x_BTH, layer.qkv, layer.qkv_bias).split([q_dim, kv_dim, kv_dim], dim=-1)
        q, k = q.view(batch, seq, -1, s.head_dim), k.view(batch, seq, -1, s.head_dim)
        if layer.q_norm is not None:  # per head, before the rotation (Qwen3)
            q, k = _rms_norm(q, layer.q_norm, s.norm_epsilon), _rms_norm(k, layer.k_norm, s.norm_epsilon)
        q = self._apply_rope(q.transpose(1, 2), *rope)
        k = self._apply_rope(k.transpose(1, 2), *rope)
        end = start + seq
        cache.k[idx][:, :, start:end] = k
        cache.v[idx][:, :, start:end] = v.view(batch, seq, -1, s.head_dim).transpose(1, 2)
        group = s.num_attention_heads // s.num_query_groups
        keys = cache.k[idx][:, :, :end].repeat_interleave(group, dim=1)
        values = cache.v[idx][:, :, :end].repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_B1TS)
        return F.linear(out.transpose(1, 2).reshape(batch, seq, q_dim), layer.o)

    def _moe(self, x_BTH: torch.Tensor, moe: _Moe, routing: list[torch.Tensor] | None) -> torch.Tensor:
        """A MoE block (module docstring); appends the chosen experts [B, T, k] to `routing`."""
        spec = self.shape.moe
        batch, seq, hidden = x_BTH.shape
        x_NH = x_BTH.reshape(-1, hidden)
        logits_NE = F.linear(x_NH, moe.router)  # the engine's dtype
        top = logits_NE.topk(spec.router_topk, dim=-1)  # descending
        chosen_NK = top.indices
        if spec.pre_softmax:
            weights_NK = logits_NE.float().softmax(dim=-1).gather(-1, chosen_NK)
        else:
            weights_NK = top.values.float().softmax(dim=-1)
        out_NH = self._routed_experts(x_NH, chosen_NK, weights_NK, moe).to(x_BTH.dtype)
        if moe.shared_gate_up is not None:
            gate_N1 = torch.sigmoid(F.linear(x_NH, moe.shared_gate))
            out_NH = out_NH + gate_N1 * _swiglu(x_NH, moe.shared_gate_up, moe.shared_down)
        if routing is not None:
            routing.append(chosen_NK.view(batch, seq, -1).to(routed_experts_dtype(spec.num_experts)))
        return out_NH.view(batch, seq, hidden)

    @staticmethod
    def _routed_experts(x_NH: torch.Tensor, chosen_NK: torch.Tensor, weights_NK: torch.Tensor,
                        moe: _Moe) -> torch.Tensor:
        """float32 [N, H]: sum over each token's experts of weight x expert(token), every expert run
        once on the tokens routed to it (one host sync for the group sizes)."""
        k = chosen_NK.shape[1]
        expert_P = chosen_NK.reshape(-1)  # P = N k (token, slot) pairs
        order_P = expert_P.argsort(stable=True)
        token_P, weight_P = order_P // k, weights_NK.reshape(-1)[order_P]
        counts = torch.bincount(expert_P, minlength=moe.gate_up_EFH.shape[0]).tolist()
        out_NH = torch.zeros(x_NH.shape, dtype=torch.float32, device=x_NH.device)
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = token_P[start:start + count]
                y = _swiglu(x_NH.index_select(0, rows), moe.gate_up_EFH[e], moe.down_EHF[e])
                out_NH.index_add_(0, rows, y.float() * weight_P[start:start + count, None])
            start += count
        return out_NH

    def _hidden(self, tokens_BT: torch.Tensor, positions_BT: torch.Tensor, mask_B1TS: torch.Tensor,
                cache: _KVCache, start: int, routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Final-norm hidden states of `tokens_BT`, written into the cache at [start, start + T); each
        MoE layer's chosen experts [B, T, k] are appended to `routing` when given."""
        weights, eps = self.weights, self.shape.norm_epsilon
        assert weights is not None
        rope = self._rope(positions_BT)
        x = F.embedding(tokens_BT, weights.embed)
        for idx, layer in enumerate(weights.layers):
            x = x + self._attention(_rms_norm(x, layer.attn_norm, eps), layer, idx, rope, mask_B1TS, cache, start)
            h = _rms_norm(x, layer.mlp_norm, eps)
            x = x + (self._moe(h, layer.moe, routing) if layer.moe is not None
                     else _swiglu(h, layer.gate_up, layer.down))
        return _rms_norm(x, weights.final_norm, eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fp32_lm_head:  # float32 logits from the engine-precision hidden states: no bf16 rounding
            return F.linear(hidden.float(), self.weights.lm_head)
        return F.linear(hidden, self.weights.lm_head).float()

    def _prefill(self, tokens_BL: torch.Tensor, pads_B: torch.Tensor, cache: _KVCache,
                 routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states of left-padded sequences. Padding keys are masked; a padding query sees only
        itself so that no row is fully masked (which would give NaN that leaks through the cache)."""
        width = tokens_BL.shape[1]
        cols = torch.arange(width, device=self.device)
        positions = (cols - pads_B[:, None]).clamp(min=0)
        key_valid = cols[None, :] >= pads_B[:, None]  # [B, L]
        causal = cols[:, None] >= cols[None, :]  # [L(query), L(key)]
        diag = torch.eye(width, dtype=torch.bool, device=self.device)
        mask = causal & (key_valid[:, None, :] | diag)  # [B, L, L]
        return self._hidden(tokens_BL, positions, mask.unsqueeze(1), cache, start=0, routing=routing)

    def _check_ready(self, prompts: list[list[int]]) -> None:
        if self.weights is None:
            raise RuntimeError("EmbeddedEngine: call load_weights() before generate() or score()")
        if not prompts:
            raise ValueError("need at least one prompt")
        empty = [i for i, p in enumerate(prompts) if len(p) == 0]
        if empty:
            raise ValueError(f"prompts {empty[:5]} are empty; every prompt needs at least one token (e.g. BOS)")

    # ---- public --------------------------------------------------------------------------------

    @torch.no_grad()
    @outside_cuda_redirect()  # on the CPU: skips the CPU patches' per-call torch function mode
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None) -> RolloutBatch:
        self._check_ready(prompts)
        if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1 or top_k < -1:
            raise ValueError(f"need max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1, top_k >= -1 (0 or -1: "
                             f"off); got {max_new_tokens}, {temperature}, {top_p}, {top_k}")
        tokens_BL, pads_B = left_pad(prompts, self.pad_token_id, self.device)
        batch, width = tokens_BL.shape
        cache = self._new_cache(batch, width + max_new_tokens)
        key_valid = torch.ones(batch, width + max_new_tokens, dtype=torch.bool, device=self.device)
        key_valid[:, :width] = torch.arange(width, device=self.device)[None, :] >= pads_B[:, None]
        record = self.shape.moe is not None
        prefill_routing: list[torch.Tensor] | None = [] if record else None
        logits_BV = self._logits(self._prefill(tokens_BL, pads_B, cache, prefill_routing)[:, -1])
        decode_routing: list[torch.Tensor] = []  # per decode step [B, L, k]

        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        sampled, logprobs = [], []
        for step in range(max_new_tokens):
            token_B, logprob_B = sample_tokens(logits_BV, temperature, top_p, top_k, generator, self.logprobs_mode)
            lengths += ~finished
            sampled.append(token_B.masked_fill(finished, self.pad_token_id))
            logprobs.append(logprob_B)
            for eos_id in self.eos_ids:
                finished |= token_B == eos_id
            # One host sync per token: stop as soon as every sequence has ended.
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            cur = width + step
            positions = (width - pads_B + step)[:, None]
            mask = key_valid[:, None, None, : cur + 1]
            step_routing: list[torch.Tensor] | None = [] if record else None
            hidden = self._hidden(token_B[:, None], positions, mask, cache, start=cur, routing=step_routing)
            if record:
                decode_routing.append(torch.stack(step_routing, dim=2)[:, 0])
            logits_BV = self._logits(hidden[:, -1])
        batch_out = to_batch(prompts, torch.stack(sampled, 1), torch.stack(logprobs, 1), lengths, finished)
        if record:
            attach_routing(batch_out, torch.stack(prefill_routing, dim=2), decode_routing, pads_B)
        return batch_out

    def sample_groups(self, prompts: Sequence[Sequence[int]], *, n: int, seeds: Sequence[int], max_new_tokens: int,
                      temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> RolloutBatch:
        """`n` samples of each prompt (base.RolloutEngine.sample_groups). Each prompt's n rows are
        generated as one batch of their own, with a generator seeded by its seed: batching
        prompts together would let the others' padding and batch size change its float rounding,
        and so its tokens."""
        if len(seeds) != len(prompts):
            raise ValueError(f"sample_groups: {len(prompts)} prompts but {len(seeds)} seeds (one per prompt)")
        parts = [self.generate([list(prompt)] * n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                               top_k=top_k, generator=torch.Generator(self.device).manual_seed(seed))
                 for prompt, seed in zip(prompts, seeds)]
        record = self.shape.moe is not None
        return RolloutBatch(prompt_ids=[p for part in parts for p in part.prompt_ids],
                            response_ids=[r for part in parts for r in part.response_ids],
                            logprobs=[x for part in parts for x in part.logprobs],
                            finish_reasons=[f for part in parts for f in part.finish_reasons],
                            routed_experts=[x for part in parts for x in part.routed_experts] if record else None,
                            prompt_routed_experts=([x for part in parts for x in part.prompt_routed_experts]
                                                   if record else None))

    def sleep(self) -> None:
        """Nothing to give back: the engine holds only its weights, which it needs."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Nothing was given back (see sleep)."""

    @torch.no_grad()
    @outside_cuda_redirect()
    def score(self, prompts: list[list[int]], responses: list[list[int]], *,
              temperature: float = 1.0) -> list[torch.Tensor]:
        """Teacher-forced float32 log-probs (CPU) of each response token: log_softmax(logits / T) over the
        tokenizer's rows, with T = 0 read as 1, in the engine's precision; no sampling, no top-p."""
        self._check_ready(prompts)
        if len(prompts) != len(responses):
            raise ValueError(f"score: {len(prompts)} prompts but {len(responses)} responses")
        beyond = [(i, t) for i, r in enumerate(responses) for t in r if not 0 <= t < self.sampled_vocab_size]
        if beyond:
            raise ValueError(f"score: response {beyond[0][0]} holds token {beyond[0][1]}, outside the "
                             f"{self.sampled_vocab_size} rows that can get probability (the tokenizer's; "
                             "model.token_vocab_size)")
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        tokens_BL, pads_B = left_pad(seqs, self.pad_token_id, self.device)
        width = tokens_BL.shape[1]
        hidden = self._prefill(tokens_BL, pads_B, self._new_cache(len(seqs), width))
        scale = temperature if temperature > 0 else 1.0
        logp = torch.log_softmax(self._logits(hidden[:, :-1]) / scale, dim=-1)
        logp_BT = logp.gather(-1, tokens_BL[:, 1:, None]).squeeze(-1).cpu()
        return [logp_BT[i, width - 1 - len(r): width - 1].clone() for i, r in enumerate(responses)]
