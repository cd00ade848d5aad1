"""The RL trainer end to end on 2 gloo processes: torchrun entry (the session's real launch,
tests/launched.py), resume, every correction preset (these in the pool, tests/dist.py)."""
import json
import math
from pathlib import Path

import pytest

from megatron_rlcorr.config import PRESETS
from tests.dist import run_distributed
from tests.runs import MOST_TOKENS, deterministic, kept_token_fraction, read_metrics, train_runs

pytestmark = [
    pytest.mark.distributed,
]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
SMALL = ["data.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=4", "trainer.save_every=0",
         "trainer.logger=[console]"]


def test_torchrun_end_to_end_writes_finite_metrics(tiny_cpu_launch):
    """The session's real launch (tests/launched.py): tools/launch.sh's torchrun of
    megatron_rlcorr.train on 2 processes, 3 steps; its console, metrics and final checkpoint."""
    proc = tiny_cpu_launch.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("step ") == 3 and "metrics:" in proc.stdout
    assert proc.stdout.count(" gen_tok/s=") == 3 and proc.stdout.count(" len_max=") == 3
    run_dir = tiny_cpu_launch.run_dir
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    required = {"reward_mean", "response_length_mean", "loss", "grad_norm", "lr", "timing/gen_s", "timing/train_s",
                "throughput/tokens_per_s", "rollout_corr/invalid_rollout_token_fraction", "rollout_corr/k3_kl",
                "rollout_corr/log_ppl_diff", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_batch_norm_factor",
                "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_veto_fraction",
                "actor/pg_loss", "actor/entropy", "dynamic_sampling/num_gen_batches",
                "reward/acc_mean", "response_length_max", "response/clip_fraction", "throughput/gen_tokens_per_s"}
    for record in records:
        assert required <= record.keys(), required - record.keys()
        bad = {k: v for k, v in record.items() if not math.isfinite(v)}
        assert not bad
        assert 0.0 <= record["reward_mean"] <= 1.0 and 1.0 <= record["response_length_mean"] <= 4.0
        assert record["response_length_mean"] <= record["response_length_max"] <= 4.0  # rollout.max_new_tokens
        assert 0.0 <= record["response/clip_fraction"] <= 1.0 and record["throughput/gen_tokens_per_s"] > 0
        assert record["lr"] == pytest.approx(3e-3) and record["grad_norm"] > 0
        assert record["rollout_corr/invalid_rollout_token_fraction"] == 0.0
        # bf16 rollout vs fp32 training: a small but real mismatch, which the correction trains through
        assert 0 < record["rollout_corr/k3_kl"] < 1e-2
        assert kept_token_fraction(record) >= MOST_TOKENS, (record["step"], kept_token_fraction(record))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "3"
    step_dir = run_dir / "checkpoints" / "step_000003"
    # A Megatron-Core distributed checkpoint (its files per version: test_checkpoint_files_and_marker)
    names = sorted(p.name for p in step_dir.iterdir())
    assert {"layout.json", "metadata.json", "checkpoint.json"} <= set(names) and any(n.endswith(".distcp") for n in names)
    assert json.loads((step_dir / "layout.json").read_text()) == {"world_size": 2, "tp": 1, "pp": 1, "cp": 1,
                                                                  "vpp": None}


def test_resumed_run_repeats_the_uninterrupted_one(tmp_path):
    """Stopped by exit_interval after step k and resumed, the run repeats the uninterrupted one bit
    for bit, through the lr schedule's turn from warm-up to cosine decay after the resume."""
    k = 2
    common = [*SMALL, "algorithm.dynamic_sampling.enabled=true", "optim.warmup_steps=2", "optim.decay_style=cosine"]

    def run(name, *extra):
        return (TINY, [*common, f"name={name}", f"trainer.output_dir={tmp_path}", *extra])

    runs = [run("whole", f"trainer.steps={2 * k}"),
            # Megatron's exit interval: stops after step k with a checkpoint, the rerun resumes.
            run("exit", f"trainer.steps={2 * k}", f"trainer.exit_interval={k}"),
            run("exit", f"trainer.steps={2 * k}", f"trainer.exit_interval={k}")]
    whole, first_half, resumed = run_distributed(train_runs, 2, runs)[0]
    assert [r["step"] for r in first_half] == list(range(1, k + 1))
    assert [r["step"] for r in resumed] == list(range(1, 2 * k + 1))
    assert resumed[:k] == first_half  # steps 1..k were not re-run (their wall times are kept)...
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in whole]  # ...and k+1.. repeat
    assert len({r["loss"] for r in whole}) == 2 * k  # the steps really differ
    assert whole[0]["lr"] == 0.0 and whole[-1]["lr"] != whole[2]["lr"]  # warm-up and cosine decay ran
    assert resumed[k]["lr"] == whole[k]["lr"] > resumed[k + 1]["lr"] > 0  # the peak, then the decay: after the resume


# Saved in the fully reshardable format: the DP-sharded default resumes only on dp layouts.
DP2 = [*SMALL, "trainer.optimizer_checkpoint_format=fully_reshardable"]
K = 2  # the steps of the dp2 run


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """K steps of a dp=2 run (name r), finished and checkpointed: the run that
    test_extending_a_finished_run_continues_it extends on dp=2 and test_a_dp2_run_resumes_on_tp2_and_on_pp2
    resumes on tp=2 and pp=2 (each on a copy of the run directory)."""
    out = tmp_path_factory.mktemp("dp2_run")
    (records,) = run_distributed(train_runs, 2, [(TINY, [*DP2, "name=r", f"trainer.output_dir={out}",
                                                         f"trainer.steps={K}"])])[0]
    assert [r["step"] for r in records] == list(range(1, K + 1))
    return out, records


def test_extending_a_finished_run_continues_it(dp2_run, tmp_path):
    """Run K steps, then the same recipe with 2K steps resumes from the K checkpoint."""
    import shutil

    finished, short = dp2_run
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)

    def run(name, steps):
        return (TINY, [*DP2, f"name={name}", f"trainer.output_dir={tmp_path}", f"trainer.steps={steps}"])

    whole, extended = run_distributed(train_runs, 2, [run("whole", 2 * K), run("r", 2 * K)])[0]
    assert extended[:K] == short
    assert [deterministic(r) for r in extended] == [deterministic(r) for r in whole]


def test_every_preset_recipe_trains(tmp_path):
    runs = [(ROOT / "recipes" / f"preset_{name}.yaml",
             [*SMALL, "trainer.steps=2", f"trainer.output_dir={tmp_path}"]) for name in PRESETS]
    results = run_distributed(train_runs, 2, runs)[0]
    for name, records in zip(PRESETS, results):
        assert [r["step"] for r in records] == [1, 2], name
        for record in records:
            assert all(math.isfinite(v) for v in record.values()), name
            assert record["grad_norm"] > 0, name
            assert "rollout_corr/log_ppl_diff" in record, name
        has_is = "rollout_corr/rollout_is_mean" in records[0]
        assert has_is == (name in ("decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "ppo_is_bypass",
                                   "pg_is")), name
        assert ("rollout_corr/rollout_rs_masked_fraction" in records[0]) == name.endswith("rs"), name


# One DP replica over 2 ranks; the pp one as test_kl_and_the_step_correction_under_pp_and_cp names it
LAYOUTS = {"tp": ["parallel.tp=2"], "pp": ["parallel.pp=2", "trainer.micro_batch_size=4"], "cp": ["parallel.cp=2"]}
KL = ["algorithm.kl_loss.enabled=true", "algorithm.kl_in_reward.enabled=true"]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """The runs of LAYOUTS with the KL loss and the KL-in-reward penalty on, from the same seeds and
    initial weights: tp2 for 1 step, pp2 and cp2 for 2. Step 1 of each is read by
    test_tp_pp_cp_replicas_train_on_identical_rollouts, both steps of pp2 and cp2 by
    test_kl_and_the_step_correction_under_pp_and_cp."""
    out = tmp_path_factory.mktemp("layouts")
    steps = {"tp": 1, "pp": 2, "cp": 2}
    runs = [(TINY, [*SMALL, *KL, f"trainer.steps={steps[name]}", f"name={name}", f"trainer.output_dir={out}", *extra])
            for name, extra in LAYOUTS.items()]
    return dict(zip(LAYOUTS, run_distributed(train_runs, 2, runs)[0]))


def test_tp_pp_cp_replicas_train_on_identical_rollouts(layout_runs):
    """One DP replica over 2 ranks: the rollout source's batch reaches the other TP / PP / CP rank.

    Same seeds and same initial weights under every layout, so step 1 draws the same rollouts:
    rewards and rollout statistics agree exactly, losses to float rounding (the runs of
    `layout_runs`: with the KL loss and penalty on, both exactly 0 at step 1).
    """
    tp, pp, cp = (layout_runs[name] for name in ("tp", "pp", "cp"))
    for other in (pp, cp):
        first, ref = other[0], tp[0]
        for key in ("reward_mean", "response_length_mean", "rollout_corr/rollout_log_ppl", "batch/valid_response_tokens"):
            assert first[key] == ref[key], key
        for key in ("loss", "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean", "grad_norm"):
            assert first[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), key


def test_a_dp2_run_resumes_on_tp2_and_on_pp2(dp2_run, tmp_path):
    """The distributed checkpoint of a dp=2 run continues under tp=2 and pp=2: both resumed runs
    start from step 2's weights and optimizer state and draw the same rollouts at step 3 (seeded
    by step), so their step 3 agrees to float rounding."""
    import shutil

    finished, first = dp2_run
    for name in ("tp", "pp"):
        shutil.copytree(finished, tmp_path / name)
    runs = [(TINY, [*DP2, "name=r", f"trainer.output_dir={tmp_path / name}", f"trainer.steps={K + 1}",
                    f"parallel.{name}=2"]) for name in ("tp", "pp")]
    tp, pp = run_distributed(train_runs, 2, runs)[0]
    assert [r["step"] for r in tp] == [r["step"] for r in pp] == [1, 2, 3]
    assert tp[:2] == pp[:2] == first  # steps 1-2 were not re-run
    for key in ("reward_mean", "response_length_mean", "batch/valid_response_tokens"):
        assert tp[2][key] == pp[2][key], key
    for key in ("loss", "grad_norm", "rollout_corr/k3_kl"):
        assert tp[2][key] == pytest.approx(pp[2][key], rel=1e-4, abs=1e-7), key


def _legacy_resume(rank, world_size, tmp_path):
    """A per-rank checkpoint (the format before distributed checkpoints) of a dp=2 trainer: a
    tp=2 trainer refuses it; resumed on dp=2 it continues."""
    import torch.distributed as dist

    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups
    from megatron_rlcorr.recipe import load_recipe
    from megatron_rlcorr.rl.trainer import Trainer, train
    from tests.legacy_checkpoint import legacy_state, write_legacy

    enable_cpu_megatron()
    common = [*SMALL, "name=legacy", f"trainer.output_dir={tmp_path}", "optim.use_distributed_optimizer=false",
              "trainer.steps=3"]
    recipe = load_recipe(TINY, common)
    groups = build_parallel_groups(1, 1, 1, None)
    try:
        trainer = Trainer(recipe, groups)
        states = [None] * world_size
        dist.all_gather_object(states, legacy_state(trainer.model, trainer.optimizer, trainer.scheduler, 1,
                                                    data_position=0, kl_controller=None, recipe=recipe.raw))
        if rank == 0:
            write_legacy(recipe.run_dir, 1, states, recipe.parallel.layout(world_size))
        dist.barrier()
    finally:
        destroy_parallel_groups()
    error = None
    groups = build_parallel_groups(2, 1, 1, None)
    try:
        train(load_recipe(TINY, [*common, "parallel.tp=2"]), groups)
    except ValueError as err:
        error = str(err)
    finally:
        destroy_parallel_groups()
    groups = build_parallel_groups(1, 1, 1, None)
    try:
        train(recipe, groups)
    finally:
        destroy_parallel_groups()
    return [r["step"] for r in read_metrics(recipe.run_dir)], error


def test_per_rank_checkpoints_resume_on_their_layout_only(tmp_path):
    for steps, error in run_distributed(_legacy_resume, 2, tmp_path):
        assert steps == [2, 3]  # trained on from the per-rank checkpoint of step 1
        # the dp=2 -> tp=2 resume is refused by every rank: none loads a mismatched shard or hangs
        assert error is not None and "tp=1" in error and "tp=2" in error and "trainer.resume=false" in error


def test_lr_schedule_counts_rl_steps_not_updates(tmp_path):
    """Two mini-batch updates per RL step, 2 warm-up steps: every update of RL step s uses lr(s).
    (Counting updates, the schedule ran twice as fast: logged [0.5, 1, 1] x lr.)"""
    overrides = [*SMALL, f"trainer.output_dir={tmp_path}", "trainer.steps=4", "optim.warmup_steps=2",
                 "optim.decay_style=linear", "optim.min_lr=0.0", "trainer.mini_batch_prompts=2",
                 "trainer.micro_batch_size=8"]  # 4 prompts x 4 samples: 2 mini-batches of 2 prompts
    (records,) = run_distributed(train_runs, 1, [(TINY, overrides)])[0]
    lr = 3e-3
    # Megatron's schedule: step s (from 0) has warm-up lr * s / 2, then linear decay to 0 at step 4
    assert [r["lr"] for r in records] == pytest.approx([0.0, lr / 2, lr, lr / 2])
    assert all(r["actor/skipped_updates"] == 0 for r in records)


def test_kl_to_the_reference_starts_at_zero_and_grows(tmp_path):
    """The reference is the starting policy: step 1's KL loss and KL-in-reward penalty are exactly
    0; after one update both are positive, and the adaptive coefficient moved as verl's rule says."""
    overrides = [*SMALL, f"trainer.output_dir={tmp_path}", "trainer.steps=2", "algorithm.kl_loss.enabled=true",
                 "algorithm.kl_loss.type=low_var_kl", "algorithm.kl_in_reward.enabled=true",
                 "algorithm.kl_in_reward.controller=adaptive", "algorithm.kl_in_reward.coef=0.05",
                 "algorithm.kl_in_reward.horizon=100", "algorithm.kl_in_reward.type=k1"]
    (records,) = run_distributed(train_runs, 1, [(TINY, overrides)])[0]
    first, second = records
    assert first["actor/kl_loss"] == 0.0 and first["actor/reward_kl_penalty"] == 0.0
    assert second["actor/kl_loss"] > 0 and second["actor/reward_kl_penalty"] != 0
    assert first["actor/kl_coef"] == pytest.approx(1e-3)
    # after step 1: KL 0 < target 0.1, error clipped to -0.2, 4 prompts x 4 samples = 16 sequences
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(0.05 * (1 - 0.2 * 16 / 100), rel=1e-5)


@pytest.mark.parametrize("layout", [LAYOUTS["pp"], LAYOUTS["cp"]])
def test_kl_and_the_step_correction_under_pp_and_cp(layout_runs, layout):
    """The reference's and pi_old's log-probs exist on the last pipeline stage only, and every
    CP rank computes the step's correction on whole sequences: the step's metrics reach rank 0
    (the first stage), finite, with step 1's KL exactly 0 (the runs of `layout_runs`)."""
    records = layout_runs[next(name for name, extra in LAYOUTS.items() if extra == layout)]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert all(math.isfinite(v) for v in record.values())
        assert {"rollout_corr/rollout_is_batch_norm_factor", "actor/reward_kl_penalty", "actor/kl_loss"} <= record.keys()
    assert records[0]["actor/kl_loss"] == 0.0 and records[0]["actor/reward_kl_penalty"] == 0.0
    assert records[1]["actor/kl_loss"] > 0
