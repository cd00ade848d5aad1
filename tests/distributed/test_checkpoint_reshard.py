"""Distributed checkpoints (training/checkpoint.py) re-shard: saved by one layout, loaded by another.

A dp2 run (distributed optimizer, fp32, gloo) trains two steps, saves, and trains a third. Runs
on tp2, pp2, pp2 x vpp2 and tp2 x dp2 load that checkpoint (its optimizer state in the
`fully_reshardable` format) into a model built from other seeds and must hold the saved weights
exactly, the Adam step and the scheduler's step count, and then train the third step to the same
weights as the uninterrupted run: Adam's moments were restored (a fresh Adam's third step
differs, checked as a control). The weights are compared as full tensors in neutral names
against the single-process reference weights that the dp2 run exports. A checkpoint in the
default DP-sharded format (`dp_reshardable`) continues the same way on the layout that wrote it
and with another DP size, and is refused, with the fix, on another TP.
"""

import pytest
import torch

from tests.dist import hide_gpus, run_distributed

pytestmark = [
    pytest.mark.distributed,
]

CFG = dict(vocab_size=100, hidden_size=32, num_layers=4, num_attention_heads=4, num_query_groups=2,
           ffn_hidden_size=48, tie_embeddings=True, add_qkv_bias=True, max_position_embeddings=64)
SCENARIOS = ["dec_ppo_tok", "dec_pg_stm", "dec_pg_stm"]
LAYOUTS = {"dp2": (1, 1, 1, None, 2), "tp2": (2, 1, 1, None, 2), "pp2": (1, 2, 1, None, 2),
           "pp2vpp2": (1, 2, 1, 2, 2), "tp2dp2": (2, 1, 1, None, 4), "cp2": (1, 1, 2, None, 2),
           "dp1": (1, 1, 1, None, 1)}


def _batches():
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import init_full_weights
    from tests.distributed.test_step_parallel import SEED, _make_batch

    cfg = ModelConfig(**CFG)
    weights = init_full_weights(cfg, SEED)
    return [_make_batch(weights, cfg, scenario) for scenario in SCENARIOS]


def _worker(rank, world, layout, directory, mode, batches, optim=None, optimizer_format="fully_reshardable"):
    """mode "save": steps 1-2, save, step 3. "load": load, step 3 (fresh_adam: load the
    weights only, as a control)."""
    hide_gpus()
    import torch.distributed as dist

    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import export_full_weights
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training import checkpoint
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer, sync_params
    from megatron_rlcorr.training.step import StepBatch, compute_old_log_probs, train_minibatch
    from tests.distributed.test_step_parallel import BATCH, _step_config

    enable_cpu_megatron()
    tp, pp, cp, vpp, _ = LAYOUTS[layout]
    groups = build_parallel_groups(tp, pp, cp, vpp)
    seed = 7 if mode == "save" else 1234
    chunks, optimizer, scheduler = build_model_and_optimizer(
        ModelConfig(**CFG), OptimSettings(lr=1e-2, adam_eps=1e-6, warmup_steps=1, decay_style="linear",
                                          **(optim or {})), groups, seed=seed, total_steps=4)
    rows = slice(groups.dp_rank * BATCH // groups.dp_size, (groups.dp_rank + 1) * BATCH // groups.dp_size)

    def train(step):
        cfg = _step_config(SCENARIOS[step], 2)
        batch = StepBatch(**{k: v[rows] for k, v in batches[step].items()})
        old = compute_old_log_probs(chunks, batch, groups=groups, micro_batch_size=2, temperature=cfg.temperature)
        result = train_minibatch(chunks, optimizer, batch, groups=groups, cfg=cfg, old_log_probs=old)
        scheduler.step(1)
        return result.update_successful

    def weights():
        sync_params(chunks)
        return export_full_weights(chunks, groups)

    layout_record = {"world_size": world, "tp": tp, "pp": pp, "cp": cp, "vpp": vpp}
    out = {}
    if mode in ("save", "save_async"):
        train(0)
        train(1)
        writer = checkpoint.CheckpointWriter(async_save=mode == "save_async", optimizer_format=optimizer_format)
        writer.save(directory, 2, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler, groups=groups,
                    common={"data_position": 8}, layout=layout_record)
        out["rand"] = torch.rand(3)
        out["saved"] = weights()
        if mode == "save":  # no Manager process for a synchronous save's results (checkpoint.py)
            import multiprocessing

            from megatron.core.dist_checkpointing.strategies import filesystem_async

            out["processes_after_save"] = [p.name for p in multiprocessing.active_children()]
            out["write_queue_after_save"] = filesystem_async._results_queue
        if mode == "save_async":  # train on while it is written; `latest` moves when it is finished
            out["latest_before_close"] = checkpoint.latest_step(directory)
            train(2)
            writer.close()
            out["latest_after_close"] = checkpoint.latest_step(directory)
            return out
    else:
        step_dir = checkpoint.checkpoint_dir(directory, 2)
        if mode == "fresh_adam":
            checkpoint.load_model(step_dir, chunks, groups)
        else:
            common = checkpoint.load(step_dir, model_chunks=chunks, optimizer=optimizer, scheduler=scheduler,
                                     groups=groups, layout=layout_record)
            out["common"] = common
            out["rand"] = torch.rand(3)
        out["loaded"] = weights()
        out["scheduler_steps"] = scheduler.num_steps
    out["adam_steps"] = sorted({int(state["step"]) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                                for state in opt.optimizer.state.values() if "step" in state})
    # Step 3 must train (a step that rejects every token changes nothing and would compare nothing).
    out["step3_updated"] = train(2)
    out["after"] = weights()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reshard")
    batches = _batches()
    results = run_distributed(_worker, 2, "dp2", directory, "save", batches)
    return directory, batches, results


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_checkpoint_files_and_marker(saved):
    """The files of the installed Megatron-Core's format (common.pt up to 0.18, the common state
    inside the .distcp files from 0.19 on) and the record of what wrote them."""
    from megatron_rlcorr.training import checkpoint

    directory, _, saving_ranks = saved
    step_dir = directory / "checkpoints" / "step_000002"
    names = {p.name for p in step_dir.iterdir()}
    assert {"metadata.json", "layout.json", "checkpoint.json"} <= names and any(n.endswith(".distcp") for n in names)
    installed = checkpoint.megatron_core_version()
    assert ("common.pt" in names) == (checkpoint._release(installed) < checkpoint._release("0.19"))
    assert checkpoint.saved_record(step_dir) == {"megatron_core": installed, "optimizer": "distributed",
                                                 "optimizer_format": "fully_reshardable"}
    checkpoint.check_readable(step_dir)  # the installed version reads what it wrote
    assert (directory / "checkpoints" / "latest").read_text().strip() == "2"
    # The synchronous save wrote through an in-process queue: no Manager process was started for it
    # (Megatron-Core's own queue would have spawned one per rank), and Megatron-Core's is put back.
    for rank_out in saving_ranks:
        assert rank_out["processes_after_save"] == [] and rank_out["write_queue_after_save"] is None


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "pp2vpp2", "tp2dp2", "cp2"])
def test_resume_on_another_layout_continues_the_run(saved, layout):
    directory, batches, saving_ranks = saved
    ref = saving_ranks[0]
    results = run_distributed(_worker, LAYOUTS[layout][-1], layout, directory, "load", batches)
    for rank, result in enumerate(results):
        assert _max_diff(result["loaded"], ref["saved"]) == 0.0, (layout, rank)
        assert result["scheduler_steps"] == 2 and result["adam_steps"] == [2], (layout, rank)
        assert result["common"]["data_position"] == 8
        assert result["step3_updated"] and ref["step3_updated"], (layout, rank)
        diff = _max_diff(result["after"], ref["after"])
        assert diff < 2e-6, (layout, rank, diff)
        if layout == "dp2":  # the layout that wrote it: its RNG continues too
            assert torch.equal(result["rand"], saving_ranks[rank]["rand"])


def test_without_the_optimizer_state_the_next_step_differs(saved):
    """Control: the weights alone (a fresh Adam) do not reproduce step 3."""
    directory, batches, (ref, _) = saved
    result = run_distributed(_worker, 2, "tp2", directory, "fresh_adam", batches)[0]
    assert _max_diff(result["loaded"], ref["saved"]) == 0.0
    assert _max_diff(result["after"], ref["after"]) > 1e-4


def test_plain_adam_reshards_and_is_refused_by_the_distributed_optimizer(tmp_path):
    batches = _batches()
    plain = dict(use_distributed_optimizer=False)
    ref = run_distributed(_worker, 2, "dp2", tmp_path, "save", batches, plain)[0]
    for result in run_distributed(_worker, 2, "pp2", tmp_path, "load", batches, plain):
        assert _max_diff(result["loaded"], ref["saved"]) == 0.0 and result["adam_steps"] == [2]
        assert _max_diff(result["after"], ref["after"]) < 2e-6
    with pytest.raises(AssertionError, match="use_distributed_optimizer=false"):
        run_distributed(_worker, 2, "tp2", tmp_path, "load", batches)


def test_asynchronous_save_is_the_state_at_save_time(tmp_path):
    """The background save holds step 2 although step 3 trained meanwhile; `latest` moves only
    when it is finished. Loaded on tp2, it continues like the synchronous checkpoint."""
    batches = _batches()
    ref = run_distributed(_worker, 2, "dp2", tmp_path, "save_async", batches)[0]
    assert ref["latest_before_close"] is None and ref["latest_after_close"] == 2
    for result in run_distributed(_worker, 2, "tp2", tmp_path, "load", batches):
        assert _max_diff(result["loaded"], ref["saved"]) == 0.0 and result["adam_steps"] == [2]


@pytest.fixture(scope="module")
def saved_dp_sharded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dp_sharded")
    batches = _batches()
    results = run_distributed(_worker, 2, "dp2", directory, "save", batches, None, "dp_reshardable")
    return directory, batches, results


@pytest.mark.parametrize("layout", ["dp2", "dp1"])
def test_dp_sharded_checkpoint_continues_the_run_with_any_dp_size(saved_dp_sharded, layout):
    from megatron_rlcorr.training import checkpoint

    directory, batches, saving_ranks = saved_dp_sharded
    ref = saving_ranks[0]
    record = checkpoint.saved_record(checkpoint.checkpoint_dir(directory, 2))
    assert record["optimizer_format"] == "dp_reshardable" and record["optimizer"] == "distributed"
    results = run_distributed(_worker, LAYOUTS[layout][-1], layout, directory, "load", batches)
    for rank, result in enumerate(results):
        assert _max_diff(result["loaded"], ref["saved"]) == 0.0, (layout, rank)
        assert result["scheduler_steps"] == 2 and result["adam_steps"] == [2], (layout, rank)
        assert result["step3_updated"], (layout, rank)
        diff = _max_diff(result["after"], ref["after"])
        assert diff < 2e-6, (layout, rank, diff)
        if layout == "dp2":
            assert diff == 0.0  # the same ranks, the same shards: bit for bit
            assert torch.equal(result["rand"], saving_ranks[rank]["rand"])


def test_dp_sharded_checkpoint_is_refused_on_another_tp_with_the_fix(saved_dp_sharded):
    from megatron_rlcorr.training import checkpoint

    directory, batches, _ = saved_dp_sharded
    step_dir = checkpoint.checkpoint_dir(directory, 2)
    with pytest.raises(ValueError) as info:
        checkpoint.check_optimizer_format(step_dir, {"world_size": 2, "tp": 2, "pp": 1, "cp": 1, "vpp": None})
    message = str(info.value)
    assert "trainer.optimizer_checkpoint_format=fully_reshardable" in message and "another tp" in message
    assert "world_size=2 tp=1 pp=1" in message and "world_size=2 tp=2 pp=1" in message
    checkpoint.check_optimizer_format(step_dir, {"world_size": 1, "tp": 1, "pp": 1, "cp": 1, "vpp": None})
    # `load` checks it before reading anything.
    with pytest.raises(AssertionError, match="optimizer_checkpoint_format=fully_reshardable"):
        run_distributed(_worker, 2, "tp2", directory, "load", batches)
