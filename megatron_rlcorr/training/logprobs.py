"""Log-probabilities of target tokens (and entropy) from vocab-parallel logits, in token chunks.

Under tensor parallelism the output layer leaves each TP rank with a contiguous slice
`[rank * V_p, (rank + 1) * V_p)` of the vocabulary. The log-softmax over the full vocabulary
needs only three per-token scalars from the other ranks: the max logit, the sum of
exponentials and the target logit (plus sum p*z for the entropy). They travel in two small
all-reduces (MAX, then one packed SUM); the gradient with respect to the local logits is local
(onehot - softmax), so backward communicates nothing.

Temperature: the rollout engine (vLLM) reports log-probs of the tempered distribution
softmax(z / T), so the trainer's log-probs are computed from logits / T as well.

Memory: the logits are never copied whole. The max comes from the logits in their own dtype
(x -> x / T is monotonic, so the max of the tempered float32 logits is the tempered max); every
other step runs over chunks of `chunk_tokens` tokens, each upcast to float32 on its own. Forward
keeps per token only the max, the log-sum-exp and the entropy ([tokens] float32); backward
recomputes each chunk's softmax from the logits (kept by reference, not copied) and writes the
chunk's gradient into the returned gradient, which has the logits' shape and dtype. Extra memory
beside the logits and that gradient: two float32 chunks (one without entropy) plus O(tokens);
with the default 1/16 of the tokens per chunk, 1/8 of one float32 copy of the local logits (the
unchunked version held two). A non-contiguous input is first copied whole (in its own dtype).
Logits must be finite (Megatron's are).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_CHUNKS = 16  # the tokens are cut into this many chunks unless chunk_tokens says otherwise


def token_logprobs_and_entropy(
    logits_vp: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log pi(target | .) and, optionally, the entropy of the tempered distribution.

    logits_vp: [..., V_p] this TP rank's vocabulary slice, any float dtype and leading shape
        ([b, s, V_p], [s, b, V_p] or packed [t, V_p]); never modified.
    target_ids: [...] integer ids in the full vocabulary. An id outside the vocabulary (e.g. a
        -100 ignore index at a padding position) gives a finite, meaningless log-prob and no
        gradient through the target term; mask such positions in the loss.
    chunk_tokens: tokens upcast to float32 at a time (None: 1/DEFAULT_CHUNKS of them); the
        results do not depend on it beyond float rounding.
    Returns (logprob [...], entropy [...] or None), both float32 and identical on all TP ranks.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if target_ids.shape != logits_vp.shape[:-1]:
        raise ValueError(f"target_ids shape {tuple(target_ids.shape)} must equal the logits' leading "
                         f"shape {tuple(logits_vp.shape[:-1])}")
    if target_ids.is_floating_point():
        raise ValueError(f"target_ids must be an integer tensor, got {target_ids.dtype}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (or None for 1/{DEFAULT_CHUNKS} of the tokens), "
                         f"got {chunk_tokens}")
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    num_tokens = target_ids.numel()
    chunk = chunk_tokens or max(1, -(-num_tokens // DEFAULT_CHUNKS))
    outputs = _ChunkedVocabParallelLogProb.apply(logits_vp, target_ids, tp_group, float(temperature),
                                                 compute_entropy, chunk)
    if compute_entropy:
        return outputs
    return outputs, None


class _ChunkedVocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_vp, target_ids, tp_group, temperature, compute_entropy, chunk):
        shape = target_ids.shape
        logits_NV = logits_vp.reshape(-1, logits_vp.shape[-1])  # a view for contiguous logits
        vocab_start = dist.get_rank(tp_group) * logits_NV.shape[-1] if tp_group is not None else 0
        local_id = target_ids.reshape(-1).long() - vocab_start
        on_shard = (local_id >= 0) & (local_id < logits_NV.shape[-1])
        local_id = torch.where(on_shard, local_id, 0)

        max_z = logits_NV.amax(dim=-1).float().div_(temperature)
        _all_reduce(max_z, dist.ReduceOp.MAX, tp_group)
        num_partials = 3 if compute_entropy else 2
        # [target z - max, sum e^(z - max), sum e^(z - max) (z - max)]: the owner's target only
        partials = max_z.new_zeros(num_partials, logits_NV.shape[0])
        for rows in _chunks(logits_NV.shape[0], chunk):
            z = _shifted_chunk(logits_NV[rows], max_z[rows], temperature)
            target_z = z.gather(-1, local_id[rows].unsqueeze(-1)).squeeze(-1)
            partials[0, rows] = torch.where(on_shard[rows], target_z, 0.0)
            if compute_entropy:
                exp_z = z.exp()
                partials[1, rows] = exp_z.sum(dim=-1)
                partials[2, rows] = exp_z.mul_(z).sum(dim=-1)
                del exp_z
            else:
                partials[1, rows] = z.exp_().sum(dim=-1)
            del z
        _all_reduce(partials, dist.ReduceOp.SUM, tp_group)
        log_sum_exp = partials[1].log()
        logprob = partials[0] - log_sum_exp

        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.compute_entropy, ctx.logits_shape = compute_entropy, logits_vp.shape
        # A chunk's log-softmax is (z - max) - log_sum_exp (two shifts: max + log_sum_exp would round).
        if not compute_entropy:
            ctx.save_for_backward(logits_NV, local_id, on_shard, max_z, log_sum_exp)
            return logprob.view(shape)
        # H = log sum e^z - sum p z  (z shifted by the max; H is shift invariant)
        entropy = log_sum_exp - partials[2] / partials[1]
        ctx.save_for_backward(logits_NV, local_id, on_shard, max_z, log_sum_exp, entropy)
        return logprob.view(shape), entropy.view(shape)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        logits_NV, local_id, on_shard, max_z, log_sum_exp, *rest = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logprob = grad_logprob.reshape(-1).float()
        # d logprob / dz_v = [v = target] - p_v ;  d H / dz_v = -p_v (log p_v + H)
        coeff = None
        if ctx.compute_entropy:
            (entropy,) = rest
            grad_entropy = grad_entropy.reshape(-1).float()
            coeff = grad_logprob + grad_entropy * entropy
        else:
            grad_entropy = None
        target_grad = torch.where(on_shard, grad_logprob, 0.0)
        grad_NV = torch.empty_like(logits_NV, memory_format=torch.contiguous_format)
        for rows in _chunks(logits_NV.shape[0], ctx.chunk):
            # (one chunk at a time: its float32 buffers are freed when _chunk_grad returns)
            grad_NV[rows] = _chunk_grad(logits_NV[rows], max_z[rows], log_sum_exp[rows], local_id[rows], target_grad[rows],
                                        grad_logprob[rows], None if grad_entropy is None else grad_entropy[rows],
                                        None if grad_entropy is None else coeff[rows], temperature)
        return grad_NV.view(ctx.logits_shape), None, None, None, None, None


def _chunk_grad(logits, max_z, log_sum_exp, local_id, target_grad, grad_logprob, grad_entropy, coeff, temperature):
    """A chunk's float32 gradient wrt its logits: (onehot - p) g_lp - p (log p + H) g_H, over T."""
    log_p = _shifted_chunk(logits, max_z, temperature).sub_(log_sum_exp.unsqueeze(-1))
    if grad_entropy is None:
        grad_z = log_p.exp_().mul_(-grad_logprob.unsqueeze(-1))
    else:
        p = log_p.exp()
        # -p (g_lp + g_H (log p + H)), with coeff = g_lp + g_H H; the scale built in log_p's buffer
        grad_z = p.mul_(log_p.mul_(grad_entropy.unsqueeze(-1)).add_(coeff.unsqueeze(-1))).neg_()
    grad_z.scatter_add_(-1, local_id.unsqueeze(-1), target_grad.unsqueeze(-1))
    if temperature != 1.0:
        grad_z.div_(temperature)
    return grad_z


def _shifted_chunk(logits: torch.Tensor, shift: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / T - shift (per token) of a chunk, in one new buffer."""
    z = logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    return z.sub_(shift.unsqueeze(-1))


def _chunks(num_tokens: int, chunk: int):
    for start in range(0, num_tokens, chunk):
        yield slice(start, min(start + chunk, num_tokens))


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
