"""Rollout routing replay (training/routing_replay.py) on a tiny MoE GPTModel (gloo, CPU).

The "engine" routing is reference_forward's (the plain-torch oracle) on the seeded weights, recorded
for every response position and, on rows 0 and 2, the prompt positions (rl/batch.routed_experts builds
the StepBatch field from per-sample rows, as from a rollout engine). Each launch checks, per layout:
- unchanged weights: the trainer's free routing is the engine's (mismatch 0) and replay gives the same
  log-probs bit for bit;
- a perturbed router (noise on every router weight): free routing differs (the mismatch metric equals
  the oracle's count), and the replayed log-probs equal reference_forward replaying the engine's experts
  where recorded (the trainer's routing is the recorded one) and the free routing elsewhere;
- after every pass nothing is queued or targeted, and no replay of ours is in Megatron's global list.
One process also checks that full recompute under replay gives the same gradients as no recompute, and
that bypass mode's update pass measures the same mismatch as the pi_old pass. The parallel layouts
(pp2 x vpp2 x ep2 with padded micro-batches; tp2 with sequence parallelism x cp2 with packed ones) must give
the single process's log-probs and metrics (aux loss: one process, against the Switch formula).
"""
import pytest
import torch

from tests.dist import hide_gpus, run_distributed

pytestmark = [pytest.mark.distributed]

CFG = dict(vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=48, tie_embeddings=True, max_position_embeddings=64,
           moe=dict(num_experts=4, router_topk=2, ffn_hidden_size=16, dense_layers=(0,)))
SEED, BATCH, SEQ = 5, 4, 14
PROMPTS, RESPONSES = (3, 2, 4, 2), (7, 10, 5, 3)
NOISE = 0.5  # router perturbation: changes a good share of the top-k sets


def _model_cfg(**extra):
    from megatron_rlcorr.model.config import ModelConfig

    return ModelConfig(**{**CFG, **extra})


def _router_noise(layer: int, shape) -> torch.Tensor:
    return NOISE * torch.randn(shape, generator=torch.Generator().manual_seed(100 + layer))


class _Groups:
    """The rollout fields rl/batch.routed_experts reads (a RolloutGroups stand-in)."""

    def __init__(self, tokens, routing_BTLK):
        self.response_ids = [tokens[i, p:p + r].tolist() for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))]
        self._prompts = [tokens[i, :p].tolist() for i, p in enumerate(PROMPTS)]
        self.routed_experts = [routing_BTLK[i, p - 1:p - 1 + r].to(torch.uint8)
                               for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))]
        self.prompt_routed_experts = [routing_BTLK[i, :p - 1].to(torch.uint8) if i % 2 == 0 else None
                                      for i, p in enumerate(PROMPTS)]

    def prompt_ids(self):
        return self._prompts


def _data():
    """Tokens, masks and the engine's routing (reference_forward on the seeded weights)."""
    from megatron_rlcorr.model.reference import reference_forward
    from megatron_rlcorr.model.weights import init_full_weights
    from megatron_rlcorr.rl.batch import routed_experts

    cfg = _model_cfg()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long)
    mask = torch.zeros(BATCH, SEQ)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        tokens[i, :p + r] = torch.randint(1, CFG["vocab_size"], (p + r,), generator=gen)
        mask[i, p - 1:p - 1 + r] = 1
    weights = init_full_weights(cfg, SEED)
    routing = []
    with torch.no_grad():
        reference_forward(weights, cfg, tokens, routing=routing)
    engine_BTLK = routed_experts(_Groups(tokens, torch.stack(routing, dim=2)), SEQ)
    targets = torch.cat([tokens[:, 1:], torch.zeros(BATCH, 1, dtype=torch.long)], dim=1)
    return dict(tokens_BT=tokens, targets_BT=targets, response_mask_BT=mask,
                rollout_log_probs_BT=torch.full((BATCH, SEQ), -1.0),
                advantages_BT=torch.randn(BATCH, SEQ, generator=gen),
                routed_experts_BTLK=engine_BTLK), weights


def _perturb(chunks):
    with torch.no_grad():
        for chunk in chunks:
            for module in chunk.modules():
                if getattr(module, "router_replay", None) is not None:
                    module.weight.add_(_router_noise(module.layer_number - 1, module.weight.shape))


def _check_clean(chunks):
    """Nothing queued or targeted after a pass; Megatron's global list holds none of our replays."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_rlcorr.training.routing_replay import RoutingReplay

    driver = RoutingReplay.of(chunks)
    driver.check_empty()
    ours = {id(r) for r in driver.all_routers()}
    assert not any(id(r) in ours for r in RouterReplay.global_router_replay_instances)
    assert driver.active is None and not driver.in_forward
    return len(ours)


def _worker(rank, world, layout, data, checks):
    hide_gpus()
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer
    from megatron_rlcorr.training.routing_replay import routing_metrics
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs

    enable_cpu_megatron()
    tp, pp, cp, ep, sp = (layout.get(k, 1) for k in ("tp", "pp", "cp", "ep", "sp"))
    groups = build_parallel_groups(tp, pp, cp, layout.get("vpp"), sequence_parallel=bool(sp > 1), ep=ep)
    device = torch.device("cpu")
    rows = slice(groups.dp_rank * BATCH // groups.dp_size, (groups.dp_rank + 1) * BATCH // groups.dp_size)
    batch = StepBatch(**{k: v[rows] for k, v in data.items()})
    passes = dict(micro_batch_size=layout.get("mbs", 1), max_tokens_per_micro_batch=layout.get("max_tokens", 0),
                  temperature=1.0, groups=groups)
    out = dict(dp_rank=groups.dp_rank, last=groups.is_pipeline_last_stage(), rows=(rows.start, rows.stop))

    chunks, _, _ = build_model_and_optimizer(_model_cfg(), OptimSettings(lr=1e-3), groups, seed=SEED, total_steps=2)
    out["sequence_parallel"] = chunks[0].config.sequence_parallel
    for name, perturbed in (("same", False), ("perturbed", True)):
        if perturbed:
            _perturb(chunks)
        free = compute_old_log_probs(chunks, batch, routing_metrics=True, **passes)
        out[f"{name}_metrics"] = routing_metrics(chunks, groups, device)
        replayed = compute_old_log_probs(chunks, batch, routing_replay=True, **passes)
        out[f"{name}_free"], out[f"{name}_replay"] = free, replayed
        out["routers"] = _check_clean(chunks)

    if "recompute" in checks:
        out["grads"] = {}
        for recompute in (None, dict(granularity="full", method="uniform", num_layers=1)):
            out["grads"][bool(recompute)] = _update_grads(groups, batch, recompute)
    if "bypass" in checks:
        out["bypass_metrics"] = _bypass_metrics(groups, batch)
    if "aux" in checks:
        out["aux_metrics"], out["aux_oracle"] = _aux_loss(groups, batch)
    return out


def _step_cfg(bypass: bool):
    from megatron_rlcorr.config import RolloutCorrectionConfig
    from megatron_rlcorr.training.losses import LossConfig
    from megatron_rlcorr.training.step import StepConfig

    return StepConfig(loss=LossConfig(loss_type="policy_gradient"), micro_batch_size=2, routing_replay=True,
                      correction=RolloutCorrectionConfig(rollout_is="token", bypass_mode=bypass,
                                                         use_policy_gradient=bypass))


def _update_grads(groups, batch, recompute):
    """Gradients (by parameter name) of one replayed update on the perturbed model."""
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer
    from megatron_rlcorr.training.step import compute_old_log_probs, train_minibatch

    chunks, optimizer, _ = build_model_and_optimizer(_model_cfg(recompute=recompute), OptimSettings(lr=1e-3), groups,
                                                     seed=SEED, total_steps=2)
    assert chunks[0].config.recompute_granularity == (recompute and "full")
    _perturb(chunks)
    cfg = _step_cfg(bypass=False)
    old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=2, temperature=1.0, routing_replay=True)
    train_minibatch(chunks, optimizer, batch, groups=groups, cfg=cfg, old_log_probs=old)
    _check_clean(chunks)
    return {name: p.main_grad.clone() for name, p in chunks[0].named_parameters()}


def _aux_loss(groups, batch):
    """moe/aux_loss of a replayed update with aux_loss_coeff > 0, and the Switch load-balancing loss
    E * sum_e f_e P_e (f_e: share of the k * N routed slots, P_e: mean router probability), free
    top-k, per MoE layer and micro-batch from the router inputs a forward hook saw, averaged."""
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer
    from megatron_rlcorr.training.routing_replay import routing_metrics
    from megatron_rlcorr.training.step import compute_old_log_probs, train_minibatch

    moe = dict(CFG["moe"], aux_loss_coeff=0.01)
    chunks, optimizer, _ = build_model_and_optimizer(_model_cfg(moe=moe), OptimSettings(lr=1e-3), groups,
                                                     seed=SEED, total_steps=2)
    _perturb(chunks)
    losses = []

    def hook(router, args, _output):
        if not torch.is_grad_enabled():
            return
        logits = torch.nn.functional.linear(args[0].reshape(-1, args[0].shape[-1]), router.weight).detach()
        p, n, (e, k) = logits.softmax(-1), logits.shape[0], (logits.shape[-1], router.topk)
        counts = torch.zeros(e).index_add_(0, logits.topk(k).indices.reshape(-1), torch.ones(n * k))
        losses.append(e * ((counts / (n * k)) * p.mean(0)).sum())

    for module in chunks[0].modules():
        if getattr(module, "router_replay", None) is not None:
            module.register_forward_hook(hook)
    old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=2, temperature=1.0, routing_replay=True)
    train_minibatch(chunks, optimizer, batch, groups=groups, cfg=_step_cfg(bypass=False), old_log_probs=old)
    return routing_metrics(chunks, groups, torch.device("cpu")), torch.stack(losses).mean()


def _bypass_metrics(groups, batch):
    """Bypass mode (no pi_old pass): the update's forward measures the routing."""
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer
    from megatron_rlcorr.training.routing_replay import routing_metrics
    from megatron_rlcorr.training.step import train_minibatch

    chunks, optimizer, _ = build_model_and_optimizer(_model_cfg(), OptimSettings(lr=1e-3), groups, seed=SEED,
                                                     total_steps=2)
    _perturb(chunks)
    train_minibatch(chunks, optimizer, batch, groups=groups, cfg=_step_cfg(bypass=True))
    _check_clean(chunks)
    return routing_metrics(chunks, groups, torch.device("cpu"))


# ---- the oracle ---------------------------------------------------------------------------------

def _log_probs(logits, targets):
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _oracle(data, weights):
    """reference_forward's log-probs: free, and replaying the engine's experts where recorded (the
    perturbed router's free routing elsewhere), on the perturbed weights; and the mismatch fraction."""
    from megatron_rlcorr.model.reference import reference_forward

    cfg = _model_cfg()
    shape = cfg.decoder_shape
    perturbed = dict(weights)
    for layer in shape.moe_layers:
        name = f"layers.{layer}.router.weight"
        perturbed[name] = weights[name] + _router_noise(layer, weights[name].shape)
    engine = data["routed_experts_BTLK"].long()
    with torch.no_grad():
        routing = []
        free_logits = reference_forward(perturbed, cfg, data["tokens_BT"], routing=routing)
        free_BTLK = torch.stack(routing, dim=2)
        merged = torch.where(engine >= 0, engine, free_BTLK)
        replay_logits = reference_forward(perturbed, cfg, data["tokens_BT"], replay_BTLK=merged)
    mask = data["response_mask_BT"].bool()
    differs = (free_BTLK.sort(-1).values != engine.sort(-1).values).any(-1)  # [B, T, L]
    fractions = [differs[..., l][mask].float().mean() for l in range(len(shape.moe_layers))]
    return dict(free=_log_probs(free_logits, data["targets_BT"]), replay=_log_probs(replay_logits, data["targets_BT"]),
                mismatch=torch.stack(fractions).mean(), mask=mask)


def _merged(results, key):
    """A [B, T] pass result from the last pipeline stage of every DP rank."""
    parts = {}
    for r in results:
        if r["last"]:
            parts[r["rows"]] = r[key]
    return torch.cat([parts[k] for k in sorted(parts)])


@pytest.fixture(scope="module")
def single():
    data, weights = _data()
    result = run_distributed(_worker, 1, {"mbs": 2}, data, ("recompute", "bypass", "aux"))[0]
    return data, weights, result


def test_replay_single_process(single):
    data, weights, r = single
    oracle = _oracle(data, weights)
    mask = oracle["mask"]
    # The engine's routing (recorded for 3 MoE layers) is this model's own: no mismatch, replay changes nothing.
    assert data["routed_experts_BTLK"].shape == (BATCH, SEQ, 3, 2)
    assert r["same_metrics"]["moe/routing_mismatch_fraction"].item() == 0.0
    assert torch.equal(r["same_replay"], r["same_free"])
    assert r["routers"] == 3
    # Perturbed router: a real mismatch, counted as the oracle counts it; replay follows the engine.
    mismatch = r["perturbed_metrics"]["moe/routing_mismatch_fraction"]
    assert 0.1 < oracle["mismatch"] < 0.9
    torch.testing.assert_close(mismatch, oracle["mismatch"].float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(r["perturbed_free"][mask], oracle["free"][mask], rtol=0, atol=2e-5)
    torch.testing.assert_close(r["perturbed_replay"][mask], oracle["replay"][mask], rtol=0, atol=2e-5)
    assert (r["perturbed_replay"][mask] - r["perturbed_free"][mask]).abs().max() > 1e-3
    # Expert load of the routing used (free here): max / mean over experts, >= 1.
    assert r["perturbed_metrics"]["moe/expert_load_max_over_mean"] >= 1.0
    assert "moe/aux_loss" not in r["perturbed_metrics"]


def test_recompute_under_replay_gives_identical_gradients(single):
    _, _, r = single
    plain, recomputed = r["grads"][False], r["grads"][True]
    assert plain.keys() == recomputed.keys()
    router = [n for n in plain if "router" in n]
    assert router and all(plain[n].abs().sum() > 0 for n in router)  # the router gets gradients under replay
    for name in plain:
        assert torch.equal(plain[name], recomputed[name]), name


def test_aux_loss_metric_is_megatrons_load_balancing_loss(single):
    _, _, r = single
    assert r["aux_metrics"]["moe/aux_loss"] > 0.5
    torch.testing.assert_close(r["aux_metrics"]["moe/aux_loss"], r["aux_oracle"], rtol=1e-5, atol=0)


def test_bypass_update_measures_the_routing(single):
    _, _, r = single
    name = "moe/routing_mismatch_fraction"
    assert r["bypass_metrics"][name] == r["perturbed_metrics"][name]


# Two launches of 4 ranks cover every axis the targets are laid out over.
LAYOUTS = {
    "pp2_vpp2_ep2": dict(pp=2, vpp=2, ep=2, mbs=1),         # chunks hold some MoE layers; padded rows
    "tp2sp_cp2_packed": dict(tp=2, sp=2, cp=2, max_tokens=8),  # SP slices of zigzag THD shares
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_replay_parallel_layout_matches_single_process(single, name):
    data, _, r1 = single
    results = run_distributed(_worker, 4, LAYOUTS[name], data, ())
    assert {r["sequence_parallel"] for r in results} == {name.startswith("tp2sp")}
    # the MoE layers are 1, 2, 3: under pp2 x vpp2 stage 0 holds layers 0 and 2, stage 1 layers 1 and 3
    assert sorted(r["routers"] for r in results) == ([1, 1, 2, 2] if name.startswith("pp2") else [3] * 4)
    mask = data["response_mask_BT"].bool()
    for key in ("same_free", "same_replay", "perturbed_free", "perturbed_replay"):
        torch.testing.assert_close(_merged(results, key)[mask], r1[key][mask], rtol=0, atol=2e-5)
    for r in results:  # the metrics are the same on every rank, and the single process's
        for key in ("same_metrics", "perturbed_metrics"):
            assert r[key].keys() == r1[key].keys()
            for metric, value in r[key].items():
                torch.testing.assert_close(value, r1[key][metric], rtol=0, atol=1e-6)


# ---- the trainer --------------------------------------------------------------------------------

def test_trainer_replays_the_engines_routing(tmp_path):
    """Two-step runs of recipes/tiny_cpu.yaml with a MoE model (16 experts, top-4, aux loss) and an
    fp8 embedded engine that records its routing, with and without rollout.routing_replay: the step's
    MoE metrics are logged; step 1 (same weights, same rollouts) measures the same free-routing
    mismatch either way; replay brings the trainer's pi_old closer to the engine (smaller k3) and the
    reference replays too, so the KL loss starts at exactly 0."""
    from pathlib import Path

    from tests.runs import train_runs

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
    moe = "model.moe={num_experts: 16, router_topk: 4, ffn_hidden_size: 16, dense_layers: [0], aux_loss_coeff: 0.01}"
    common = ["data.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=4", "trainer.save_every=0",
              "trainer.logger=[console]", "trainer.steps=2", "rollout.precision=fp8", "algorithm.kl_loss.enabled=true",
              moe]
    runs = [(recipe, [*common, f"trainer.output_dir={tmp_path / flag}", f"rollout.routing_replay={flag}"])
            for flag in ("true", "false")]
    replay, free = run_distributed(train_runs, 1, runs)[0]
    for records in (replay, free):
        assert [r["step"] for r in records] == [1, 2]
        for r in records:
            assert {"moe/routing_mismatch_fraction", "moe/expert_load_max_over_mean", "moe/aux_loss"} <= r.keys()
            assert r["moe/expert_load_max_over_mean"] >= 1.0 and 0.5 < r["moe/aux_loss"] < 2.0
    first_replay, first_free = replay[0], free[0]
    assert first_replay["moe/routing_mismatch_fraction"] == first_free["moe/routing_mismatch_fraction"] > 0
    assert first_replay["rollout_corr/k3_kl"] < first_free["rollout_corr/k3_kl"]
    assert first_replay["actor/pg_loss"] != first_free["actor/pg_loss"]
    assert first_replay["actor/kl_loss"] == 0.0 and first_free["actor/kl_loss"] == 0.0
