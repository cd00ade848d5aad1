"""The embedded engine on mixture-of-experts models: its forward and its routing against
model/reference.py's oracle, the recorded routing's row alignment (RolloutBatch.routed_experts and
prompt_routed_experts), bf16/fp8 emulation, and the routing carried through RolloutGroups (dynamic
sampling, fillers) and rollout_world's exchange format."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rlcorr.data.tasks import Prompt
from megatron_rlcorr.model.architecture import DecoderShape, MoeShape
from megatron_rlcorr.model.reference import reference_forward
from megatron_rlcorr.rl.advantages import OverlongPenalty
from megatron_rlcorr.rl.rollout_world import (_pack_routing, _round_groups, _routing_layout, _stats_table,
                                              _unpack_routing)
from megatron_rlcorr.rl.sampling import DynamicSampling, RolloutGroups, RoutingLayout, dynamic_sample, generate_groups
from megatron_rlcorr.rollout import EmbeddedEngine, RolloutConfig, random_weights
from megatron_rlcorr.rollout.precision import fp8_e4m3_qdq

EOS = 2
BASE = DecoderShape(vocab_size=29, hidden_size=32, num_layers=3, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=40, rotary_base=500.0, norm_epsilon=1e-5)
# Qwen3-MoE-like: q/k norms, dense first layer, softmax over the top-k; Qwen2-MoE-like: q/k/v bias,
# softmax over all experts, a shared expert with its sigmoid gate.
VARIANTS = {
    "dense_first_layer": dataclasses.replace(BASE, qk_layernorm=True, moe=MoeShape(
        num_experts=6, router_topk=2, ffn_hidden_size=16, dense_layers=(0,))),
    "shared_expert": dataclasses.replace(BASE, add_qkv_bias=True, moe=MoeShape(
        num_experts=5, router_topk=2, ffn_hidden_size=12, pre_softmax=True, shared_expert_ffn_hidden_size=24)),
}
# Prompts of different lengths: left padding of 0 to 5 columns in one batch; a one-token prompt has no prompt rows.
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 11], [1, 3, 4, 20], [1]]


def make_weights(shape: DecoderShape, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = random_weights(shape, generator=g, std=0.3)
    for name in weights:
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.2 * torch.randn(weights[name].shape, generator=g)
    return weights


def engine(shape: DecoderShape, weights, precision: str = "fp32", **kwargs) -> EmbeddedEngine:
    eng = EmbeddedEngine(shape, precision=precision, eos_token_id=EOS, **kwargs)
    eng.load_weights(weights)
    return eng


def reference(weights, shape: DecoderShape, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 log-probs of tokens 1.., routing [T, MoE layers, k]) of one unpadded sequence."""
    routing: list[torch.Tensor] = []
    tokens = torch.tensor([sequence])
    logits = reference_forward(weights, shape, tokens, routing=routing)
    logp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, tokens[0, 1:, None])[:, 0]
    return logp, torch.stack(routing, dim=2)[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_generation_matches_the_reference_and_records_its_routing_row_aligned(variant):
    shape = VARIANTS[variant]
    weights = make_weights(shape)
    eng = engine(shape, weights)
    out = eng.generate(PROMPTS, max_new_tokens=7, generator=torch.Generator().manual_seed(3))
    assert len(shape.moe_layers) == (2 if variant == "dense_first_layer" else 3)
    shifted_differs = 0
    for prompt, response, logprobs, routed, prompt_routed in zip(
            out.prompt_ids, out.response_ids, out.logprobs, out.routed_experts, out.prompt_routed_experts):
        ref_logp, ref_TLK = reference(weights, shape, prompt + response)
        last = len(prompt) - 1  # the position whose output gives response token 0
        torch.testing.assert_close(logprobs, ref_logp[last:], rtol=0, atol=1e-5)
        assert routed.dtype == prompt_routed.dtype == torch.uint8
        assert routed.shape == (len(response), len(shape.moe_layers), shape.moe.router_topk)
        # Row j: input position len(prompt) - 1 + j; prompt rows: positions 0..len(prompt) - 2.
        assert torch.equal(routed.long(), ref_TLK[last: last + len(response)])
        assert torch.equal(prompt_routed.long(), ref_TLK[:last])
        shifted_differs += not torch.equal(routed[1:].long(), ref_TLK[last + 2: last + 1 + len(response)])
    assert shifted_differs > 0  # an off-by-one alignment would have been caught
    scored = eng.score(out.prompt_ids, out.response_ids)  # teacher-forced: the same numbers
    for got, want in zip(scored, out.logprobs):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_more_than_256_experts_record_int16_and_dense_models_record_nothing():
    shape = dataclasses.replace(BASE, num_layers=2, moe=MoeShape(num_experts=300, router_topk=3, ffn_hidden_size=2))
    weights = make_weights(shape)
    out = engine(shape, weights).generate(PROMPTS[:2], max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    for prompt, response, routed in zip(out.prompt_ids, out.response_ids, out.routed_experts):
        assert routed.dtype == torch.int16 and routed.shape == (len(response), 2, 3)
        _, ref_TLK = reference(weights, shape, prompt + response)
        assert torch.equal(routed.long(), ref_TLK[len(prompt) - 1: len(prompt) - 1 + len(response)])
    dense = dataclasses.replace(BASE, moe=None)
    plain = engine(dense, make_weights(dense)).generate(PROMPTS, max_new_tokens=2)
    assert plain.routed_experts is None and plain.prompt_routed_experts is None


# Mean |log-prob gap| to fp32 on these weights (std 0.3, large logits): about 0.034 in bf16, 0.16 in fp8.
@pytest.mark.parametrize("precision, low, high", [("bf16", 5e-3, 0.1), ("fp8", 0.04, 0.4)])
def test_low_precision_runs_with_a_bounded_mismatch_and_fp8_quantises_every_expert(precision, low, high):
    shape = VARIANTS["shared_expert"]
    weights = make_weights(shape)
    out = engine(shape, weights, precision).generate(PROMPTS, max_new_tokens=6,
                                                      generator=torch.Generator().manual_seed(1))
    exact = engine(shape, weights).score(out.prompt_ids, out.response_ids)
    gap_T = torch.cat([(a - b).abs() for a, b in zip(out.logprobs, exact)])
    assert low < float(gap_T.mean()) < high and float(gap_T.max()) < 1.0, (gap_T.mean(), gap_T.max())
    for routed, response in zip(out.routed_experts, out.response_ids):
        assert routed.shape == (len(response), 3, 2) and int(routed.max()) < shape.moe.num_experts
        assert all(len(set(row)) == 2 for layer in routed.tolist() for row in layer)  # k distinct experts
    layer = engine(shape, weights, precision).weights.layers[1].moe
    qdq = fp8_e4m3_qdq if precision == "fp8" else (lambda t: t)
    e = 3
    want = torch.cat([qdq(weights[f"layers.1.experts.{e}.{n}.weight"]) for n in ("gate", "up")])
    assert torch.equal(layer.gate_up_EFH[e], want.to(torch.bfloat16))
    assert torch.equal(layer.down_EHF[e], qdq(weights[f"layers.1.experts.{e}.down.weight"]).to(torch.bfloat16))
    assert torch.equal(layer.shared_down, qdq(weights["layers.1.shared.down.weight"]).to(torch.bfloat16))
    # The router and the shared expert's gate stay bf16 (not quantised) in both modes.
    assert torch.equal(layer.router, weights["layers.1.router.weight"].to(torch.bfloat16))
    assert torch.equal(layer.shared_gate, weights["layers.1.shared_gate.weight"].to(torch.bfloat16))
    if precision == "fp8":
        assert not torch.equal(layer.down_EHF[e], weights[f"layers.1.experts.{e}.down.weight"].to(torch.bfloat16))


def test_policy_lag_routes_with_the_lagged_weights():
    shape = VARIANTS["dense_first_layer"]
    old, new = make_weights(shape, seed=0), make_weights(shape, seed=1)
    eng = engine(shape, old, policy_lag=1)
    eng.load_weights(new)
    assert eng.weights_age == 1
    out = eng.generate(PROMPTS[:2], max_new_tokens=4, generator=torch.Generator().manual_seed(2))
    for prompt, response, routed in zip(out.prompt_ids, out.response_ids, out.routed_experts):
        _, old_TLK = reference(old, shape, prompt + response)
        _, new_TLK = reference(new, shape, prompt + response)
        rows = slice(len(prompt) - 1, len(prompt) - 1 + len(response))
        assert torch.equal(routed.long(), old_TLK[rows]) and not torch.equal(old_TLK[rows], new_TLK[rows])


class _FirstTokenTask:
    """Reward 1 when the response's first token is even: some groups informative, some not."""

    def reward(self, prompt, response_ids):
        return float(response_ids[0] % 2 == 0)


def test_routed_experts_survive_dynamic_sampling_fillers_and_the_exchange_format():
    shape = VARIANTS["dense_first_layer"]
    eng = engine(shape, make_weights(shape))
    rollout = RolloutConfig(n=3, max_new_tokens=4, precision="fp32")
    pool = [Prompt(ids=[1, 3 + i, 4 + 2 * i], answer=str(i)) for i in range(12)]

    def draw(round_, k):
        prompts = pool[4 * round_: 4 * round_ + k]
        return generate_groups(eng, _FirstTokenTask(), prompts, rollout=rollout,
                               overlong=OverlongPenalty(enabled=False), seeds=[100 + int(p.answer) for p in prompts])

    # Two batch limits: a top-up round (groups dropped and reordered), and fillers (the dropped come back last).
    topped_up, _, stats = dynamic_sample(draw, 4, DynamicSampling(True, "score", max_num_gen_batches=2))
    filled, _, filled_stats = dynamic_sample(draw, 4, DynamicSampling(True, "score", max_num_gen_batches=1))
    assert stats.gen_batches == 2 and filled_stats.exhausted and bool(filled.filler_G.any())
    for batch in (topped_up, filled):
        assert batch.routing == RoutingLayout(layers=2, topk=2, dtype=torch.uint8, prompt=True)
        # Every row's routing is that of its own sample: regenerate each prompt with its seed (bit for bit).
        for g, prompt in enumerate(batch.prompts):
            direct = eng.sample_groups([prompt.ids], n=3, seeds=[100 + int(prompt.answer)], max_new_tokens=4)
            for j in range(3):
                row = g * 3 + j
                assert batch.response_ids[row] == direct.response_ids[j]
                assert torch.equal(batch.routed_experts[row], direct.routed_experts[j])
                assert torch.equal(batch.prompt_routed_experts[row], direct.prompt_routed_experts[j])
                assert batch.prompt_routed_experts[row].shape[0] == len(prompt.ids) - 1
    batch = topped_up
    # rollout_world: the stats table names the layout; a rank without the samples rebuilds them from bytes.
    assert _routing_layout(_stats_table(batch)) == batch.routing
    remote = _round_groups(batch.prompts, _stats_table(batch), None, 0, 3, [(0, len(batch))])
    assert remote.routing == batch.routing and remote.routed_experts == [None] * 12
    _unpack_routing(remote, [1, 3], _pack_routing(batch, [1, 3]))
    for row in range(12):
        got = remote.routed_experts[row]
        assert (got is None) == (row // 3 not in (1, 3))
        if got is not None:
            assert torch.equal(got, batch.routed_experts[row])
            assert torch.equal(remote.prompt_routed_experts[row], batch.prompt_routed_experts[row])
    # Concatenating a dense rollout with a MoE one is an error, not a silent loss.
    dense = dataclasses.replace(batch, routed_experts=None, prompt_routed_experts=None, routing=None)
    with pytest.raises(AssertionError, match="different routing records"):
        RolloutGroups.concat([batch, dense])
