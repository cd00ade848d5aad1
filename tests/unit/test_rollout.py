"""The embedded rollout engine against an independent full-recompute forward of the same weights."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_rlcorr.model.architecture import DecoderShape
from megatron_rlcorr.model.config import ModelConfig
from megatron_rlcorr.rollout.base import engine_max_model_len
from megatron_rlcorr.rollout.token_sampling import sample_tokens
from megatron_rlcorr.rollout import EmbeddedEngine, RolloutBatch, RolloutConfig, RolloutEngine, make_engine, random_weights
from megatron_rlcorr.rollout.precision import E4M3_MAX, fp8_e4m3_qdq, round_to_e4m3

SHAPE = DecoderShape(vocab_size=23, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=48, rotary_base=500.0, norm_epsilon=1e-5, add_qkv_bias=True)
# The families of Hugging Face checkpoints: Qwen2 (q/k/v bias), LLaMA (none), Qwen3 (q/k norms, tied,
# head_dim != hidden / heads), LLaMA-3.1 (rope scaling: base 5e5 and head_dim 16 give wavelengths in
# all three of its regimes).
VARIANTS = {
    "qkv_bias": SHAPE,
    "plain": dataclasses.replace(SHAPE, add_qkv_bias=False),
    "qk_norm_tied_head_dim": dataclasses.replace(SHAPE, add_qkv_bias=False, qk_layernorm=True, tie_embeddings=True,
                                                 kv_channels=16),
    "rope_scaling": dataclasses.replace(SHAPE, add_qkv_bias=False, kv_channels=16, rotary_base=5e5,
                                        rope_scaling=True, rope_scaling_factor=8.0),
}
EOS = 2


def make_weights(seed: int = 0, std: float = 0.3, shape: DecoderShape = SHAPE) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = random_weights(shape, generator=g, std=std)
    for name in weights:
        if name.endswith("norm.weight"):  # non-trivial norm weights, so a skipped multiply shows
            weights[name] = 1.0 + 0.2 * torch.randn(weights[name].shape, generator=g)
    if shape.tie_embeddings:
        weights["lm_head.weight"] = weights["embed.weight"]
    return weights


def engine(weights: dict[str, torch.Tensor], precision: str = "fp32", shape: DecoderShape = SHAPE,
           **kwargs) -> EmbeddedEngine:
    eng = EmbeddedEngine(shape, precision=precision, eos_token_id=kwargs.pop("eos", None), **kwargs)
    eng.load_weights(weights)
    return eng


def prompts(n: int, seed: int = 1, min_len: int = 1, max_len: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [[1] + torch.randint(3, SHAPE.vocab_size, (n_tok - 1,), generator=g).tolist() for n_tok in lengths]


def llama3_inv_freq(s: DecoderShape) -> torch.Tensor:
    """LLaMA 3.1's rope scaling (low/high frequency factors 1 and 4, original context 8192), float64."""
    hd = s.head_dim
    inv_freq = 1.0 / s.rotary_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    if not s.rope_scaling:
        return inv_freq
    out = []
    for f in inv_freq.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4:
            out.append(f)
        elif wavelen > 8192 / 1:
            out.append(f / s.rope_scaling_factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append((1 - smooth) * f / s.rope_scaling_factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def reference_logits(w: dict[str, torch.Tensor], tokens: list[int], s: DecoderShape = SHAPE) -> torch.Tensor:
    """[T, V] float64 logits of one unpadded sequence: every position recomputed, one head at a time."""
    hd = s.head_dim
    w = {k: v.double() for k, v in w.items()}
    n_tok = len(tokens)

    def rms(x, gain):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + s.norm_epsilon) * gain

    inv_freq = llama3_inv_freq(s)
    angle = torch.arange(n_tok, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]

    def rope(x):  # [T, hd]: rotate the pairs (i, i + hd/2) by angle i
        a, b = x[:, : hd // 2], x[:, hd // 2:]
        return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=-1)

    x = w["embed.weight"][torch.tensor(tokens)]
    future = torch.ones(n_tok, n_tok, dtype=torch.bool).triu(1)
    for i in range(s.num_layers):
        p = f"layers.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        q = h @ w[p + "q.weight"].T + w.get(p + "q.bias", 0.0)
        k = h @ w[p + "k.weight"].T + w.get(p + "k.bias", 0.0)
        v = h @ w[p + "v.weight"].T + w.get(p + "v.bias", 0.0)
        heads = []
        for head in range(s.num_attention_heads):
            group = head // (s.num_attention_heads // s.num_query_groups)
            qh, kh = q[:, head * hd:(head + 1) * hd], k[:, group * hd:(group + 1) * hd]
            if s.qk_layernorm:
                qh, kh = rms(qh, w[p + "q_norm.weight"]), rms(kh, w[p + "k_norm.weight"])
            qh, kh = rope(qh), rope(kh)
            scores = (qh @ kh.T / math.sqrt(hd)).masked_fill(future, -math.inf)
            heads.append(scores.softmax(-1) @ v[:, group * hd:(group + 1) * hd])
        x = x + torch.cat(heads, dim=-1) @ w[p + "o.weight"].T
        h = rms(x, w[p + "mlp_norm.weight"])
        x = x + (F.silu(h @ w[p + "gate.weight"].T) * (h @ w[p + "up.weight"].T)) @ w[p + "down.weight"].T
    return rms(x, w["final_norm.weight"]) @ w["lm_head.weight"].T


def reference_logprobs(w, prompt: list[int], response: list[int], temperature: float = 1.0,
                       shape: DecoderShape = SHAPE) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, from the reference forward."""
    seq = prompt + response
    logits = reference_logits(w, seq, shape)[len(prompt) - 1: len(seq) - 1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def weights():
    return make_weights()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_score_matches_reference_forward(variant):
    shape = VARIANTS[variant]
    weights = make_weights(shape=shape)
    eng = engine(weights, shape=shape)
    ps = prompts(6)
    responses = prompts(6, seed=2, max_len=5)  # ragged: left padding of prompt+response is exercised
    scored = eng.score(ps, responses, temperature=0.7)
    for p, r, got in zip(ps, responses, scored):
        assert got.dtype == torch.float32 and got.shape == (len(r),)
        torch.testing.assert_close(got.double(), reference_logprobs(weights, p, r, 0.7, shape), rtol=0, atol=2e-5)


def test_the_rope_scaling_case_reaches_every_regime():
    inv_freq = llama3_inv_freq(dataclasses.replace(VARIANTS["rope_scaling"], rope_scaling=False))
    wavelen = 2 * math.pi / inv_freq
    assert (wavelen < 2048).any() and (wavelen > 8192).any() and ((wavelen >= 2048) & (wavelen <= 8192)).any()


def test_any_of_several_eos_ids_ends_a_response(weights):
    ps = prompts(16)
    free = engine(weights).generate(ps, max_new_tokens=8, generator=torch.Generator().manual_seed(4))
    # the first sampled token of two responses becomes an end-of-sequence id
    ids = {free.response_ids[0][0], free.response_ids[1][0]}
    out = engine(weights, eos=tuple(ids)).generate(ps, max_new_tokens=8, generator=torch.Generator().manual_seed(4))
    for row in (0, 1):
        assert out.response_ids[row] == free.response_ids[row][:1] and out.finish_reasons[row] == "eos"


def test_kv_cache_generation_matches_recompute(weights):
    eng = engine(weights)
    ps = prompts(8)
    out = eng.generate(ps, max_new_tokens=9, temperature=0.8, generator=torch.Generator().manual_seed(3))
    assert isinstance(out, RolloutBatch) and out.prompt_ids == ps
    assert all(len(r) == 9 and reason == "length" for r, reason in zip(out.response_ids, out.finish_reasons))
    rescored = eng.score(ps, out.response_ids, temperature=0.8)
    for p, r, lp, again in zip(ps, out.response_ids, out.logprobs, rescored):
        # the reported log-probs are log_softmax(logits / T) of the sampled ids, T applied, top-p not
        torch.testing.assert_close(lp.double(), reference_logprobs(weights, p, r, 0.8), rtol=0, atol=2e-5)
        torch.testing.assert_close(lp, again, rtol=0, atol=2e-5)


def test_greedy_is_deterministic_and_follows_argmax(weights):
    eng = engine(weights)
    ps = prompts(5)
    greedy = eng.generate(ps, max_new_tokens=6, temperature=0.0, generator=torch.Generator().manual_seed(0))
    again = eng.generate(ps, max_new_tokens=6, temperature=0.0, generator=torch.Generator().manual_seed(99))
    tiny_nucleus = eng.generate(ps, max_new_tokens=6, temperature=1.0, top_p=1e-6,
                                generator=torch.Generator().manual_seed(5))
    assert greedy.response_ids == again.response_ids == tiny_nucleus.response_ids
    for p, r, lp in zip(ps, greedy.response_ids, greedy.logprobs):
        logits = reference_logits(weights, p + r)[len(p) - 1: -1]
        assert logits.argmax(-1).tolist() == r
        torch.testing.assert_close(lp.double(), torch.log_softmax(logits, -1).max(-1).values, rtol=0, atol=2e-5)


def test_sampling_is_reproducible_from_the_generator(weights):
    eng = engine(weights)
    ps = prompts(16)
    run = lambda seed: eng.generate(ps, max_new_tokens=8, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    a, b, c = run(7), run(7), run(8)
    assert a.response_ids == b.response_ids
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    assert a.response_ids != c.response_ids


def test_top_p_samples_only_from_the_nucleus(weights):
    peaked = {k: (v * 2.0 if k == "lm_head.weight" else v) for k, v in weights.items()}
    top_p, temperature = 0.6, 0.9
    ps = prompts(24, seed=4)
    out = engine(peaked).generate(ps, max_new_tokens=6, temperature=temperature, top_p=top_p,
                                  generator=torch.Generator().manual_seed(11))
    processed = engine(peaked, logprobs="processed").generate(ps, max_new_tokens=6, temperature=temperature,
                                                              top_p=top_p, generator=torch.Generator().manual_seed(11))
    assert processed.response_ids == out.response_ids  # the log-prob convention does not change sampling
    outside_tempered_mass = []
    for p, r, lp, lp_proc in zip(ps, out.response_ids, out.logprobs, processed.logprobs):
        probs = torch.softmax(reference_logits(peaked, p + r)[len(p) - 1: -1] / temperature, -1)
        for t, token in enumerate(r):
            # token j is in the nucleus iff the tokens strictly more likely than j hold < top_p of the mass
            mass_above = (probs[t][None, :] * (probs[t][None, :] > probs[t][:, None])).sum(-1)
            nucleus = mass_above < top_p
            assert nucleus[token]
            assert abs(lp[t].item() - probs[t, token].log().item()) < 2e-5
            assert abs(lp_proc[t].item() - (probs[t, token] / probs[t][nucleus].sum()).log().item()) < 2e-5
            outside_tempered_mass.append(1 - probs[t][nucleus].sum().item())
    assert max(outside_tempered_mass) > 0.05  # the truncation did remove real mass in this test


# ---- top-k (rollout.top_k): the k most likely tokens, before top-p, as vLLM ----------------------


def _draws(logits_V: torch.Tensor, rows: int = 4000, seed: int = 0, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` independent draws of one distribution through the engine's sampler: (tokens, log-probs)."""
    kwargs = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "mode": "tempered"} | kwargs
    return sample_tokens(logits_V.expand(rows, -1).clone(), kwargs["temperature"], kwargs["top_p"], kwargs["top_k"],
                   torch.Generator().manual_seed(seed), kwargs["mode"])


def test_top_k_keeps_the_k_most_likely_and_processed_log_probs_renormalise_over_them():
    logits_V = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9, 1.2, -0.4, 0.0])
    temperature, k = 0.8, 4
    kept = set(logits_V.topk(k).indices.tolist())  # no ties here: {1, 3, 5, 4}
    tokens, processed = _draws(logits_V, temperature=temperature, top_k=k, mode="processed")
    same_tokens, tempered = _draws(logits_V, temperature=temperature, top_k=k, mode="tempered")
    assert torch.equal(tokens, same_tokens)  # the log-prob convention does not change sampling
    assert set(tokens.tolist()) == kept  # never outside the k most likely; all of them drawn in 4000
    untruncated = torch.log_softmax(logits_V / temperature, -1)
    torch.testing.assert_close(tempered, untruncated[tokens], rtol=0, atol=1e-6)
    by_token = {t: lp for t, lp in zip(tokens.tolist(), processed.tolist())}
    assert math.fsum(math.exp(lp) for lp in by_token.values()) == pytest.approx(1.0, abs=1e-6)
    for t, lp in by_token.items():  # p(t) / p(kept)
        assert lp == pytest.approx(float(untruncated[t] - untruncated[sorted(kept)].logsumexp(0)), abs=1e-6)
    # every kept token drawn about as often as its renormalised probability says (4000 draws: sd <= 0.008)
    for t, lp in by_token.items():
        assert (tokens == t).float().mean().item() == pytest.approx(math.exp(lp), abs=0.04)


def test_top_k_ties_go_to_the_lower_token_ids_and_top_k_1_is_argmax():
    logits_V = torch.tensor([0.0, 3.0, 2.0, 2.0, 2.0, -1.0])
    tokens, processed = _draws(logits_V, top_k=2, mode="processed")
    assert set(tokens.tolist()) == {1, 2}  # exactly 2 kept: the tie at the 2nd value goes to token 2
    tied_max = torch.tensor([0.0, 5.0, 1.0, 5.0])
    tokens, processed = _draws(tied_max, top_k=1, mode="processed")
    assert set(tokens.tolist()) == {int(tied_max.argmax())} == {1}
    assert torch.equal(processed, torch.zeros_like(processed))  # the one kept token has all the mass
    everything, _ = _draws(logits_V, rows=200, top_k=len(logits_V))  # k >= vocabulary: no truncation
    off, _ = _draws(logits_V, rows=200, top_k=-1)
    untouched, _ = _draws(logits_V, rows=200, top_k=0)
    assert torch.equal(everything, untouched) and torch.equal(off, untouched)


def test_top_k_comes_before_top_p_and_top_p_measures_the_top_k_distribution():
    probs_V = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k=3 renormalises to (0.444, 0.333, 0.222): the mass before token 2 (0.778) reaches
    # top_p=0.75, so it goes; top-p on the untruncated distribution (0.7 before it) would keep it.
    tokens, processed = _draws(probs_V.log(), top_k=3, top_p=0.75, mode="processed")
    assert set(tokens.tolist()) == {0, 1}
    for t in (0, 1):
        expected = math.log(probs_V[t].item() / 0.7)
        assert processed[tokens == t].unique().tolist() == [pytest.approx(expected, abs=1e-6)]
    top_p_only, _ = _draws(probs_V.log(), top_p=0.75)
    assert set(top_p_only.tolist()) == {0, 1, 2}
    _, tempered = _draws(probs_V.log(), top_k=3, top_p=0.75, mode="tempered")
    torch.testing.assert_close(tempered, probs_V.log()[tokens], rtol=0, atol=1e-6)


def test_top_k_1_sampling_equals_greedy_generation(weights):
    eng, processed_eng = engine(weights), engine(weights, logprobs="processed")
    ps = prompts(6, seed=3)
    greedy = eng.generate(ps, max_new_tokens=6, temperature=0.0)
    top1 = eng.generate(ps, max_new_tokens=6, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(4))
    processed = processed_eng.generate(ps, max_new_tokens=6, temperature=0.7, top_k=1,
                                       generator=torch.Generator().manual_seed(4))
    assert top1.response_ids == greedy.response_ids == processed.response_ids
    for p, r, lp, lp_proc in zip(ps, top1.response_ids, top1.logprobs, processed.logprobs):
        # tempered: the untruncated log_softmax(logits / T); processed: the only kept token, log 1
        torch.testing.assert_close(lp.double(), reference_logprobs(weights, p, r, 0.7), rtol=0, atol=2e-5)
        assert torch.equal(lp_proc, torch.zeros_like(lp_proc))


def test_top_k_sample_groups_stay_within_the_k_most_likely_and_repeat_with_the_seed(weights):
    peaked = {k: (v * 2.0 if k == "lm_head.weight" else v) for k, v in weights.items()}
    eng, top_k, temperature = engine(peaked, logprobs="processed"), 3, 0.9
    ps = prompts(4, seed=5, min_len=2)
    out = eng.sample_groups(ps, n=6, seeds=[1, 2, 3, 4], max_new_tokens=6, temperature=temperature, top_k=top_k)
    again = eng.sample_groups(ps, n=6, seeds=[1, 2, 3, 4], max_new_tokens=6, temperature=temperature, top_k=top_k)
    other = eng.sample_groups(ps, n=6, seeds=[5, 6, 7, 8], max_new_tokens=6, temperature=temperature, top_k=top_k)
    assert out.response_ids == again.response_ids and out.response_ids != other.response_ids
    assert all(torch.equal(a, b) for a, b in zip(out.logprobs, again.logprobs))
    removed = []
    for p, r, lp in zip(out.prompt_ids, out.response_ids, out.logprobs):
        logp = torch.log_softmax(reference_logits(peaked, p + r)[len(p) - 1: -1] / temperature, -1)
        for t, token in enumerate(r):
            assert (logp[t] > logp[t, token] + 1e-6).sum() < top_k  # among the k most likely
            kept = logp[t].topk(top_k).indices
            assert lp[t].item() == pytest.approx((logp[t, token] - logp[t, kept].logsumexp(0)).item(), abs=2e-5)
            removed.append(1 - logp[t, kept].exp().sum().item())
    assert max(removed) > 0.05  # the truncation removed real mass in this test


def test_eos_stops_each_sequence_and_padding_does_not_leak(weights):
    ps = prompts(10, seed=5)
    free = engine(weights).generate(ps, max_new_tokens=8, temperature=0.0)
    eos = free.response_ids[0][2]  # a token that sample 0 emits at step 3
    out = engine(weights, eos=eos).generate(ps, max_new_tokens=8, temperature=0.0)
    for full, r, lp, reason in zip(free.response_ids, out.response_ids, out.logprobs, out.finish_reasons):
        if eos in full:
            stop = full.index(eos) + 1
            assert (r, reason) == (full[:stop], "eos")  # the EOS itself is part of the response
        else:
            assert (r, reason) == (full, "length")
        assert lp.shape == (len(r),)
    assert out.finish_reasons[0] == "eos" and len(out.response_ids[0]) <= 3  # stopped by step 3 at the latest
    # every row of the left-padded batch generates exactly what it generates alone
    for p, r, lp in zip(ps, out.response_ids, out.logprobs):
        alone = engine(weights, eos=eos).generate([p], max_new_tokens=8, temperature=0.0)
        assert alone.response_ids[0] == r
        torch.testing.assert_close(alone.logprobs[0], lp, rtol=0, atol=2e-5)


def test_generation_ends_when_every_sequence_hit_eos(weights):
    ps = [prompts(1, seed=6)[0]] * 4
    eos = engine(weights).generate(ps[:1], max_new_tokens=1, temperature=0.0).response_ids[0][0]
    out = engine(weights, eos=eos).generate(ps, max_new_tokens=8, temperature=0.0)
    assert out.response_ids == [[eos]] * 4 and out.finish_reasons == ["eos"] * 4
    assert [lp.shape for lp in out.logprobs] == [(1,)] * 4


@pytest.mark.parametrize("precision, low, high", [("bf16", 1e-3, 2e-2), ("fp8", 1e-2, 1e-1)])
def test_low_precision_differs_from_fp32_by_a_small_amount(precision, low, high):
    weights = make_weights(seed=3, std=0.15)
    ps, responses = prompts(16, seed=7), prompts(16, seed=8, min_len=6, max_len=6)
    exact = torch.cat(engine(weights).score(ps, responses))
    approx = torch.cat(engine(weights, precision).score(ps, responses))
    assert approx.dtype == torch.float32 and torch.isfinite(approx).all()
    mean_abs_diff = (approx - exact).abs().mean().item()
    assert low < mean_abs_diff < high, mean_abs_diff
    # the sampled path runs the same numerics: its log-probs differ from fp32 scoring as much
    out = engine(weights, precision).generate(ps, max_new_tokens=6, generator=torch.Generator().manual_seed(2))
    fp32_of_samples = torch.cat(engine(weights).score(ps, out.response_ids))
    assert low < (torch.cat(out.logprobs) - fp32_of_samples).abs().mean().item() < high


def test_fp8_mismatch_exceeds_bf16():
    weights = make_weights(seed=3, std=0.15)
    ps, responses = prompts(16, seed=7), prompts(16, seed=8, min_len=6, max_len=6)
    exact = torch.cat(engine(weights).score(ps, responses))
    diff = {p: (torch.cat(engine(weights, p).score(ps, responses)) - exact).abs().mean() for p in ("bf16", "fp8")}
    assert diff["fp8"] > 2 * diff["bf16"]


def test_e4m3_emulation_matches_torch_float8():
    special = torch.tensor([0.0, 448.0, -448.0, 500.0, 1e-9, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-6,
                            1.0625, 1.1875, 240.0, 232.0, 17.0, 19.0])  # ties round to even, saturation
    x = torch.cat([special, -special, torch.randn(4000) * 30, torch.randn(1000) * 0.01])
    assert torch.equal(round_to_e4m3(x), x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float())
    assert round_to_e4m3(torch.tensor([1.0625, 1.1875])).tolist() == [1.0, 1.25]


def test_fp8_qdq_is_per_tensor_with_amax_scale():
    w = torch.randn(64, 32) * 0.05
    q = fp8_e4m3_qdq(w)
    scale = w.abs().max() / E4M3_MAX
    assert torch.equal(q, (w / scale).to(torch.float8_e4m3fn).float() * scale)
    assert q.abs().max() == w.abs().max()  # the largest magnitude maps exactly onto 448
    normal = (w / scale).abs() >= 2.0**-6
    rel_err = ((q - w).abs() / w.abs())[normal]
    assert 0 < rel_err.max() <= 2.0**-4 + 1e-6  # half a unit in the last place of 3 mantissa bits
    assert torch.equal(fp8_e4m3_qdq(torch.zeros(3, 3)), torch.zeros(3, 3))


def test_fp8_leaves_lm_head_embedding_and_norms_in_bf16(weights):
    eng = engine(weights, "fp8")
    assert torch.equal(eng.weights.lm_head, weights["lm_head.weight"].bfloat16())
    assert torch.equal(eng.weights.embed, weights["embed.weight"].bfloat16())
    assert torch.equal(eng.weights.layers[0].attn_norm, weights["layers.0.attn_norm.weight"].bfloat16())
    assert torch.equal(eng.weights.layers[0].down, fp8_e4m3_qdq(weights["layers.0.down.weight"]).bfloat16())


def test_load_weights_rejects_bad_state_dicts(weights):
    eng = EmbeddedEngine(SHAPE)
    with pytest.raises(RuntimeError, match="load_weights"):
        eng.generate([[1]], max_new_tokens=1)
    with pytest.raises(ValueError, match="missing.*layers.1.up.weight"):
        eng.load_weights({k: v for k, v in weights.items() if k != "layers.1.up.weight"})
    with pytest.raises(ValueError, match="unexpected.*extra"):
        eng.load_weights({**weights, "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"layers.0.q.weight must be a float tensor of shape \(32, 32\)"):
        eng.load_weights({**weights, "layers.0.q.weight": torch.zeros(16, 31)})
    with pytest.raises(ValueError, match="empty"):
        engine(weights).generate([[1], []], max_new_tokens=1)


def test_load_weights_from_a_stream_keeps_the_old_weights_on_a_bad_one(weights):
    eng = engine(weights)
    before = eng.weights
    stream = iter([(name, tensor) for name, tensor in weights.items() if name != "layers.1.up.weight"])
    with pytest.raises(ValueError, match="missing.*layers.1.up.weight"):
        eng.load_weights(stream)
    assert eng.weights is before  # nothing half-loaded
    bumped = {name: tensor + 0.01 for name, tensor in weights.items()}
    eng.load_weights((name, tensor) for name, tensor in bumped.items())  # a generator, consumed once
    assert torch.equal(eng.weights.layers[1].down, bumped["layers.1.down.weight"])


def test_tied_model_may_leave_lm_head_out_of_the_stream():
    shape = dataclasses.replace(SHAPE, tie_embeddings=True)
    weights = make_weights(shape=shape)
    eng = EmbeddedEngine(shape)
    eng.load_weights((n, t) for n, t in weights.items() if n != "lm_head.weight")
    assert eng.weights.lm_head is eng.weights.embed


def test_weight_dtype_follows_the_precision():
    assert {p: EmbeddedEngine(SHAPE, precision=p).weight_dtype for p in ("fp32", "bf16", "fp8")} == {
        "fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}


def test_decoder_shape_validation():
    with pytest.raises(ValueError, match="num_query_groups"):
        DecoderShape(10, 32, 1, 4, 3, 64)
    with pytest.raises(ValueError, match="even"):
        DecoderShape(10, 12, 1, 4, 4, 64)
    assert DecoderShape(10, 32, 1, 4, 2, 64, kv_channels=16).head_dim == 16
    # the training model's config applies the same rules, with the same messages
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"):
        DecoderShape(10, 30, 1, 4, 4, 64)
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        DecoderShape(10, 32, 0, 4, 4, 64)
    with pytest.raises(ValueError, match="norm_epsilon must be > 0"):
        DecoderShape(10, 32, 1, 4, 4, 64, norm_epsilon=0.0)


@pytest.mark.parametrize("kwargs, field", [
    ({"engine": "vlm"}, "engine"), ({"precision": "fp16"}, "precision"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"n": 0}, "n "), ({"logprobs": "raw"}, "logprobs"), ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"tensor_parallel_size": 2}, "embedded engine runs the whole model"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"), ({"sleep_level": 3}, "sleep_level"),
    ({"max_model_len": 8, "max_new_tokens": 8}, "max_model_len")])
def test_rollout_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RolloutConfig(**kwargs)


def test_rollout_config_did_you_mean():
    with pytest.raises(ValueError, match='did you mean "embedded"'):
        RolloutConfig(engine="embeded")


MODEL = ModelConfig(**{f.name: getattr(SHAPE, f.name) for f in dataclasses.fields(DecoderShape)})


def test_make_engine(weights):
    eng = make_engine(RolloutConfig(precision="fp8"), MODEL, eos_token_id=EOS)
    assert isinstance(eng, EmbeddedEngine) and isinstance(eng, RolloutEngine)
    assert eng.precision == "fp8" and eng.eos_ids == (EOS,) and eng.shape == SHAPE


def test_sample_groups_depend_on_the_prompt_and_its_seed_only(weights):
    eng = engine(weights)
    ps = prompts(3, min_len=2)
    together = eng.sample_groups(ps, n=3, seeds=[11, 12, 13], max_new_tokens=6)
    assert len(together) == 9 and together.prompt_ids[3:6] == [ps[1]] * 3
    for i, p in enumerate(ps):  # alone, or after other prompts: the same samples, bit for bit
        alone = eng.sample_groups([p], n=3, seeds=[11 + i], max_new_tokens=6)
        assert alone.response_ids == together.response_ids[3 * i: 3 * i + 3]
        for a, b in zip(alone.logprobs, together.logprobs[3 * i: 3 * i + 3]):
            assert torch.equal(a, b)
    other = eng.sample_groups(ps[:1], n=3, seeds=[99], max_new_tokens=6)
    assert other.response_ids != together.response_ids[:3]  # the seed decides
    assert len(set(map(tuple, together.response_ids[:3]))) > 1  # the n samples of a prompt differ
    with pytest.raises(ValueError, match="one per prompt"):
        eng.sample_groups(ps, n=2, seeds=[1], max_new_tokens=4)


def test_engine_max_model_len_and_its_errors():
    cfg = RolloutConfig(max_new_tokens=8)
    assert engine_max_model_len(cfg, 64, 128) == 72
    assert engine_max_model_len(cfg, None, 128) == 128  # no prompt limit: the model's positions
    assert engine_max_model_len(RolloutConfig(max_new_tokens=8, max_model_len=100), 64, 128) == 100
    with pytest.raises(ValueError, match="max_position_embeddings=64: shorten data.max_prompt_length"):
        engine_max_model_len(cfg, 60, 64)
    with pytest.raises(ValueError, match="rollout.max_model_len=70 is shorter than data.max_prompt_length 64"):
        engine_max_model_len(RolloutConfig(max_new_tokens=8, max_model_len=70), 64, 128)
