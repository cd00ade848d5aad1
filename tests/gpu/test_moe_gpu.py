"""The GPU tier for mixture-of-experts models: what the CPU suite cannot reach.

- Transformer Engine's MoE path: TEGroupedMLP experts and the alltoall dispatcher with Transformer
  Engine's fused permutation (model/build.py turns both on for transformer_engine), in float32 and
  BF16, against the plain-torch float32 reference (model/reference.py) on the same weights: logits,
  the experts each token was routed to, and the weights read back by export.
- Expert parallelism on NCCL: ep 2, and expert tensor parallelism etp 2 with the alltoall
  dispatcher (its uneven all-gather is what gloo lacks, so the CPU suite refuses that layout),
  each equal to the one-GPU model.

Tolerances: Transformer Engine runs float32 GEMMs in TF32, so a token whose two best experts have
nearly equal router logits may be routed differently from the float32 reference; the routing
check therefore asks for agreement on nearly every token, and the logits are compared on average.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist import nccl_or_skip, run_distributed
from tests.gpu.te import require_transformer_engine

pytestmark = pytest.mark.gpu

VOCAB = 1000
MOE = dict(num_experts=8, router_topk=2, ffn_hidden_size=64, dense_layers=[0])
CFG = dict(vocab_size=VOCAB, hidden_size=128, num_layers=3, num_attention_heads=8, num_query_groups=2,
           ffn_hidden_size=256, qk_layernorm=True, rotary_base=1e6, make_vocab_size_divisible_by=1, moe=MOE)
# Qwen2-MoE's kind: q/k/v bias, a gated shared expert, softmax over all experts before the top-k.
SHARED = {**CFG, "qk_layernorm": False, "add_qkv_bias": True,
          "moe": {**MOE, "shared_expert_ffn_hidden_size": 96, "pre_softmax": True}}
VARIANTS = {
    "fp32_alltoall": (CFG, {}),
    "bf16_alltoall": (CFG, {"bf16": True}),
    "fp32_allgather": ({**CFG, "moe": {**MOE, "token_dispatcher": "allgather"}}, {}),
    "shared_fp32": (SHARED, {}),
}


def _routing(model) -> list[torch.Tensor]:
    """The experts each MoE layer's router chose in the last forward ([tokens in Megatron's
    sequence-major order, k]), from Megatron-Core's RouterReplay record."""
    return [m.router_replay.get_recorded_indices().cpu() for m in model.modules()
            if getattr(m, "router_replay", None) is not None]


def _worker(rank, world, ep, etp, names, weights, tokens):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_rlcorr.model.build import build_gpt_model
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.implementation import resolve_transformer_impl
    from megatron_rlcorr.model.weights import export_full_weights
    from megatron_rlcorr.parallel.groups import build_parallel_groups

    assert resolve_transformer_impl(None) == "transformer_engine"
    groups = build_parallel_groups(1, 1, 1, ep=ep, etp=etp)
    out = {}
    for name in names:
        base, extra = VARIANTS[name]
        cfg = ModelConfig(**base, **extra)
        model = build_gpt_model(cfg, groups, seed=5, weights=weights[name])
        for module in model.modules():
            if getattr(module, "router_replay", None) is not None:
                module.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        logits = model(tokens.cuda(), None, None)[..., :VOCAB].float()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.cuda().flatten()).backward()
        out[name] = dict(
            logits=logits.detach().cpu(), routing=_routing(model),
            exported={k: v.cpu() for k, v in export_full_weights([model], groups).items()},
            finite_grads=all(p.grad is None or torch.isfinite(p.grad).all().item() for p in model.parameters()),
            param_names=[n for n, _ in model.named_parameters()])
    return out


def _weights(name: str) -> dict[str, torch.Tensor]:
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import init_full_weights

    base, _ = VARIANTS[name]
    return init_full_weights(ModelConfig(**base), seed=3)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.mark.timeout(240)
def test_transformer_engine_moe_matches_the_reference():
    require_transformer_engine()
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.reference import reference_forward

    names = list(VARIANTS)
    weights, tokens = {name: _weights(name) for name in names}, _tokens()
    out = run_distributed(_worker, 1, 1, 1, names, weights, tokens, backend=nccl_or_skip(1))[0]
    assert any("experts.linear_fc1.weight" in n for n in out["fp32_alltoall"]["param_names"])  # TEGroupedMLP
    for name in names:
        base, _ = VARIANTS[name]
        cfg = ModelConfig(**base)
        chosen: list[torch.Tensor] = []
        reference = reference_forward(weights[name], cfg, tokens, routing=chosen)
        result = out[name]
        assert result["finite_grads"], name
        for key, tensor in result["exported"].items():  # bf16 parameters hold the weights rounded
            expected = weights[name][key].to(torch.bfloat16).float() if name.startswith("bf16") else weights[name][key]
            assert torch.equal(tensor.float(), expected), (name, key)
        # [S * B, k] sequence-major -> [B, S, k]; compare the sets of experts per token
        assert len(result["routing"]) == len(chosen) == len(cfg.decoder_shape.moe_layers)
        for trainer_SBk, ref_BSK in zip(result["routing"], chosen):
            trainer_BSK = trainer_SBk.view(tokens.shape[1], tokens.shape[0], -1).transpose(0, 1)
            same = (trainer_BSK.sort(-1).values == ref_BSK.sort(-1).values).all(-1).float().mean()
            assert same >= (0.95 if name.startswith("bf16") else 0.99), (name, float(same))
        mean_error = (result["logits"] - reference).abs().mean()
        assert mean_error < (0.1 if name.startswith("bf16") else 2e-2), (name, float(mean_error))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ep,etp", [(2, 1), (1, 2)], ids=["ep2", "etp2_alltoall"])
def test_expert_parallel_on_nccl_matches_one_gpu(ep, etp):
    require_transformer_engine()
    backend = nccl_or_skip(2)
    names = ["fp32_alltoall", "shared_fp32"]
    weights, tokens = {name: _weights(name) for name in names}, _tokens()
    one = run_distributed(_worker, 1, 1, 1, names, weights, tokens, backend=backend)[0]
    both = run_distributed(_worker, 2, ep, etp, names, weights, tokens, backend=backend)
    for name in names:
        for rank in range(2):
            torch.testing.assert_close(both[rank][name]["logits"], one[name]["logits"], atol=1e-3, rtol=0)
            for key, tensor in one[name]["exported"].items():
                assert torch.equal(both[rank][name]["exported"][key], tensor), (name, key, rank)
