"""Trainer offload (training/offload.py) releases the states' memory and changes nothing.

dp2 over gloo (CPU: the "device" is the CPU and the host copy a second buffer, so the mechanism
is the one a GPU runs): the same seeded model trains three steps without offload and with the
params, gradients and optimizer state offloaded and reloaded before every step. While offloaded,
every storage that held them has size 0 (parameters, the DDP buffers, main_grad, the master
weights and Adam's moments: what a view would read is gone), the released bytes cover them,
and the host holds copies of the weights and the optimizer state but not of the gradients.
After reloading, the losses, gradient norms and final weights equal the run without offload
bit for bit. Layouts: the distributed optimizer with fp32 weights (its master weights are views
into DDP's parameter buffer) and with bf16 weights (separate fp32 masters), and the plain
optimizer (parameters outside any buffer).
"""

import pytest
import torch

from tests.dist import hide_gpus, run_distributed

pytestmark = [
    pytest.mark.distributed,
]

CFG = dict(vocab_size=100, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=48, tie_embeddings=True, add_qkv_bias=True, max_position_embeddings=64)
SCENARIOS = ["dec_ppo_tok", "dec_pg_stm", "dec_pg_stm"]


def _batches():
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import init_full_weights
    from tests.distributed.test_step_parallel import SEED, _make_batch

    cfg = ModelConfig(**CFG)
    weights = init_full_weights(cfg, SEED)
    return [_make_batch(weights, cfg, scenario) for scenario in SCENARIOS]


def _state_tensors(chunks, optimizer):
    """Every tensor offload must release: (name, tensor)."""
    from megatron_rlcorr.training.offload import _ddp_buffers
    from megatron_rlcorr.training.optimizer import inner_optimizers

    out = []
    for c, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            out += [(f"chunk{c}.{name}", param), (f"chunk{c}.{name}.main_grad", param.main_grad)]
        for b, buffer in enumerate(_ddp_buffers(chunk)):
            out.append((f"chunk{c}.buffer{b}.grad_data", buffer.grad_data))
            if buffer.param_data is not None:
                out.append((f"chunk{c}.buffer{b}.param_data", buffer.param_data))
    for i, inner in enumerate(inner_optimizers(optimizer)):
        for g, group in enumerate(inner.optimizer.param_groups):
            for j, param in enumerate(group["params"]):
                out.append((f"optimizer{i}.group{g}.master{j}", param))
                for key, value in inner.optimizer.state[param].items():
                    if isinstance(value, torch.Tensor):  # the moments, and Adam's step (0-d)
                        out.append((f"optimizer{i}.group{g}.master{j}.{key}", value))
    return out


def _worker(rank, world, batches, model_overrides, optim_overrides):
    hide_gpus()
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import export_full_weights
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.offload import TrainerOffload
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer, sync_params
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs, train_minibatch
    from tests.distributed.test_step_parallel import BATCH, _step_config

    enable_cpu_megatron()
    groups = build_parallel_groups(1, 1, 1, None)
    rows = slice(groups.dp_rank * BATCH // groups.dp_size, (groups.dp_rank + 1) * BATCH // groups.dp_size)
    out = {}
    for offload in (False, True):
        chunks, optimizer, _ = build_model_and_optimizer(
            ModelConfig(**CFG, **model_overrides), OptimSettings(lr=1e-2, adam_eps=1e-6, **optim_overrides), groups,
            seed=7, total_steps=4)
        mover = TrainerOffload(chunks, optimizer, params=offload, grads=offload, optimizer_states=offload,
                               device=torch.device("cpu"))
        run = {"losses": [], "grad_norms": [], "released": [], "checks": []}
        for step, scenario in enumerate(SCENARIOS):
            if offload:
                tensors = _state_tensors(chunks, optimizer)
                before = {name: t.untyped_storage().nbytes() for name, t in tensors}
                distinct = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in tensors}
                grad_bytes = sum(b.grad_data.untyped_storage().nbytes() for c in chunks for b in c.buffers)
                released = mover.offload()
                run["checks"].append({
                    "still_held": [name for name, t in tensors if t.untyped_storage().nbytes() != 0],
                    "released": released, "distinct_bytes": sum(distinct.values()), "grad_bytes": grad_bytes,
                    "host_bytes": mover.host_bytes(), "had_adam_state": any(".exp_avg" in n for n in before),
                    "second_offload": mover.offload()})
                mover.reload()
                run["not_restored"] = [(name, before[name], t.untyped_storage().nbytes()) for name, t in tensors
                                       if t.untyped_storage().nbytes() != before[name]]
            cfg = _step_config(scenario, 2)
            batch = StepBatch(**{k: v[rows] for k, v in batches[step].items()})
            old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=2, temperature=cfg.temperature)
            result = train_minibatch(chunks, optimizer, batch, groups=groups, cfg=cfg, old_log_probs=old)
            run["losses"].append(result.metrics["actor/pg_loss"].clone())
            run["grad_norms"].append(float(result.grad_norm))
        sync_params(chunks)
        run["weights"] = export_full_weights(chunks, groups)
        out["offload" if offload else "plain"] = run
    return out


@pytest.mark.parametrize("model_overrides, optim_overrides", [
    ({}, {}),                                          # distributed optimizer, fp32: masters are buffer views
    ({"bf16": True}, {}),                              # distributed optimizer, bf16: separate fp32 masters
    ({}, {"use_distributed_optimizer": False}),        # plain optimizer: parameters outside any buffer
], ids=["distopt_fp32", "distopt_bf16", "plain_fp32"])
def test_offload_releases_every_state_and_training_is_bit_identical(model_overrides, optim_overrides):
    results = run_distributed(_worker, 2, _batches(), model_overrides, optim_overrides)
    for rank, result in enumerate(results):
        plain, moved = result["plain"], result["offload"]
        for step, check in enumerate(moved["checks"]):
            assert check["still_held"] == [], (rank, step, check["still_held"][:5])
            assert check["released"] == check["distinct_bytes"] > 0, (rank, step, check)
            # Weights and optimizer state are kept on the host; gradients are dropped.
            assert check["host_bytes"] == check["released"] - check["grad_bytes"], (rank, step, check)
            assert check["second_offload"] == 0
        assert moved["checks"][-1]["had_adam_state"] and moved["not_restored"] == []
        assert [float(x) for x in moved["losses"]] == [float(x) for x in plain["losses"]]
        assert moved["grad_norms"] == plain["grad_norms"] and all(g > 0 for g in plain["grad_norms"])
        assert plain["weights"].keys() == moved["weights"].keys()
        for name in plain["weights"]:
            assert torch.equal(plain["weights"][name], moved["weights"][name]), (rank, name)


def test_a_run_with_trainer_offload_repeats_the_run_without(tmp_path):
    """The trainer offloads before every generation and reloads after it (rl/trainer.py): a dp=2
    run of the tiny recipe with all three offloads logs the same metrics as without (step 2's
    rollouts and loss come from step 1's update)."""
    from pathlib import Path

    from tests.runs import deterministic, train_runs

    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
    common = ["data.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=4", "trainer.logger=[console]",
              "trainer.steps=2", "trainer.save_every=0"]
    offload = ["model.offload_params=true", "model.offload_grads=true", "optim.offload_optimizer=true"]
    runs = [(tiny, [*common, f"trainer.output_dir={tmp_path}", f"name={name}", *extra])
            for name, extra in (("plain", []), ("offload", offload))]
    plain, moved = run_distributed(train_runs, 2, runs)[0]
    assert [r["step"] for r in moved] == [1, 2] and moved[-1]["grad_norm"] > 0
    assert [deterministic(r) for r in moved] == [deterministic(r) for r in plain]
