"""Vocab-parallel log-probs over gloo: each TP rank holds a vocabulary slice of the same logits."""
import pytest
import torch
import torch.distributed as dist

from megatron_rlcorr.training.logprobs import token_logprobs_and_entropy
from tests.dist import run_distributed

VOCAB = 48
TP_GROUPS = {4: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]]}
CASES = [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 0.7)]
CHUNKS = (None, 4)  # 1/16 of the 15 tokens (one a chunk) and uneven chunks of 4


def full_problem(dtype):
    gen = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(3, 5, VOCAB, generator=gen)).to(dtype)
    targets = torch.randint(0, VOCAB, (3, 5), generator=gen)
    g_logprob, g_entropy = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    return logits, targets, g_logprob, g_entropy


def sharded_forward_backward(tp_group, dtype, temperature, chunk_tokens=None):
    """This rank's log-probs, entropy and gradient wrt its own vocabulary slice (the whole
    vocabulary without a group)."""
    logits, targets, g_logprob, g_entropy = full_problem(dtype)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    local = logits.chunk(tp_size, dim=-1)[tp_rank].clone().requires_grad_()
    before = local.detach().clone()
    logprob, entropy = token_logprobs_and_entropy(local, targets, tp_group=tp_group, temperature=temperature,
                                                  compute_entropy=True, chunk_tokens=chunk_tokens)
    ((logprob * g_logprob).sum() + (entropy * g_entropy).sum()).backward()
    assert torch.equal(local.detach(), before), "logits were modified"
    return logprob.detach(), entropy.detach(), local.grad


def _tp_worker(rank, world_size):
    # tp = world (4 ranks), and two tp groups of 2: {0, 1} and {2, 3}; every rank makes every group.
    pair_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for dtype, temperature in CASES:
        results[(4, dtype, temperature)] = sharded_forward_backward(dist.group.WORLD, dtype, temperature)
        results[(2, dtype, temperature)] = sharded_forward_backward(pair_groups[rank // 2], dtype, temperature)
        for chunk in CHUNKS:
            results[(2, dtype, temperature, chunk)] = sharded_forward_backward(pair_groups[rank // 2], dtype,
                                                                              temperature, chunk)
    return results


def reference(dtype, temperature):
    logits, targets, g_logprob, g_entropy = full_problem(dtype)
    logits64 = logits.double().requires_grad_()
    log_p = torch.log_softmax(logits64 / temperature, dim=-1)
    logprob = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    ((logprob * g_logprob.double()).sum() + (entropy * g_entropy.double()).sum()).backward()
    return logprob.detach(), entropy.detach(), logits64.grad


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_tp_worker, 4)


@pytest.mark.distributed
def test_tp2_and_tp4_match_full_vocab_reference(tp_results):
    results = tp_results
    for dtype, temperature in CASES:
        ref_lp, ref_h, ref_grad = reference(dtype, temperature)
        grad_tol = dict(rtol=1e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=0, atol=2e-6)
        for tp, groups in TP_GROUPS.items():
            for group in groups:
                shards = [results[r][(tp, dtype, temperature)] for r in group]
                for lp, h, _ in shards:  # every TP rank returns the full-vocab values
                    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
                    torch.testing.assert_close(h.double(), ref_h, rtol=0, atol=1e-5)
                grad = torch.cat([g for _, _, g in shards], dim=-1)
                assert grad.dtype == dtype
                torch.testing.assert_close(grad.double(), ref_grad, **grad_tol)


@pytest.mark.distributed
def test_tp2_chunked_equals_one_process(tp_results):
    """Chunked log-probs, entropies and gradients under TP=2 (gloo) equal one process's over the
    whole vocabulary, chunked the same way, to float32 rounding."""
    results = tp_results
    for dtype, temperature in CASES:
        for chunk in CHUNKS:
            single = sharded_forward_backward(None, dtype, temperature, chunk)
            for group in TP_GROUPS[2]:
                shards = [results[r][(2, dtype, temperature, chunk)] for r in group]
                for lp, h, _ in shards:
                    torch.testing.assert_close(lp, single[0], rtol=0, atol=1e-6)
                    torch.testing.assert_close(h, single[1], rtol=0, atol=1e-6)
                grad = torch.cat([g for _, _, g in shards], dim=-1)
                tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
                torch.testing.assert_close(grad.float(), single[2].float(), **tol)
