"""GPTModel under TP, PP, CP and TP x CP (gloo, CPU) against the single-process reference.

Every case loads the same random neutral weights (random norms and q/k/v biases too), runs
forward and backward, takes one SGD step (lr 1) and exports the weights: matching logits check
the forward, matching post-step weights check every gradient and the export at once. The
reference is `reference_forward` with autograd on one process.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.dist import hide_gpus, run_distributed

pytestmark = [
    pytest.mark.distributed,
]

CFG = dict(vocab_size=100, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=48, add_qkv_bias=True, rotary_base=500.0, max_position_embeddings=64)
BATCH, SEQ, LR, SEED = 2, 16, 1.0, 11
PACKED_LENGTHS = (11, 6)  # THD case: padded to multiples of 2*cp


def _random_weights(cfg):
    from megatron_rlcorr.model.weights import neutral_weight_shapes

    gen = torch.Generator().manual_seed(5)
    weights = {}
    for name, shape in neutral_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = 0.1 * torch.randn(shape, generator=gen)
    return weights


def _batch():
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=gen)
    return tokens, targets


def _zigzag(x, cp, rank, dim=1):
    """Megatron's CP shard: 2*cp chunks, rank r keeps chunks r and 2*cp-1-r."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def _unzigzag(shards, dim=1):
    cp = len(shards)
    chunks = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        chunks[rank], chunks[2 * cp - 1 - rank] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def _reference(cfg, weights, tokens, targets):
    from megatron_rlcorr.model.reference import reference_forward

    leaves = {k: v.clone().requires_grad_() for k, v in weights.items()}
    logits = reference_forward(leaves, cfg, tokens)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return logits.detach(), {k: (v - LR * v.grad).detach() for k, v in leaves.items()}


# ---- worker ------------------------------------------------------------------------------------


def _setup(tp, pp, cp, cfg_dict):
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups

    enable_cpu_megatron()
    return ModelConfig(**cfg_dict), build_parallel_groups(tp, pp, cp)


def _sgd_step_and_export(model, groups):
    import torch.distributed as dist
    from megatron_rlcorr.model.weights import export_full_weights

    with torch.no_grad():
        for p in model.parameters():
            if groups.cp_size > 1:  # each CP rank saw part of the tokens (DDP reduces over dp_cp)
                dist.all_reduce(p.grad, group=groups.cp)
            p -= LR * p.grad
    return export_full_weights([model], groups)


def _tp_cp_worker(rank, world, tp, cp, cfg_dict, weights, tokens, targets, packed_seqs=None):
    """Padded batch, zigzag-split over CP: local logits and post-step weights; with
    `packed_seqs`, also the logits of those sequences packed into one THD batch."""
    hide_gpus()
    from megatron_rlcorr.model.build import build_gpt_model
    from megatron_rlcorr.model.weights import export_full_weights, load_full_weights

    cfg, groups = _setup(tp, 1, cp, cfg_dict)
    model = build_gpt_model(cfg, groups, seed=SEED)
    seeded = export_full_weights([model], groups)
    load_full_weights([model], weights, groups)
    result = {"cp_rank": groups.cp_rank, "seeded": seeded}
    if packed_seqs is not None:
        with torch.no_grad():
            result["packed_logits"] = _packed_logits(model, cfg, groups, packed_seqs)
    tokens, targets = _zigzag(tokens, cp, groups.cp_rank), _zigzag(targets, cp, groups.cp_rank)
    logits = model(tokens, None, None, runtime_gather_output=True)[..., :cfg.vocab_size]
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / (BATCH * SEQ)
    loss.backward()
    result.update(logits=logits.detach(), after=_sgd_step_and_export(model, groups))
    return result


def _packed_logits(model, cfg, groups, seqs):
    """Per-sequence local logits of a THD batch: each sequence padded to a multiple of 2*cp and
    zigzag-split on its own."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cp = groups.cp_size
    padded = [F.pad(t, (0, -len(t) % (2 * cp))) for t in seqs]
    cu = torch.tensor([0] + [len(t) for t in seqs]).cumsum(0).int()
    cu_padded = torch.tensor([0] + [len(t) for t in padded]).cumsum(0).int()
    local = torch.cat([_zigzag(t, cp, groups.cp_rank, dim=0) for t in padded])
    max_len = max(len(t) for t in padded)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                             cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_len, max_seqlen_kv=max_len)
    logits = model(local[None], None, None, packed_seq_params=params)[0, :, :cfg.vocab_size]
    return list(logits.split([len(t) // cp for t in padded]))


def _pp_worker(rank, world, cfg_dict, weights, tokens, targets):
    """Two stages through Megatron's 1F1B schedule, two micro-batches of one sequence."""
    hide_gpus()
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_rlcorr.model.build import build_gpt_model
    from megatron_rlcorr.model.weights import export_full_weights, load_full_weights

    cfg, groups = _setup(1, 2, 1, cfg_dict)
    model = build_gpt_model(cfg, groups, seed=SEED)
    seeded = export_full_weights([model], groups)
    load_full_weights([model], weights, groups)

    def forward_step(batches, model):
        mb_tokens, mb_targets = next(batches)
        output = model(mb_tokens, None, None)

        def loss_func(logits):
            loss = F.cross_entropy(logits[..., :cfg.vocab_size].flatten(0, 1), mb_targets.flatten())
            return loss, {"loss": loss.detach().clone()}  # the schedule scales `loss` in place
        return output, loss_func

    micro_batches = iter(zip(tokens.split(1), targets.split(1)))
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=micro_batches, model=[model], num_microbatches=BATCH,
        seq_length=SEQ, micro_batch_size=1, forward_only=False)
    return {"losses": [x["loss"] for x in losses], "seeded": seeded, "after": _sgd_step_and_export(model, groups)}


# ---- tests -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def case():
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import init_full_weights

    cfg = ModelConfig(**CFG)
    weights = _random_weights(cfg)
    tokens, targets = _batch()
    logits, after = _reference(cfg, weights, tokens, targets)
    return dict(cfg=cfg, weights=weights, tokens=tokens, targets=targets, logits=logits, after=after,
                seeded=init_full_weights(cfg, SEED))


def _assert_weights_equal(actual, expected, atol):
    assert list(actual) == list(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=0, msg=name)


def _assert_tp_cp_results(results, case, cp):
    by_cp = {}
    for result in results:
        by_cp.setdefault(result["cp_rank"], result["logits"])
        _assert_weights_equal(result["seeded"], case["seeded"], atol=0)
        _assert_weights_equal(result["after"], case["after"], atol=2e-6)
    logits = _unzigzag([by_cp[r] for r in range(cp)])
    torch.testing.assert_close(logits, case["logits"], atol=1e-5, rtol=0)


def test_tensor_parallel_2_matches_reference(case):
    results = run_distributed(_tp_cp_worker, 2, 2, 1, CFG, case["weights"], case["tokens"], case["targets"])
    _assert_tp_cp_results(results, case, cp=1)


def test_context_parallel_2_padded_and_packed_match_reference(case):
    from megatron_rlcorr.model.reference import reference_forward

    gen = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, CFG["vocab_size"], (n,), generator=gen) for n in PACKED_LENGTHS]
    results = run_distributed(_tp_cp_worker, 2, 1, 2, CFG, case["weights"], case["tokens"], case["targets"], seqs)
    _assert_tp_cp_results(results, case, cp=2)
    by_cp = {r["cp_rank"]: r["packed_logits"] for r in results}
    for i, seq in enumerate(seqs):
        logits = _unzigzag([by_cp[r][i] for r in range(2)], dim=0)[: len(seq)]
        expected = reference_forward(case["weights"], case["cfg"], seq[None])[0]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_tensor_x_context_parallel_2x2_matches_reference(case):
    results = run_distributed(_tp_cp_worker, 4, 2, 2, CFG, case["weights"], case["tokens"], case["targets"])
    _assert_tp_cp_results(results, case, cp=2)


def test_pipeline_parallel_2_schedule_matches_reference(case):
    results = run_distributed(_pp_worker, 2, CFG, case["weights"], case["tokens"], case["targets"])
    ref_losses = F.cross_entropy(case["logits"].flatten(0, 1), case["targets"].flatten(), reduction="none")
    ref_losses = ref_losses.view(BATCH, SEQ).mean(dim=1)
    assert results[0]["losses"] == []  # only the last stage computes the loss
    torch.testing.assert_close(torch.stack(results[1]["losses"]), ref_losses, atol=1e-5, rtol=0)
    for result in results:
        _assert_weights_equal(result["seeded"], case["seeded"], atol=0)
        _assert_weights_equal(result["after"], case["after"], atol=2e-6)
