import pytest
import torch

from megatron_rlcorr.training.logprobs import token_logprobs_and_entropy


def reference(logits, targets, temperature):
    """float64 full-vocabulary log-softmax of the tempered logits, gathered, and the entropy."""
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    logprob = log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return logprob, entropy


def grads_of(logprob, entropy, logits, g_logprob, g_entropy):
    objective = (logprob * g_logprob).sum()
    if entropy is not None:
        objective = objective + (entropy * g_entropy).sum()
    (grad,) = torch.autograd.grad(objective, logits)
    return grad


@pytest.mark.parametrize("shape", [(2, 5, 37), (7, 37)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("compute_entropy", [False, True])
def test_fp32_values_and_gradients_match_full_vocab_reference(shape, temperature, compute_entropy):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(shape, generator=gen)).requires_grad_()
    targets = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    g_lp, g_h = torch.randn(shape[:-1], generator=gen), torch.randn(shape[:-1], generator=gen)

    logprob, entropy = token_logprobs_and_entropy(logits, targets, temperature=temperature,
                                                  compute_entropy=compute_entropy)
    logits64 = logits.detach().double().requires_grad_()
    ref_lp, ref_h = reference(logits64, targets, temperature)

    assert logprob.dtype == torch.float32
    torch.testing.assert_close(logprob.double(), ref_lp, rtol=0, atol=2e-6)
    if compute_entropy:
        torch.testing.assert_close(entropy.double(), ref_h, rtol=0, atol=2e-6)
    else:
        assert entropy is None
        ref_h = None
    grad = grads_of(logprob, entropy, logits, g_lp, g_h)
    ref_grad = grads_of(ref_lp, ref_h, logits64, g_lp.double(), g_h.double())
    torch.testing.assert_close(grad.double(), ref_grad, rtol=0, atol=2e-6)


def test_bf16_logits_are_upcast_and_gradient_is_bf16():
    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(3, 4, 50, generator=gen)).bfloat16().requires_grad_()
    targets = torch.randint(0, 50, (3, 4), generator=gen)
    g_lp, g_h = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    before = logits.detach().clone()

    logprob, entropy = token_logprobs_and_entropy(logits, targets, temperature=0.8, compute_entropy=True)
    logits64 = logits.detach().double().requires_grad_()  # the exact bf16 values
    ref_lp, ref_h = reference(logits64, targets, 0.8)
    assert logprob.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logprob.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h, rtol=0, atol=1e-5)

    grad = grads_of(logprob, entropy, logits, g_lp, g_h)
    ref_grad = grads_of(ref_lp, ref_h, logits64, g_lp.double(), g_h.double())
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2, atol=1e-3)
    assert torch.equal(logits.detach(), before)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_caller_fp32_logits_are_never_modified(temperature):
    logits = torch.randn(4, 9, 30).requires_grad_()
    before = logits.detach().clone()
    targets = torch.randint(0, 30, (4, 9))
    logprob, entropy = token_logprobs_and_entropy(logits, targets, temperature=temperature,
                                                  compute_entropy=True)
    (logprob.sum() + entropy.sum()).backward()
    assert torch.equal(logits.detach(), before)


def test_non_contiguous_sbv_logits():
    logits_bsv = torch.randn(3, 6, 20)
    logits_sbv = logits_bsv.transpose(0, 1).requires_grad_()  # [s, b, V] view, not contiguous
    targets_sb = torch.randint(0, 20, (6, 3))
    logprob, _ = token_logprobs_and_entropy(logits_sbv, targets_sb)
    ref_lp, _ = reference(logits_sbv.detach(), targets_sb, 1.0)
    torch.testing.assert_close(logprob.double(), ref_lp, rtol=0, atol=2e-6)
    logprob.sum().backward()
    ref = torch.nn.functional.one_hot(targets_sb, 20) - torch.softmax(logits_sbv.detach().double(), -1)
    torch.testing.assert_close(logits_sbv.grad.double(), ref, rtol=0, atol=2e-6)


def test_entropy_only_objective_has_entropy_gradient():
    logits = torch.randn(5, 12, dtype=torch.float32).requires_grad_()
    targets = torch.randint(0, 12, (5,))
    _, entropy = token_logprobs_and_entropy(logits, targets, compute_entropy=True)
    entropy.sum().backward()
    logits64 = logits.detach().double().requires_grad_()
    reference(logits64, targets, 1.0)[1].sum().backward()
    torch.testing.assert_close(logits.grad.double(), logits64.grad, rtol=0, atol=2e-6)


def test_out_of_vocab_target_is_finite_and_has_no_target_gradient():
    logits = torch.randn(2, 10).requires_grad_()
    targets = torch.tensor([3, -100])
    logprob, _ = token_logprobs_and_entropy(logits, targets)
    assert torch.isfinite(logprob).all()
    logprob.sum().backward()
    softmax = torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(logits.grad[1], -softmax[1])
    expected0 = -softmax[0]
    expected0[3] += 1
    torch.testing.assert_close(logits.grad[0], expected0)


def test_large_logits_are_stable():
    logits = torch.tensor([[1e4, -1e4, 0.0, 9990.0]], requires_grad=True)
    logprob, entropy = token_logprobs_and_entropy(logits, torch.tensor([3]), compute_entropy=True)
    ref_lp, ref_h = reference(logits.detach(), torch.tensor([3]), 1.0)
    torch.testing.assert_close(logprob.double(), ref_lp, rtol=1e-6, atol=0)
    torch.testing.assert_close(entropy.double(), ref_h, rtol=1e-4, atol=1e-9)
    (logprob.sum() + entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()


def test_invalid_arguments_raise():
    logits, targets = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="target_ids shape"):
        token_logprobs_and_entropy(logits, targets[:, :2])
    with pytest.raises(ValueError, match="integer"):
        token_logprobs_and_entropy(logits, targets.float())


def _bench():
    """tools/bench_logprobs.py: the implementation before chunking (its baseline) and its memory probe."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "bench_logprobs.py"
    spec = importlib.util.spec_from_file_location("bench_logprobs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _forward_backward(fn, logits, targets, g_lp, g_h, temperature, compute_entropy):
    leaf = logits.detach().clone().requires_grad_()
    logprob, entropy = fn(leaf, targets, temperature, compute_entropy)
    objective = (logprob * g_lp).sum() + ((entropy * g_h).sum() if compute_entropy else 0.0)
    objective.backward()
    return logprob.detach(), None if entropy is None else entropy.detach(), leaf.grad


@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, None, 29, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("compute_entropy", [False, True])
def test_chunked_equals_the_unchunked_implementation(chunk_tokens, temperature, compute_entropy):
    """Values and gradients of every chunking equal those of the implementation before chunking."""
    gen = torch.Generator().manual_seed(5)
    logits = 4 * torch.randn(29, 61, generator=gen)
    targets = torch.randint(0, 61, (29,), generator=gen)
    g_lp, g_h = torch.randn(29, generator=gen), torch.randn(29, generator=gen)

    def chunked(leaf, t, temp, ent):
        return token_logprobs_and_entropy(leaf, t, temperature=temp, compute_entropy=ent, chunk_tokens=chunk_tokens)

    new = _forward_backward(chunked, logits, targets, g_lp, g_h, temperature, compute_entropy)
    old = _forward_backward(_bench().unchunked, logits, targets, g_lp, g_h, temperature, compute_entropy)
    for got, want in zip(new, old):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("compute_entropy", [False, True])
def test_peak_extra_memory_is_at_most_a_quarter_of_one_fp32_copy(compute_entropy):
    """Measured with the CPU allocator's events (torch.profiler): forward + backward allocate, beyond
    the bf16 gradient they return, at most 25% of one float32 copy of the logits (the
    implementation before chunking: 2, 3 with entropy)."""
    bench = _bench()
    tokens, vocab = 256, 2048
    logits, targets, g_lp, g_h = bench.problem(tokens, vocab, "cpu")
    copy_bytes, grad_bytes = 4 * tokens * vocab, 2 * tokens * vocab

    def extra(impl):
        return bench.cpu_peak_bytes(
            lambda: bench.forward_backward(impl, logits, targets, g_lp, g_h, 0.8, compute_entropy)) - grad_bytes

    assert extra(bench.chunked) <= 0.25 * copy_bytes
    assert extra(bench.unchunked) >= 2 * copy_bytes  # what the measurement would have caught


def test_chunk_tokens_must_be_positive():
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_logprobs_and_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long), chunk_tokens=0)
