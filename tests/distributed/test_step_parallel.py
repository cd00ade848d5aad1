"""One training step (step.train_minibatch) under TP / CP / PP / DP layouts (gloo, CPU) against a
plain-torch single-process reference on the whole batch.

The reference (`_torch_step`) uses `reference_forward` with autograd, the public correction and
loss functions and torch's Adam: it shares no code with the Megatron path except the correction
and loss math. Every parallel run builds the same seeded fp32 model, trains one mini-batch per
scenario and returns its loss, correction metrics, full gradients (neutral names) and full
weights after the Adam step. Scenarios cover decoupled and bypass mode, PPO and policy
gradient, and the four loss aggregations; the data has a real rollout mismatch (model
log-probs + noise) and two sequences (rows 0, 1) whose rollout log-prob of one token is 12 below
the model's (ratio e^12: rejected by the RS rules that bound it; with micro-batch size 2 the first
micro-batch is rejected entirely). The bypass PPO veto scenarios add two rows (2, 6) with a token
the engine gave probability ~1 but the model ~1/100: ratio ~0.01 < the veto threshold 0.05, so the
veto rejects them (pi_theta vs pi_rollout; with pi_old := pi_rollout it could never fire).
"""

import pytest
import torch

from tests.dist import hide_gpus, run_distributed

pytestmark = [
    pytest.mark.distributed,
]

CFG = dict(vocab_size=100, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=48, tie_embeddings=True, add_qkv_bias=True, max_position_embeddings=64)
SEED, BATCH, SEQ = 7, 8, 13
OPTIM = dict(lr=1e-2, clip_grad=1e6, adam_eps=1e-6)
TEMPERATURE = 0.9

SCENARIOS = {
    "dec_ppo_tok": dict(
        correction=dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                        rollout_rs="geometric", rollout_rs_threshold=1.1, rollout_token_veto_threshold=1e-4),
        loss=dict(loss_type="ppo_clip", loss_agg_mode="token-mean", entropy_coeff=0.01)),
    "dec_pg_stm": dict(
        correction=dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token", rollout_rs_threshold=1.6),
        loss=dict(loss_type="policy_gradient", loss_agg_mode="seq-mean-token-mean")),
    "byp_ppo_sts": dict(
        correction=dict(rollout_is="token", rollout_is_threshold=2.0, bypass_mode=True,
                        rollout_token_veto_threshold=1e-4),
        loss=dict(loss_type="ppo_clip", loss_agg_mode="seq-mean-token-sum")),
    "byp_pg_stm": dict(
        correction=dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token", rollout_rs_threshold=1.6,
                        rollout_token_veto_threshold=1e-4, bypass_mode=True, use_policy_gradient=True),
        loss=dict(loss_agg_mode="seq-mean-token-mean")),
    # Bypass PPO with token RS and a veto that fires on rows 2 and 6 (pi_theta vs pi_rollout).
    "byp_ppo_veto": dict(
        correction=dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token", rollout_rs_threshold=1.6,
                        rollout_token_veto_threshold=0.05, bypass_mode=True),
        loss=dict(loss_type="ppo_clip", loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01)),
    # The same with other advantages on the vetoed rows: the gradient must not change.
    "byp_ppo_veto_adv": None,
    # Dr. GRPO's aggregation: the loss's sum / (sequences x F), actor/entropy verl's sum / F.
    "dec_ppo_stsn": dict(
        correction=dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token", rollout_rs_threshold=1.6),
        loss=dict(loss_type="ppo_clip", loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16.0,
                  entropy_coeff=0.01)),
    "all_rejected": dict(
        correction=dict(rollout_is="token", rollout_token_veto_threshold=0.5),
        loss=dict(loss_type="ppo_clip", loss_agg_mode="token-mean")),
}
SCENARIOS["byp_ppo_veto_adv"] = SCENARIOS["byp_ppo_veto"]
VETOED_ROWS, VETOED_POS = (2, 6), 6  # both in the response; under cp2 position 6 lies on CP rank 1 only
NONEMPTY_ROWS = 7  # row 5 is empty

# (tp, pp, cp, world) -> [(scenario, micro_batch_size[, max_tokens_per_micro_batch])]; bypass
# policy gradient corrects per micro-batch, so its metrics match the reference only with one
# micro-batch per DP rank. Runs with a token budget pack the sequences (THD); every budget here
# makes several micro-batches of uneven sizes (checked by test_packed_runs_make_several_micro_batches).
LAYOUTS = {
    "tp2": ((2, 1, 1, 2), [("dec_ppo_tok", 2), ("byp_pg_stm", 8), ("byp_ppo_sts", 1, 20)]),
    "cp2": ((1, 1, 2, 2), [("dec_ppo_tok", 4), ("byp_ppo_sts", 2), ("byp_ppo_veto", 2), ("dec_pg_stm", 1, 10),
                           ("byp_ppo_veto", 1, 12)]),
    "pp2": ((1, 2, 1, 2), [("dec_pg_stm", 2), ("byp_ppo_sts", 4), ("all_rejected", 2), ("byp_ppo_veto", 1),
                           ("dec_ppo_tok", 1, 16)]),
    "dp2": ((1, 1, 1, 2), [("byp_pg_stm", 4), ("dec_pg_stm", 2), ("byp_ppo_veto_adv", 2), ("dec_pg_stm", 1, 12),
                           ("dec_ppo_stsn", 2)]),
    "cp4": ((1, 1, 4, 4), [("byp_ppo_veto", 4), ("dec_ppo_tok", 1, 6), ("byp_ppo_sts", 1, 8)]),
    "tp2cp2": ((2, 1, 2, 4), [("dec_pg_stm", 2), ("byp_pg_stm", 8), ("byp_ppo_sts", 1, 10)]),
    "tp2pp2": ((2, 2, 1, 4), [("dec_ppo_tok", 2), ("byp_pg_stm", 8), ("dec_pg_stm", 1, 16)]),
    "cp2pp2": ((1, 2, 2, 4), [("byp_ppo_sts", 2), ("dec_ppo_tok", 4), ("dec_ppo_tok", 1, 10)]),
    "tp2cp2pp2": ((2, 2, 2, 8), [("dec_ppo_tok", 2), ("byp_pg_stm", 8)]),
}


# ---- data and the plain-torch reference ---------------------------------------------------------

def _make_batch(weights, cfg, scenario):
    """Right-padded prompts + responses; rollout log-probs = the model's (tempered) + noise."""
    from megatron_rlcorr.model.reference import reference_forward

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    mask = torch.zeros(BATCH, SEQ)
    for i in range(BATCH):
        prompt, length = 2 + i % 3, 3 + (5 * i) % 8
        end = min(prompt + length, SEQ - 1)
        tokens[i, end + 1:] = 0
        mask[i, prompt:end] = 1
    mask[5] = 0  # an empty sequence
    targets = torch.cat([tokens[:, 1:], torch.zeros(BATCH, 1, dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = reference_forward(weights, cfg, tokens) / TEMPERATURE
        model_lp = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    rollout = model_lp + 0.15 * torch.randn(BATCH, SEQ, generator=gen)
    rollout[0, 4] -= 12.0  # catastrophic tokens: rows 0 and 1 are vetoed
    rollout[1, 5] -= 12.0
    if scenario == "all_rejected":
        rollout = rollout + 5.0  # far above the model: every sequence is vetoed
    if scenario.startswith("byp_ppo_veto"):
        for row in VETOED_ROWS:  # the engine was sure (prob ~1), the model is not (~1/100): vetoed
            rollout[row, VETOED_POS] = 0.0
    rollout = torch.where(mask > 0, rollout.clamp(max=-1e-3), torch.nan)  # garbage where masked
    advantages = torch.randn(BATCH, 1, generator=gen).expand(BATCH, SEQ).contiguous()
    if scenario == "byp_ppo_veto_adv":
        advantages[list(VETOED_ROWS)] = torch.tensor([[25.0], [-40.0]])
    return dict(tokens_BT=tokens, targets_BT=targets, response_mask_BT=mask, rollout_log_probs_BT=rollout,
                advantages_BT=advantages)


def _step_config(scenario, micro_batch_size, max_tokens=0):
    from megatron_rlcorr.config import RolloutCorrectionConfig
    from megatron_rlcorr.training.losses import LossConfig
    from megatron_rlcorr.training.step import StepConfig

    spec = SCENARIOS[scenario]
    return StepConfig(loss=LossConfig(**spec["loss"]), correction=RolloutCorrectionConfig(**spec["correction"]),
                      micro_batch_size=micro_batch_size, temperature=TEMPERATURE,
                      max_tokens_per_micro_batch=max_tokens)


def _torch_step(cfg, weights, data, step_cfg):
    """Loss, correction metrics, gradients, grad norm and post-Adam weights on one process."""
    import dataclasses

    from megatron_rlcorr.correction import compute_rollout_correction
    from megatron_rlcorr.training.losses import global_loss_normalizers, policy_loss
    from megatron_rlcorr.model.reference import reference_forward

    leaves = {k: v.clone().requires_grad_() for k, v in weights.items() if k != "lm_head.weight"}
    logits = reference_forward(leaves, cfg, data["tokens_BT"]) / step_cfg.temperature
    log_prob = logits.log_softmax(-1).gather(-1, data["targets_BT"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    mask, rollout = data["response_mask_BT"], data["rollout_log_probs_BT"]
    corr_cfg, loss_cfg = step_cfg.correction, step_cfg.loss
    if step_cfg.use_policy_gradient:
        loss_cfg = dataclasses.replace(loss_cfg, loss_type="policy_gradient")
    # The correction always compares the current policy (detached; equal to pi_old before the
    # update) with the rollout. Bypass: pi_old := pi_rollout in the loss, normalisers before
    # rejection, and PPO takes no IS weights (its ratio pi_theta / pi_rollout is the weight).
    old = rollout if corr_cfg.bypass_mode else log_prob.detach()
    corr = compute_rollout_correction(log_prob.detach(), rollout, mask, corr_cfg)
    normalizer = global_loss_normalizers([mask if corr_cfg.bypass_mode else corr.response_mask],
                                         loss_cfg.loss_agg_mode, loss_scale_factor=step_cfg.loss_scale_factor)[0]
    bypass_ppo = corr_cfg.bypass_mode and not step_cfg.use_policy_gradient
    out = policy_loss(log_prob, old, data["advantages_BT"], corr.response_mask, loss_cfg, normalizer=normalizer,
                      is_weights=None if bypass_ppo else corr.is_weights,
                      entropy=entropy if loss_cfg.entropy_coeff else None)
    out.loss.backward()
    grads = {k: v.grad.clone() for k, v in leaves.items()}
    grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).float()
    adam = torch.optim.Adam(leaves.values(), lr=OPTIM["lr"], eps=OPTIM["adam_eps"])
    adam.step()
    after = {k: v.detach() for k, v in leaves.items()}
    grads["lm_head.weight"], after["lm_head.weight"] = grads["embed.weight"], after["embed.weight"]
    # actor/pg_loss is the policy-gradient term alone; the entropy bonus is its own term
    # actor/entropy: decoupled mode, pi_old's entropy (the weights before the update) over the response
    # mask with the recipe's aggregation (verl's agg_loss); bypass mode, the loss's entropy term / -coeff.
    old_entropy = _verl_agg_loss(entropy.detach(), mask, loss_cfg.loss_agg_mode, step_cfg.loss_scale_factor)
    return dict(loss=out.terms["pg_loss"], entropy_loss=out.terms.get("entropy_loss"), metrics=corr.metrics,
                grads=grads, grad_norm=grad_norm, after=after, old=log_prob.detach(), mask=corr.response_mask,
                old_entropy=None if corr_cfg.bypass_mode else old_entropy)


def _verl_agg_loss(values, mask, agg_mode, loss_scale_factor):
    """verl's agg_loss(values, mask, agg_mode, loss_scale_factor) over the whole batch, written out
    (independent of losses.aggregate_over_batch, which the Megatron path's actor/entropy uses)."""
    valid = mask > 0
    values = torch.where(valid, values, 0.0).double()
    seq_sums, seq_tokens = values.sum(-1), valid.double().sum(-1)
    nonempty = seq_tokens > 0
    if agg_mode == "token-mean":
        return (seq_sums.sum() / seq_tokens.sum()).float()
    if agg_mode == "seq-mean-token-sum":
        return seq_sums[nonempty].mean().float()
    if agg_mode == "seq-mean-token-mean":
        return (seq_sums[nonempty] / seq_tokens[nonempty]).mean().float()
    return (seq_sums.sum() / loss_scale_factor).float()  # seq-mean-token-sum-norm: no sequence count


# ---- the Megatron worker ----------------------------------------------------------------------


def _export_grads(chunks, groups):
    """Full gradients (DDP main_grad buffers) in neutral names, through export_full_weights.
    The distributed optimizer leaves each DP x CP rank only its reduced shard of the buffers:
    they are all-gathered first (as DDP gathers the weights)."""
    from megatron_rlcorr.model.weights import export_full_weights

    _gather_grad_shards(chunks, groups)
    params = [p for chunk in chunks for p in chunk.parameters()]
    saved = [p.data.clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.data.copy_(p.main_grad)
        grads = export_full_weights(chunks, groups)
        for p, data in zip(params, saved):
            p.data.copy_(data)
    return grads


def _gather_grad_shards(chunks, groups):
    import torch.distributed as dist

    size, me = dist.get_world_size(groups.dp_cp), dist.get_rank(groups.dp_cp)
    for chunk in chunks:
        if not chunk.ddp_config.use_distributed_optimizer or size == 1:
            continue
        for buffer in chunk.buffers:
            for bucket in buffer.buckets:
                shards = list(bucket.grad_data.view(size, -1).unbind(0))
                mine = shards[me].clone()
                dist.all_gather(shards, mine, group=groups.dp_cp)


def _train_worker(rank, world, tp, pp, cp, runs, batches, vpp=None, optim=None, recompute=None):
    """For each (scenario, micro_batch_size[, max_tokens]): fresh model, one train_minibatch,
    results (max_tokens > 0: packed micro-batches of that many tokens per rank)."""
    hide_gpus()
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import export_full_weights
    from megatron_rlcorr.training.optimizer import build_model_and_optimizer
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.optimizer import OptimSettings, sync_params
    from megatron_rlcorr.training import schedule as schedule_module  # the update's log-probs: schedule.token_log_probs
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs_and_entropy, old_pass_entropy, train_minibatch

    enable_cpu_megatron()
    groups = build_parallel_groups(tp, pp, cp, vpp)
    entropy_flags = []  # compute_entropy of every log-prob call of the update pass

    def spy(*args, **kwargs):
        entropy_flags.append(kwargs.get("compute_entropy", False))
        return token_logprobs_and_entropy(*args, **kwargs)

    token_logprobs_and_entropy = schedule_module.token_logprobs_and_entropy
    rows = slice(groups.dp_rank * BATCH // groups.dp_size, (groups.dp_rank + 1) * BATCH // groups.dp_size)
    results = []
    for scenario, mbs, *packed in runs:
        max_tokens = packed[0] if packed else 0
        model_cfg = ModelConfig(**CFG, recompute=recompute)
        chunks, optimizer, scheduler = build_model_and_optimizer(model_cfg, OptimSettings(**OPTIM, **(optim or {})),
                                                                 groups, seed=SEED, total_steps=4)
        batch = StepBatch(**{k: v[rows] for k, v in batches[scenario].items()})
        cfg = _step_config(scenario, mbs, max_tokens)
        old = old_entropy = None
        if not cfg.correction.bypass_mode:
            old, entropy = compute_old_log_probs_and_entropy(chunks, batch, groups=groups, micro_batch_size=mbs,
                                                             temperature=cfg.temperature,
                                                             max_tokens_per_micro_batch=max_tokens)
            old_entropy = None if old is None else old_pass_entropy(entropy, batch, cfg, groups)
        entropy_flags.clear()
        schedule_module.token_logprobs_and_entropy = spy
        try:
            result = train_minibatch(chunks, optimizer, batch, groups=groups, cfg=cfg, old_log_probs=old)
        finally:
            schedule_module.token_logprobs_and_entropy = token_logprobs_and_entropy
        unsynced = export_full_weights(chunks, groups)
        sync_params(chunks)
        results.append(dict(scenario=scenario, dp_rank=groups.dp_rank, old=old, old_entropy=old_entropy,
                            update_entropy_flags=list(entropy_flags), metrics=result.metrics,
                            update_successful=result.update_successful, grads=_export_grads(chunks, groups),
                            after=export_full_weights(chunks, groups), unsynced=unsynced,
                            recompute=chunks[0].config.recompute_granularity))
    return results


# ---- tests ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def references():
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import init_full_weights

    cfg = ModelConfig(**CFG)
    weights = init_full_weights(cfg, SEED)
    batches = {name: _make_batch(weights, cfg, name) for name in SCENARIOS}
    refs = {name: _torch_step(cfg, weights, batches[name], _step_config(name, BATCH)) for name in SCENARIOS}
    return dict(weights=weights, batches=batches, refs=refs)


def _assert_matches(result, ref, where):
    for name, value in ref["metrics"].items():
        torch.testing.assert_close(result["metrics"][name], value, rtol=1e-4, atol=1e-6, msg=lambda m, w=f"{where} {name}": f"{w}: {m}")
    torch.testing.assert_close(result["metrics"]["actor/pg_loss"], ref["loss"], rtol=1e-5, atol=1e-7,
                               msg=lambda m, w=f"{where} loss": f"{w}: {m}")
    if ref["entropy_loss"] is not None:
        torch.testing.assert_close(result["metrics"]["actor/entropy_loss"], ref["entropy_loss"], rtol=1e-5,
                                   atol=1e-7, msg=lambda m, w=f"{where} entropy loss": f"{w}: {m}")
    # The update computes the entropy only for the loss (entropy_coeff != 0); actor/entropy comes from
    # the pi_old pass, aggregated with loss_agg_mode (decoupled), or from the update's entropy term (bypass).
    coeff = SCENARIOS[result["scenario"]]["loss"].get("entropy_coeff", 0.0)
    assert set(result["update_entropy_flags"]) <= {coeff != 0}, where
    if result["old_entropy"] is not None:
        torch.testing.assert_close(result["old_entropy"], ref["old_entropy"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, w=f"{where} pi_old entropy": f"{w}: {m}")
    if ref["old_entropy"] is None and coeff:
        torch.testing.assert_close(result["metrics"]["actor/entropy"], ref["entropy_loss"] / -coeff, rtol=1e-5,
                                   atol=1e-6, msg=lambda m, w=f"{where} update entropy": f"{w}: {m}")
    else:
        assert "actor/entropy" not in result["metrics"], where
    # A zero gradient (every token rejected) is no update: training/optimizer.step_optimizer.
    assert result["update_successful"] == (float(ref["grad_norm"]) > 0), where
    for name in ref["grads"]:
        torch.testing.assert_close(result["grads"][name], ref["grads"][name], rtol=1e-4, atol=2e-7,
                                   msg=lambda m, w=f"{where} grad {name}": f"{w}: {m}")
        torch.testing.assert_close(result["after"][name], ref["after"][name], rtol=0, atol=1e-4,
                                   msg=lambda m, w=f"{where} weight {name}": f"{w}: {m}")
    torch.testing.assert_close(result["metrics"]["actor/grad_norm"], ref["grad_norm"], rtol=1e-4, atol=1e-8,
                               msg=lambda m, w=f"{where} grad norm": f"{w}: {m}")


def _check_old_log_probs(results, ref, scenario, dp_size):
    olds = [r["old"] for r in results if r["scenario"] == scenario and r["old"] is not None]
    if not olds:
        return
    per_dp = {}
    for r in results:
        if r["scenario"] == scenario and r["old"] is not None:
            per_dp.setdefault(r["dp_rank"], r["old"])
    old = torch.cat([per_dp[d] for d in range(dp_size)])
    mask = ref["batches"][scenario]["response_mask_BT"] > 0
    torch.testing.assert_close(old[mask], ref["refs"][scenario]["old"][mask], rtol=0, atol=2e-5)


SINGLE_PROCESS_RUNS = [("dec_ppo_tok", 1), ("dec_ppo_tok", 4), ("dec_pg_stm", 4), ("byp_ppo_sts", 1), ("byp_pg_stm", 8),
                       ("byp_ppo_veto", 4), ("dec_ppo_tok", 1, 16), ("byp_ppo_veto", 1, 12), ("dec_pg_stm", 1, 40),
                       ("byp_pg_stm", 1, 200), ("dec_ppo_stsn", 2), ("dec_ppo_stsn", 1, 16)]


def test_single_process_micro_batch_size_independent(references):
    """mbs 1, 4 and 8, and packed micro-batches, on one process give the reference's gradient
    (bypass policy gradient, whose correction metrics are per micro-batch by design, with one)."""
    runs = SINGLE_PROCESS_RUNS
    results = run_distributed(_train_worker, 1, 1, 1, 1, runs, references["batches"])[0]
    for run, result in zip(runs, results):
        _assert_matches(result, references["refs"][run[0]], f"1 process {run}")
        _assert_padding_fraction(result, references, run, cp=1, pp=1, dp=1)
    torch.testing.assert_close(results[0]["grads"]["embed.weight"], results[1]["grads"]["embed.weight"],
                               rtol=1e-5, atol=1e-8)


def _lengths(references, scenario):
    from megatron_rlcorr.training.microbatches import sequence_lengths

    return sequence_lengths(references["batches"][scenario]["response_mask_BT"]).tolist()


def _assert_padding_fraction(result, references, run, *, cp, pp, dp):
    """Padded: B x T_pad computed; packed without pipelining: each sequence rounded up to 2*cp."""
    from megatron_rlcorr.training.microbatches import round_up

    lengths = _lengths(references, run[0])
    multiple = 2 * cp if cp > 1 else 1
    padded = BATCH * round_up(SEQ, multiple) / sum(lengths) - 1
    packed = sum(round_up(n, multiple) for n in lengths) / sum(lengths) - 1
    got = float(result["metrics"]["batch/padding_fraction"])
    if len(run) < 3:
        assert got == pytest.approx(padded, rel=1e-6), run
    elif pp == 1:
        assert got == pytest.approx(packed, rel=1e-6), run
    else:  # every micro-batch as long as the longest
        assert packed - 1e-6 <= got < padded, run


def test_packed_runs_make_several_micro_batches(references):
    """The budgets of the packed runs above cut every rank's sequences into several micro-batches."""
    from megatron_rlcorr.training.microbatches import fewest_bins, round_up

    layouts = {"1": ((1, 1, 1, 1), SINGLE_PROCESS_RUNS), **LAYOUTS}
    for name, ((tp, pp, cp, world), runs) in layouts.items():
        dp = world // (tp * pp * cp)
        for scenario, _, *budget in runs:
            if not budget or budget[0] >= 200:
                continue
            lengths = _lengths(references, scenario)
            multiple = 2 * cp if cp > 1 else 1
            for d in range(dp):
                mine = [round_up(n, multiple) for n in lengths[d * BATCH // dp:(d + 1) * BATCH // dp]]
                assert fewest_bins(mine, budget[0] * cp) >= 2, (name, scenario, d)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, references):
    (tp, pp, cp, world), runs = LAYOUTS[layout]
    all_results = run_distributed(_train_worker, world, tp, pp, cp, runs, references["batches"])
    dp_size = world // (tp * pp * cp)
    for i, run in enumerate(runs):
        scenario = run[0]
        results = [rank_results[i] for rank_results in all_results]
        ref = references["refs"][scenario]
        for rank, result in enumerate(results):
            _assert_matches(result, ref, f"{layout} rank {rank} {run}")
            _assert_padding_fraction(result, references, run, cp=cp, pp=pp, dp=dp_size)
        _check_old_log_probs(results, references, scenario, dp_size)
        if scenario == "all_rejected":
            _assert_all_rejected(results, references["weights"])
        if scenario == "byp_ppo_veto_adv":  # other advantages on the vetoed rows: byp_ppo_veto's gradient
            for rank, result in enumerate(results):
                _assert_matches(result, references["refs"]["byp_ppo_veto"], f"{layout} rank {rank} vetoed rows")


# Megatron-Core's distributed optimizer (on by default, so LAYOUTS above run it) without it, and
# with gradient-reduce / weight-gather overlap: (tp, pp, cp, world), runs, optim settings.
OPTIMIZER_LAYOUTS = {
    "dp2_plain_adam": ((1, 1, 1, 2), [("dec_pg_stm", 2), ("byp_ppo_sts", 1, 12)],
                       dict(use_distributed_optimizer=False)),
    "dp2_overlap": ((1, 1, 1, 2), [("dec_pg_stm", 2), ("byp_ppo_sts", 1, 12)],
                    dict(overlap_grad_reduce=True, overlap_param_gather=True)),
    "pp2dp2_overlap": ((1, 2, 1, 4), [("dec_ppo_tok", 1), ("dec_pg_stm", 1, 16)],
                       dict(overlap_grad_reduce=True, overlap_param_gather=True)),
    "tp2cp2_overlap_grads": ((2, 1, 2, 4), [("byp_ppo_sts", 2)], dict(overlap_grad_reduce=True)),
}


@pytest.mark.parametrize("layout", list(OPTIMIZER_LAYOUTS))
def test_optimizer_settings_match_single_process(layout, references):
    """Gradients, grad norm and the weights after Adam equal the reference with and without the
    distributed optimizer and overlap. With overlap_param_gather the model's weights are stale
    until sync_params (or the next forward) gathers them."""
    (tp, pp, cp, world), runs, optim = OPTIMIZER_LAYOUTS[layout]
    all_results = run_distributed(_train_worker, world, tp, pp, cp, runs, references["batches"], None, optim)
    for i, run in enumerate(runs):
        for rank, rank_results in enumerate(all_results):
            result = rank_results[i]
            _assert_matches(result, references["refs"][run[0]], f"{layout} rank {rank} {run}")
            stale = max(float((result["unsynced"][k] - result["after"][k]).abs().max()) for k in result["after"])
            if optim.get("overlap_param_gather"):
                assert stale > 1e-4, "the weights were current before sync_params: nothing was deferred"
            else:
                assert stale == 0.0


# Activation recomputation (model.recompute) on the CPU path: (tp, pp, cp, world), runs, settings.
RECOMPUTE_LAYOUTS = {
    "tp2_full_uniform": ((2, 1, 1, 2), [("dec_ppo_tok", 2), ("byp_ppo_sts", 1, 20)],
                         dict(granularity="full", method="uniform", num_layers=1)),
    "pp2_full_block": ((1, 2, 1, 2), [("dec_pg_stm", 2)], dict(granularity="full", method="block", num_layers=1)),
    "cp2_selective_all": ((1, 1, 2, 2), [("dec_ppo_tok", 1, 10)],
                          dict(granularity="selective", modules=("core_attn", "mlp", "layernorm"))),
}


@pytest.mark.parametrize("layout", list(RECOMPUTE_LAYOUTS))
def test_recompute_matches_single_process(layout, references):
    """Recomputed activations give the reference's loss, gradients and weights."""
    (tp, pp, cp, world), runs, recompute = RECOMPUTE_LAYOUTS[layout]
    all_results = run_distributed(_train_worker, world, tp, pp, cp, runs, references["batches"], None, None, recompute)
    for i, run in enumerate(runs):
        for rank, rank_results in enumerate(all_results):
            assert rank_results[i]["recompute"] == recompute["granularity"]
            _assert_matches(rank_results[i], references["refs"][run[0]], f"{layout} rank {rank} {run}")


def test_bypass_ppo_veto_reference(references):
    """Bypass PPO: the veto fires on pi_theta vs pi_rollout (rows 2 and 6, with pi_old := pi_rollout
    it never could), the vetoed rows leave the loss and contribute exactly zero gradient, token
    RS removes the tokens whose ratio leaves [1/1.6, 1.6], and the loss takes no IS weights."""
    import dataclasses

    from megatron_rlcorr.model.config import ModelConfig

    refs, batches = references["refs"], references["batches"]
    ref, ref_adv = refs["byp_ppo_veto"], refs["byp_ppo_veto_adv"]
    metrics = ref["metrics"]
    torch.testing.assert_close(metrics["rollout_corr/rollout_is_veto_fraction"],
                               torch.tensor(len(VETOED_ROWS) / NONEMPTY_ROWS))
    assert float(metrics["rollout_corr/rollout_is_catastrophic_token_fraction"]) > 0
    assert 0 < float(metrics["rollout_corr/rollout_rs_masked_fraction"]) < 1
    assert float(metrics["rollout_corr/rollout_is_ratio_fraction_high"]) > 0  # IS metrics still reported
    mask = ref["mask"]
    assert float(mask[list(VETOED_ROWS)].abs().sum()) == 0.0
    assert float(mask.sum()) > 0
    # Other advantages on the vetoed rows: bit-identical loss and gradient.
    assert torch.equal(ref["loss"], ref_adv["loss"])
    for name, grad in ref["grads"].items():
        assert torch.equal(grad, ref_adv["grads"][name]), name
    # Control: without the veto the same change of advantages does change the gradient.
    cfg = ModelConfig(**CFG)
    no_veto = _step_config("byp_ppo_veto", BATCH)
    no_veto = dataclasses.replace(no_veto, correction=dataclasses.replace(
        no_veto.correction, rollout_token_veto_threshold=None))
    a = _torch_step(cfg, references["weights"], batches["byp_ppo_veto"], no_veto)
    b = _torch_step(cfg, references["weights"], batches["byp_ppo_veto_adv"], no_veto)
    assert float((a["grads"]["embed.weight"] - b["grads"]["embed.weight"]).abs().max()) > 1e-4
    # No IS weights in the PPO loss: with a larger IS threshold the loss and gradient are unchanged.
    wider = _step_config("byp_ppo_veto", BATCH)
    wider = dataclasses.replace(wider, correction=dataclasses.replace(wider.correction, rollout_is_threshold=50.0))
    c = _torch_step(cfg, references["weights"], batches["byp_ppo_veto"], wider)
    assert torch.equal(c["loss"], ref["loss"])


def _assert_all_rejected(results, weights):
    """Every token vetoed, PP=2: loss 0, zero gradient, unchanged weights, finite metrics."""
    for result in results:
        assert float(result["metrics"]["actor/pg_loss"]) == 0.0
        assert float(result["metrics"]["rollout_corr/rollout_is_veto_fraction"]) == 1.0
        assert all(torch.isfinite(v).all() for v in result["metrics"].values())
        assert all(float(g.abs().max()) == 0.0 for g in result["grads"].values())
        for name, value in weights.items():
            torch.testing.assert_close(result["after"][name], value, rtol=0, atol=0)


# ---- a zero gradient changes nothing --------------------------------------------------------------

def _zero_gradient_worker(rank, world, tp, pp, cp, batches):
    """A real step (dec_ppo_tok), then a step whose every token is rejected (all_rejected): the
    weights after each, and, as the control, the weights after Megatron's own optimizer.step()
    on the same zero gradient."""
    hide_gpus()
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import export_full_weights
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer, sync_params, zero_grads
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs, train_minibatch

    enable_cpu_megatron()
    groups = build_parallel_groups(tp, pp, cp)
    rows = slice(groups.dp_rank * BATCH // groups.dp_size, (groups.dp_rank + 1) * BATCH // groups.dp_size)
    chunks, optimizer, _ = build_model_and_optimizer(ModelConfig(**CFG), OptimSettings(**OPTIM), groups, seed=SEED,
                                                     total_steps=4)
    out = {}
    for name in ("dec_ppo_tok", "all_rejected"):
        batch = StepBatch(**{k: v[rows] for k, v in batches[name].items()})
        cfg = _step_config(name, 2)
        old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=2, temperature=cfg.temperature)
        result = train_minibatch(chunks, optimizer, batch, groups=groups, cfg=cfg, old_log_probs=old)
        sync_params(chunks)
        out[name] = dict(updated=result.update_successful, grad_norm=float(result.grad_norm),
                         after=export_full_weights(chunks, groups))
    zero_grads(chunks, optimizer)
    optimizer.step()  # what a plain Megatron step does with the same zero gradient
    sync_params(chunks)
    out["megatron_step"] = export_full_weights(chunks, groups)
    return out


@pytest.mark.parametrize("layout", ["single", "pp2", "dp2"])
def test_a_step_with_a_zero_gradient_changes_nothing(layout, references):
    """Adam moves weights on a zero gradient (its first moment); the step skips such an update on
    every rank, and the real step before it matches the single-process reference."""
    tp, pp, cp, world = {"single": (1, 1, 1, 1), "pp2": (1, 2, 1, 2), "dp2": (1, 1, 1, 2)}[layout]
    results = run_distributed(_zero_gradient_worker, world, tp, pp, cp, references["batches"])
    ref_after = references["refs"]["dec_ppo_tok"]["after"]
    for rank, r in enumerate(results):
        where = f"{layout} rank {rank}"
        assert r["dec_ppo_tok"]["updated"] and r["dec_ppo_tok"]["grad_norm"] > 0, where
        for name, value in ref_after.items():
            torch.testing.assert_close(r["dec_ppo_tok"]["after"][name], value, rtol=0, atol=1e-4,
                                       msg=lambda m, w=f"{where} {name}": f"{w}: {m}")
        assert not r["all_rejected"]["updated"] and r["all_rejected"]["grad_norm"] == 0.0, where
        for name, value in r["dec_ppo_tok"]["after"].items():
            assert torch.equal(r["all_rejected"]["after"][name], value), f"{where} {name} moved on a zero gradient"
        moved = max(float((r["megatron_step"][n] - v).abs().max()) for n, v in r["dec_ppo_tok"]["after"].items())
        assert moved > 1e-4, f"{where}: the control (Megatron's step on a zero gradient) should move the weights"


# ---- the decoupled correction once per RL step -------------------------------------------------

HALF = BATCH // 4  # rows per DP rank per mini-batch: dp2, two mini-batches of the step


def _step_correction_worker(rank, world, batch_full, scenario):
    """dp2: pi_old over each rank's half of the step batch, the correction once over the whole
    step, then the first mini-batch (the first HALF rows of each rank) trained with its slice."""
    hide_gpus()
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.rl.batch import slice_batch
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs, step_correction, train_minibatch

    enable_cpu_megatron()
    groups = build_parallel_groups(1, 1, 1)
    chunks, optimizer, _ = build_model_and_optimizer(ModelConfig(**CFG), OptimSettings(**OPTIM), groups,
                                                     seed=SEED, total_steps=4)
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    batch = StepBatch(**{k: v[rows] for k, v in batch_full.items()})
    cfg = _step_config(scenario, HALF)
    old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=HALF, temperature=cfg.temperature)
    correction, metrics = step_correction(old, batch, cfg.correction, groups)
    result = train_minibatch(chunks, optimizer, slice_batch(batch, 0, HALF), groups=groups, cfg=cfg,
                             old_log_probs=old[:HALF], correction=correction.rows(0, HALF))
    return dict(weights=correction.is_weights_BT, mask=correction.mask_BT, metrics=metrics,
                grads=_export_grads(chunks, groups), pg_loss=result.metrics["actor/pg_loss"])


def test_decoupled_correction_is_once_per_step_and_sliced_into_mini_batches(references):
    """Batch normalisation sees the whole step (every mini-batch, both DP ranks), as verl computes
    it; the first mini-batch trains with its slice of those weights and that mask (computed per
    mini-batch, the normalisation factor was the mini-batch's own)."""
    from megatron_rlcorr.correction import compute_rollout_correction
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.training.losses import global_loss_normalizers, policy_loss
    from megatron_rlcorr.model.reference import reference_forward

    scenario = "dec_ppo_tok"  # sequence IS with batch normalisation, geometric RS, veto
    data, weights = references["batches"][scenario], references["weights"]
    results = run_distributed(_step_correction_worker, 2, data, scenario)
    step_cfg = _step_config(scenario, HALF)
    old = references["refs"][scenario]["old"]
    whole = compute_rollout_correction(old, data["rollout_log_probs_BT"], data["response_mask_BT"],
                                       step_cfg.correction)
    weights_dp = torch.cat([r["weights"] for r in results])
    torch.testing.assert_close(weights_dp, whole.is_weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([r["mask"] for r in results]), whole.response_mask)
    for name, value in whole.metrics.items():
        torch.testing.assert_close(results[0]["metrics"][name], value, rtol=1e-4, atol=1e-6)
    # the first mini-batch: rows [0, HALF) of each rank, with the step's weights and mask
    mb_rows = torch.tensor([*range(HALF), *range(BATCH // 2, BATCH // 2 + HALF)])
    cfg = ModelConfig(**CFG)
    leaves = {k: v.clone().requires_grad_() for k, v in weights.items() if k != "lm_head.weight"}
    logits = reference_forward(leaves, cfg, data["tokens_BT"][mb_rows]) / step_cfg.temperature
    log_prob = logits.log_softmax(-1).gather(-1, data["targets_BT"][mb_rows].unsqueeze(-1)).squeeze(-1)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    mask = whole.response_mask[mb_rows]
    normalizer = global_loss_normalizers([mask], step_cfg.loss.loss_agg_mode)[0]
    out = policy_loss(log_prob, old[mb_rows], data["advantages_BT"][mb_rows], mask, step_cfg.loss,
                      normalizer=normalizer, is_weights=whole.is_weights[mb_rows], entropy=entropy)
    out.loss.backward()
    for result in results:
        torch.testing.assert_close(result["pg_loss"], out.terms["pg_loss"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(result["grads"]["embed.weight"], leaves["embed.weight"].grad, rtol=1e-4, atol=2e-7)
    # the mini-batch's own batch normalisation would have given other weights
    own = compute_rollout_correction(old[mb_rows], data["rollout_log_probs_BT"][mb_rows], data["response_mask_BT"][mb_rows],
                                     step_cfg.correction)
    assert not torch.allclose(own.is_weights, whole.is_weights[mb_rows], rtol=1e-3)


# ---- FP8 alignment ----------------------------------------------------------------------------------

def _aligned_worker(rank, world, runs, batches, alignment):
    """_train_worker with the model's sequence multiple forced to `alignment` (what an FP8 model's
    TransformerConfig gives: microbatches.sequence_multiple), recording the token count of every
    model input of both passes."""
    hide_gpus()
    from megatron_rlcorr.training import local_batch

    seen = []
    import megatron.core.models.gpt.gpt_model as gpt_model

    forward, multiple = gpt_model.GPTModel.forward, local_batch.sequence_multiple

    def recording_forward(self, input_ids, *args, **kwargs):
        seen.append(tuple(input_ids.shape))
        return forward(self, input_ids, *args, **kwargs)

    local_batch.sequence_multiple = lambda config: alignment
    gpt_model.GPTModel.forward = recording_forward
    try:
        results = _train_worker(rank, world, 1, 1, 1, runs, batches)
    finally:  # the process outlives the case (tests/dist_pool.py)
        gpt_model.GPTModel.forward, local_batch.sequence_multiple = forward, multiple
    return results, seen


def test_fp8_alignment_pads_the_old_log_prob_pass_and_the_step(references):
    """Every micro-batch of both passes, padded and packed, reaches the model with a token count
    that is a multiple of 16 (Transformer Engine's FP8 GEMMs), and the results do not change."""
    runs = [("dec_ppo_tok", 2), ("dec_pg_stm", 1, 40)]
    results, seen = run_distributed(_aligned_worker, 1, runs, references["batches"], 16)[0]
    # padded: 4 micro-batches per pass; packed: 16-token sequences, two per 40-token micro-batch: 4
    assert len(seen) == 2 * 4 + 2 * 4
    for shape in seen:
        assert shape[-1] % 16 == 0, shape
    for run, result in zip(runs, results):
        _assert_matches(result, references["refs"][run[0]], f"aligned to 16 {run}")
    olds = [r["old"] for r in results]
    mask = references["batches"]["dec_ppo_tok"]["response_mask_BT"] > 0
    torch.testing.assert_close(olds[0][mask], references["refs"]["dec_ppo_tok"]["old"][mask], rtol=0, atol=2e-5)
