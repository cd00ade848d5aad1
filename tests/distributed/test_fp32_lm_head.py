"""model.fp32_lm_head: a bf16 model's output layer in float32, under TP 1 and TP 2 (gloo), tied and
untied embeddings, with the padded-vocabulary mask; and the embedded engine's counterpart."""
import pytest
import torch
import torch.nn.functional as F

from tests.dist import hide_gpus, run_distributed

pytestmark = [pytest.mark.distributed]

# vocabulary 200, padded to 256 under TP 1 and TP 2 (rank 1's shard, rows 128-255, ends in 56 padding rows)
CFG = dict(vocab_size=200, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=96, max_position_embeddings=32, add_qkv_bias=True, init_method_std=0.2, bf16=True)
TOKENS = torch.randint(0, 200, (2, 11), generator=torch.Generator().manual_seed(2))


def _worker(rank, world):
    """Per (tied, fp32_lm_head): this rank's logits shard, the output layer's input (the bf16 hidden
    states), its weight, the log-probs, the gradient the log-probs sent into the logits and the
    output weight's gradient."""
    hide_gpus()
    from megatron_rlcorr.model.build import build_gpt_model
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.logprobs import token_logprobs_and_entropy

    enable_cpu_megatron()
    groups = build_parallel_groups(world, 1, 1)
    targets = torch.roll(TOKENS, -1, dims=1)
    out = {}
    for tied in (False, True):
        for fp32_head in (False, True):
            model = build_gpt_model(ModelConfig(**CFG, tie_embeddings=tied, fp32_lm_head=fp32_head), groups, seed=3)
            seen = {}
            model.output_layer.register_forward_pre_hook(lambda m, args, kw: seen.update(hidden=args[0].detach()),
                                                          with_kwargs=True)
            logits = model(TOKENS, None, None)
            logits.retain_grad()
            logprob, _ = token_logprobs_and_entropy(logits, targets, tp_group=groups.tp)
            logprob.sum().backward()
            weight = model.embedding.word_embeddings.weight if tied else model.output_layer.weight
            out[(tied, fp32_head)] = dict(logits=logits.detach(), hidden=seen["hidden"], weight=weight.detach(),
                                          logprob=logprob.detach(), grad_logits=logits.grad,
                                          grad_weight=weight.grad, hooked=len(model.output_layer._forward_hooks))
    return out


@pytest.fixture(scope="module")
def results():
    return {tp: run_distributed(_worker, tp) for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_fp32_lm_head_logits_are_the_float32_product_of_the_bf16_hidden_states(results, tp, tied):
    from megatron_rlcorr.model.config import PADDED_VOCAB_LOGIT

    for rank, out in enumerate(results[tp]):
        r = out[(tied, True)]
        assert r["hidden"].dtype == torch.bfloat16 and r["weight"].dtype == torch.bfloat16
        assert r["hooked"] == 1  # the padded-vocabulary mask
        assert r["logits"].dtype == torch.float32
        expected = F.linear(r["hidden"].float(), r["weight"].float()).transpose(0, 1)  # [s, b] -> [b, s]
        width = expected.shape[-1]
        real = max(0, min(width, CFG["vocab_size"] - rank * width))
        torch.testing.assert_close(r["logits"][..., :real], expected[..., :real], rtol=1e-6, atol=1e-5)
        assert torch.all(r["logits"][..., real:] == PADDED_VOCAB_LOGIT)  # the mask hook still applies
        # The bf16 head's logits are the same product rounded to bf16: the rounding is what goes away.
        bf16 = out[(tied, False)]
        assert bf16["logits"].dtype == torch.bfloat16
        torch.testing.assert_close(bf16["logits"][..., :real].float(), expected[..., :real].bfloat16().float(),
                                   rtol=0, atol=0.0625)
        assert (bf16["logits"][..., :real].float() - r["logits"][..., :real]).abs().max() > 0


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_fp32_lm_head_weight_gradient_flows_to_the_bf16_parameter(results, tp, tied):
    """dL/dW = (dL/dlogits)^T h in float32, rounded once into the bf16 parameter's gradient (tied: plus the
    embedding's own gradient, which only touches the rows of the input tokens)."""
    for rank, out in enumerate(results[tp]):
        r = out[(tied, True)]
        g = r["grad_logits"].transpose(0, 1).reshape(-1, r["grad_logits"].shape[-1])  # [s*b, V_p]
        h = r["hidden"].reshape(-1, r["hidden"].shape[-1]).float()
        expected = g.t() @ h
        grad = r["grad_weight"]
        assert grad.dtype == torch.bfloat16
        rows = torch.ones(grad.shape[0], dtype=torch.bool)
        if tied:  # the embedding lookup adds to the rows of the input tokens (on the rank holding them)
            local = TOKENS.flatten() - rank * grad.shape[0]
            rows[local[(local >= 0) & (local < grad.shape[0])]] = False
        torch.testing.assert_close(grad[rows].float(), expected[rows], rtol=1e-2, atol=1e-4)


def test_tp2_fp32_lm_head_log_probs_match_one_process(results):
    """TP 2's log-probs are identical on both ranks and agree with one process's up to the bf16
    body's rounding (its TP reductions round differently)."""
    for tied in (False, True):
        one = results[1][0][(tied, True)]["logprob"]
        rank0, rank1 = (out[(tied, True)]["logprob"] for out in results[2])
        assert torch.equal(rank0, rank1)
        torch.testing.assert_close(rank0, one, rtol=0, atol=0.1)


# ---- the embedded engine ------------------------------------------------------------------------

def test_embedded_engine_fp32_lm_head_scores_from_float32_logits():
    from megatron_rlcorr.model.architecture import DecoderShape
    from megatron_rlcorr.rollout.embedded import EmbeddedEngine, random_weights

    shape = DecoderShape(vocab_size=50, hidden_size=32, num_layers=1, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=48)
    weights = random_weights(shape, generator=torch.Generator().manual_seed(0), std=0.3)
    engines = {flag: EmbeddedEngine(shape, precision="bf16", fp32_lm_head=flag) for flag in (False, True)}
    for engine in engines.values():
        engine.load_weights(weights)
    hidden = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    fp32 = engines[True]._logits(hidden)
    assert engines[True].weights.lm_head.dtype == torch.float32
    torch.testing.assert_close(fp32, F.linear(hidden.float(), weights["lm_head.weight"].bfloat16().float()))
    bf16 = engines[False]._logits(hidden)
    torch.testing.assert_close(bf16, fp32.bfloat16().float(), rtol=0, atol=0)
    # score: log_softmax of the float32 logits of the engine's bf16 hidden states
    engine, tokens = engines[True], [1, 2, 3, 4, 5, 6, 7]
    (scored,) = engine.score([tokens[:3]], [tokens[3:]], temperature=0.7)
    seen = {}
    logits = engine._logits

    def spy(hidden):
        seen["hidden"] = hidden
        return logits(hidden)

    engine._logits = spy
    engine.score([tokens[:3]], [tokens[3:]], temperature=0.7)
    assert seen["hidden"].dtype == torch.bfloat16
    expected = torch.log_softmax(F.linear(seen["hidden"].float(), engine.weights.lm_head) / 0.7, dim=-1)[0]
    torch.testing.assert_close(scored, expected[2:].gather(-1, torch.tensor(tokens[3:])[:, None]).squeeze(-1))
