"""Log-probabilities of target tokens (and entropy) from vocab-parallel logits.

Under tensor parallelism the output layer leaves each TP rank with a contiguous slice
`[rank * V_p, (rank + 1) * V_p)` of the vocabulary. The log-softmax over the full vocabulary
needs only three per-token scalars from the other ranks: the max logit, the sum of
exponentials and the target logit (plus sum p*z for the entropy). They travel in two small
all-reduces (MAX, then one packed SUM); the gradient with respect to the local logits is local
(onehot - softmax), so backward communicates nothing.

Temperature: the rollout engine (vLLM) reports log-probs of the tempered distribution
softmax(z / T), so the trainer's log-probs are computed from logits / T as well.

Memory (in float32 copies of the local logits): forward makes one copy and turns it in place
into what backward keeps: the softmax, or with entropy the log-softmax (the entropy gradient
needs log p where p underflows). Peaks: forward 1 (2 with entropy), backward 2 (3 with entropy),
the gradient returned included. Logits must be finite (Megatron's are).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def token_logprobs_and_entropy(
    logits_vp: torch.Tensor,
    target_ids: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log pi(target | .) and, optionally, the entropy of the tempered distribution.

    logits_vp: [..., V_p] this TP rank's vocabulary slice, any float dtype and leading shape
        ([b, s, V_p], [s, b, V_p] or packed [t, V_p]); never modified.
    target_ids: [...] integer ids in the full vocabulary. An id outside the vocabulary (e.g. a
        -100 ignore index at a padding position) gives a finite, meaningless log-prob and no
        gradient through the target term; mask such positions in the loss.
    Returns (logprob [...], entropy [...] or None), both float32 and identical on all TP ranks.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if target_ids.shape != logits_vp.shape[:-1]:
        raise ValueError(f"target_ids shape {tuple(target_ids.shape)} must equal the logits' leading "
                         f"shape {tuple(logits_vp.shape[:-1])}")
    if target_ids.is_floating_point():
        raise ValueError(f"target_ids must be an integer tensor, got {target_ids.dtype}")
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    outputs = _VocabParallelLogProb.apply(logits_vp, target_ids, tp_group, float(temperature),
                                          compute_entropy)
    if compute_entropy:
        return outputs
    return outputs, None


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_vp, target_ids, tp_group, temperature, compute_entropy):
        vocab_start = dist.get_rank(tp_group) * logits_vp.shape[-1] if tp_group is not None else 0
        # Our own float32 copy (even for float32 input), turned in place into what backward keeps.
        z = logits_vp.to(torch.float32, copy=True)
        if temperature != 1.0:
            z.div_(temperature)

        max_z = z.amax(dim=-1)
        _all_reduce(max_z, dist.ReduceOp.MAX, tp_group)
        z.sub_(max_z.unsqueeze(-1))

        local_id = target_ids.long() - vocab_start
        on_shard = (local_id >= 0) & (local_id < z.shape[-1])
        local_id = torch.where(on_shard, local_id, 0)
        target_z = torch.where(on_shard, z.gather(-1, local_id.unsqueeze(-1)).squeeze(-1), 0.0)

        if compute_entropy:
            exp_z = z.exp()
            partials = [target_z, exp_z.sum(dim=-1), exp_z.mul_(z).sum(dim=-1)]  # .., sum e^z * z
            del exp_z
        else:
            exp_z = z.exp_()  # z is not needed again: build the softmax in place
            partials = [target_z, exp_z.sum(dim=-1)]
        sums = torch.stack(partials)
        _all_reduce(sums, dist.ReduceOp.SUM, tp_group)
        log_sum_exp = sums[1].log()
        logprob = sums[0] - log_sum_exp

        ctx.temperature = temperature
        ctx.logits_dtype = logits_vp.dtype
        ctx.compute_entropy = compute_entropy
        if not compute_entropy:
            softmax = exp_z.div_(sums[1].unsqueeze(-1))
            ctx.save_for_backward(softmax, local_id, on_shard)
            return logprob
        # The entropy gradient needs log p, which an underflowed softmax cannot give back.
        log_softmax = z.sub_(log_sum_exp.unsqueeze(-1))
        # H = log sum e^z - sum p z  (z shifted by the max; H is shift invariant)
        entropy = log_sum_exp - sums[2] / sums[1]
        ctx.save_for_backward(log_softmax, local_id, on_shard, entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        grad_logprob = grad_logprob.float()
        # d logprob / dz_v = [v = target] - p_v ;  d H / dz_v = -p_v (log p_v + H)
        if ctx.compute_entropy:
            log_softmax, local_id, on_shard, entropy = ctx.saved_tensors
            grad_entropy = grad_entropy.float()
            coeff = (grad_logprob + grad_entropy * entropy).unsqueeze(-1)
            scale = torch.addcmul(coeff, log_softmax, grad_entropy.unsqueeze(-1))
            grad_z = log_softmax.exp().mul_(scale).neg_()
        else:
            softmax, local_id, on_shard = ctx.saved_tensors
            grad_z = softmax * -grad_logprob.unsqueeze(-1)
        target_grad = torch.where(on_shard, grad_logprob, 0.0).unsqueeze(-1)
        grad_z.scatter_add_(-1, local_id.unsqueeze(-1), target_grad)
        if ctx.temperature != 1.0:
            grad_z.div_(ctx.temperature)
        return grad_z.to(ctx.logits_dtype), None, None, None, None


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
