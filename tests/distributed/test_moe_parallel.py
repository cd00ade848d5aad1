"""Mixture-of-experts training under expert parallelism equals one process (gloo, CPU), and expert
weights survive a distributed checkpoint saved under one expert layout and loaded under another.

Two process launches. One process trains the tiny MoE models of tools/check_parallel_parity.py
(4 experts top-2 behind a dense first layer; and the same with a Qwen2-MoE shared expert and its
gate) for two RL steps (Megatron's Adam, lr warm-up then decay, the decoupled correction) with the
default allgather dispatcher: the references. Four processes then train the same models under
several expert layouts in turn (the process groups rebuilt for each) and must give the reference's
losses, grad norms, correction metrics and final weights (the tool's tolerances):

- pp2 x ep2: experts split over EP inside each pipeline stage, the 1F1B schedule;
- dp4 x ep2 with the alltoall dispatcher: two expert-data-parallel replicas of each expert half
  (their gradients reduced over the expert-DP group), the CPU stand-ins of parallel/cpu.py 13.;
- tp2 x dp2 x ep2 with sequence parallelism (required for MoE with tp > 1), alltoall, and with
  the shared expert (TP-split like a dense MLP) under allgather;
- dp4 x etp2 (ep 1): experts split over expert-TP ranks that are data-parallel replicas of the
  dense layers; megatron-core 0.16.1 reduced those halves as replicas (model/build.py
  _mark_expert_params).

In the same launch: alltoall with etp 2 is refused at build time (gloo cannot all-gather uneven
token counts), and a checkpoint written under pp2 x ep2 (fully_reshardable optimizer state) loads
under dp4 (ep 1) with the same weights, and the next step there equals the next step of the run
that wrote it (Adam's expert moments resharded too); saved again under ep 1 it loads back under
pp2 x ep2 with the same weights.
"""

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

from tests.dist import hide_gpus, run_distributed

pytestmark = [
    pytest.mark.distributed,
]

_spec = importlib.util.spec_from_file_location(
    "check_parallel_parity", Path(__file__).resolve().parents[2] / "tools" / "check_parallel_parity.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

ARGS = argparse.Namespace(mode="decoupled", loss="ppo", agg="token-mean", steps=2)
# (layout, model, dispatcher) on four processes; None: the default (allgather on the CPU)
LAYOUTS = [("pp2ep2", "routed", None), ("dp4ep2", "routed", "alltoall"), ("tp2dp2ep2", "routed", "alltoall"),
           ("tp2dp2ep2", "shared", None), ("dp4etp2", "routed", None)]
MODELS = {kind: tool.tiny_model([*(tool.parse_layout(name) for name, _, _ in LAYOUTS), tool.parse_layout("tp1")], kind)
          for kind in tool.MOE_KINDS}
SAVED, RELOADED = "pp2ep2", "dp4"  # the checkpoint's layouts (both four processes)


def _reference_worker(rank, world):
    hide_gpus()
    return {kind: tool.train_layout(ARGS, "tp1", MODELS[kind]) for kind in MODELS}


def _layouts_worker(rank, world, directory):
    hide_gpus()
    results = []
    for name, kind, dispatcher in LAYOUTS:
        layout = tool.parse_layout(name)
        assert tool.world_size(layout) == world, name
        sequence_parallel = tool.sequence_parallel(layout, argparse.Namespace(sequence_parallel=False, moe=kind))
        result = tool.train_layout(ARGS, name, MODELS[kind], sequence_parallel=sequence_parallel,
                                   dispatcher=dispatcher)
        results.append(result if rank == 0 else None)
    return dict(layouts=results, refused=_alltoall_with_expert_tp(), checkpoint=_checkpoint_round_trip(directory))


def _alltoall_with_expert_tp() -> str:
    """The error building an ep2 x etp2 model with the alltoall dispatcher on gloo."""
    from megatron_rlcorr.model.build import build_model_chunks
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups

    model = tool.tiny_model([tool.parse_layout("ep2etp2")], "routed")
    cfg = ModelConfig(**{**model, "moe": {**model["moe"], "token_dispatcher": "alltoall"}})
    groups = build_parallel_groups(1, 1, 1, ep=2, etp=2)
    try:
        build_model_chunks(cfg, groups, seed=tool.SEED)
    except ValueError as err:
        return str(err)
    finally:
        destroy_parallel_groups()
    return "built"


def _trainer(name: str):
    """(chunks, optimizer, scheduler, groups, a function training step k) for `name` and the routed model."""
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import export_full_weights, init_full_weights
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer, sync_params
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs, train_minibatch

    layout = tool.parse_layout(name)
    groups = build_parallel_groups(layout["tp"], layout["pp"], layout["cp"], ep=layout["ep"], etp=layout["etp"])
    cfg = ModelConfig(**MODELS["routed"])
    chunks, optimizer, scheduler = build_model_and_optimizer(cfg, OptimSettings(lr=1e-2, adam_eps=1e-6), groups,
                                                             seed=tool.SEED, total_steps=4)
    init = init_full_weights(cfg, tool.SEED)
    per_rank = tool.BATCH // groups.dp_size
    rows = slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)
    step_cfg = tool._step_config(ARGS, 2)

    def train(step: int) -> dict[str, torch.Tensor]:
        batch = StepBatch(**{k: v[rows] for k, v in tool._synthetic_batch(step, cfg, init).items()})
        old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=2, temperature=step_cfg.temperature)
        train_minibatch(chunks, optimizer, batch, groups=groups, cfg=step_cfg, old_log_probs=old)
        sync_params(chunks)
        return export_full_weights(chunks, groups)

    return chunks, optimizer, scheduler, groups, train


def _checkpoint_round_trip(directory: str) -> dict[str, dict[str, torch.Tensor]]:
    """Full weights: after step 0 under SAVED (saved), after step 1 there; loaded under RELOADED,
    its step 1; loaded back under SAVED from RELOADED's checkpoint."""
    from megatron_rlcorr.model.weights import export_full_weights
    from megatron_rlcorr.parallel.groups import destroy_parallel_groups
    from megatron_rlcorr.training import checkpoint

    def layout_of(name):
        layout = tool.parse_layout(name)
        return {key: layout[key] for key in ("tp", "pp", "cp", "vpp", "ep", "etp")}

    writer = checkpoint.CheckpointWriter(optimizer_format="fully_reshardable")
    run_a, run_b = Path(directory) / "saved", Path(directory) / "reloaded"
    out = {}

    def save(run, name, chunks, optimizer, scheduler, groups):
        writer.save(run, 1, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, groups=groups,
                    common={}, layout=layout_of(name))

    def load(run, name, chunks, optimizer, scheduler, groups):
        checkpoint.load(checkpoint.checkpoint_dir(run, 1), model_chunks=chunks, optimizer=optimizer,
                        scheduler=scheduler, groups=groups, layout=layout_of(name))
        return export_full_weights(chunks, groups)

    chunks, optimizer, scheduler, groups, train = _trainer(SAVED)
    out["saved"] = train(0)
    scheduler.step(1)
    save(run_a, SAVED, chunks, optimizer, scheduler, groups)
    out["saved_next"] = train(1)
    destroy_parallel_groups()

    chunks, optimizer, scheduler, groups, train = _trainer(RELOADED)
    out["reloaded"] = load(run_a, RELOADED, chunks, optimizer, scheduler, groups)
    save(run_b, RELOADED, chunks, optimizer, scheduler, groups)
    out["reloaded_next"] = train(1)
    destroy_parallel_groups()

    chunks, optimizer, scheduler, groups, _ = _trainer(SAVED)
    out["back"] = load(run_b, SAVED, chunks, optimizer, scheduler, groups)
    destroy_parallel_groups()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    references = run_distributed(_reference_worker, 1)[0]
    parallel = run_distributed(_layouts_worker, 4, str(tmp_path_factory.mktemp("moe_checkpoints")))
    return references, parallel


def test_expert_layouts_train_like_one_process(runs):
    references, parallel = runs
    for kind, ref in references.items():
        assert ref["moved"] > 1e-3, kind  # the reference trained
        assert ref["dispatcher"] == "allgather" and not ref["sequence_parallel"]
        init = _initial_weights(kind)
        experts = [name for name in ref["weights"] if ".experts." in name]
        assert len(experts) == 3 * 3 * 4  # 3 MoE layers x 4 experts x gate, up, down
        assert all(float((ref["weights"][name] - init[name]).abs().max()) > 1e-4 for name in experts), kind
        if kind == "shared":
            assert float((ref["weights"]["layers.1.shared_gate.weight"] - init["layers.1.shared_gate.weight"])
                         .abs().max()) > 1e-4
    for (name, kind, dispatcher), result in zip(LAYOUTS, parallel[0]["layouts"]):
        layout = tool.parse_layout(name)
        assert result["dispatcher"] == (dispatcher or "allgather"), name
        assert result["sequence_parallel"] == (layout["tp"] > 1), name
        diff = tool.compare(result, references[kind])
        assert all(diff[key] <= tool.TOL[key] for key in tool.TOL), (name, kind, diff)


def _initial_weights(kind):
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import init_full_weights

    return init_full_weights(ModelConfig(**MODELS[kind]), tool.SEED)


def test_alltoall_with_expert_tensor_parallelism_is_refused_on_gloo(runs):
    for rank_result in runs[1]:
        message = rank_result["refused"]
        assert "model.moe.token_dispatcher: alltoall with parallel.etp=2 needs NCCL" in message, message
        assert "token_dispatcher: allgather or parallel.etp: 1" in message


def test_expert_checkpoint_reshards_between_expert_layouts(runs):
    init = _initial_weights("routed")
    for rank, result in enumerate(runs[1]):
        ckpt = result["checkpoint"]
        assert ckpt["saved"].keys() == init.keys()
        assert max(float((ckpt["saved"][k] - init[k]).abs().max()) for k in init) > 1e-3  # trained before saving
        for name, value in ckpt["saved"].items():
            assert torch.equal(ckpt["reloaded"][name], value), f"rank {rank}: {name} loaded under ep1"
            assert torch.equal(ckpt["back"][name], value), f"rank {rank}: {name} loaded back under pp2 x ep2"
        for name, value in ckpt["saved_next"].items():
            torch.testing.assert_close(ckpt["reloaded_next"][name], value, rtol=0, atol=2e-6,
                                       msg=lambda m, n=name: f"rank {rank}: the step after loading, {n}: {m}")
