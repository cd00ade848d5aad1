"""Asynchronous RL end to end (rl/async_rollout.py): torchrun launches where the last
rollout.num_ranks ranks generate while the others train (recipes/tiny_cpu_async.yaml itself, and
tiny_cpu.yaml with other layouts), against colocated runs that emulate the same staleness with
rollout.policy_lag, the example recipe's share of trained tokens, and exact resume after a planned
stop or a SIGKILL.

The schedule's promise (rl/async_rollout.py's docstring): step t trains on rollouts generated
with the weights after step max(0, t - 1 - S), the same rollouts `rollout.policy_lag: S` makes on
colocated ranks, so the two runs' metrics agree bit for bit (all but the wall-clock ones).
Baseline runs are shared between tests (module fixtures) to keep the file's time low: the
uninterrupted S=2 launch is both the separate run that the colocated policy_lag=2 run must repeat
and the run that the resumed ones must repeat. The colocated runs, which only give metrics to
compare with, train in the test's gloo worker pool (tests/runs.py `train_runs`, the trainer that
torchrun's entry point runs). The separate runs run train's entry point itself on the pool's
processes, under torchrun's environment (tests/runs.py `entry_point`: it makes the launch's
default group and cuts the world in two, as under torchrun), without a launch's start-up. So do
the runs that are killed: the rank to kill SIGKILLs itself once a checkpoint is complete, and the
pool kills the other ranks when it sees the death, as torchrun's agent does; the relaunch that
resumes is a new run on new pool processes. The refused launch is a real torchrun launch.
"""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.dist import run_distributed
from tests.dist_pool import WorkerFailure
from tests.runs import MOST_TOKENS, deterministic, entry_point, kept_token_fraction, read_metrics, train_runs

pytestmark = [pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
ASYNC = ROOT / "recipes" / "tiny_cpu_async.yaml"
COMMON = ["trainer.save_every=0", "trainer.logger=[console]"]
SEPARATE = ["rollout.placement=separate"]


def _command(nproc: int, out: Path, name: str, overrides, recipe: Path = TINY) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
            "megatron_rlcorr.train", "--config", str(recipe), *COMMON, f"trainer.output_dir={out}", f"name={name}",
            *overrides]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


def in_pool(nproc: int, out: Path, name: str, *overrides: str, recipe: Path = TINY) -> list[dict]:
    """A launch's run: train's entry point on `nproc` processes of the worker pool; its metrics rows."""
    argv = ["--config", str(recipe), *COMMON, f"trainer.output_dir={out}", f"name={name}", *overrides]
    assert [code for code, _ in run_distributed(entry_point, nproc, "train", argv)] == [0] * nproc
    return read_metrics(out / name)


def colocated(nproc: int, out: Path, name: str, *overrides: str, recipe: Path = TINY) -> list[dict]:
    """A tiny recipe on `nproc` colocated ranks of the worker pool (not a launch): its metrics rows."""
    (records,) = run_distributed(train_runs, nproc, [(recipe, [*COMMON, f"trainer.output_dir={out}", f"name={name}",
                                                                *overrides])])[0]
    return records


def rows(records: list[dict]) -> list[dict]:
    return [deterministic(r) for r in records]


# ---- 1. tiny_cpu_async.yaml at S=2 (2 trainer + 1 rollout rank) == colocated 2 ranks, policy_lag=2 ----

# tiny_cpu_async.yaml colocated: every rank generates with the weights of two steps ago
COLOCATED_LAG_TWO = ["rollout.placement=colocated", "rollout.num_ranks=null", "rollout.max_staleness=null",
                     "rollout.policy_lag=2"]


@pytest.fixture(scope="module")
def colocated_lag_two(tmp_path_factory):
    """The colocated run with the staleness of `uninterrupted` (section 3): policy_lag=2, 2 ranks, 5 steps."""
    return colocated(2, tmp_path_factory.mktemp("colocated_lag_two"), "colocated", *COLOCATED_LAG_TWO,
                     "trainer.steps=5", recipe=ASYNC)


@pytest.mark.timeout(600)
def test_separate_rollout_rank_repeats_the_colocated_policy_lag(uninterrupted, colocated_lag_two):
    separate, lagged = uninterrupted, colocated_lag_two  # max_staleness 2 (RESUME) and policy_lag 2
    assert [r["step"] for r in separate] == [r["step"] for r in lagged] == [1, 2, 3, 4, 5]
    for sep, col in zip(separate, lagged):
        for record in (sep, col):
            # staleness logged by both modes; dynamic sampling's top-up rounds ran (on the rollout rank
            # when separate)
            assert {"rollout/staleness_mean", "rollout/staleness_max", "dynamic_sampling/num_gen_batches"} \
                <= record.keys()
            assert record["rollout/staleness_max"] == min(record["step"] - 1, 2) <= 2
            assert record["rollout/staleness_mean"] <= record["rollout/staleness_max"]
        assert {"timing/wait_for_rollout_s", "timing/gen_s"} <= sep.keys()
        assert deterministic(sep) == deterministic(col), sep["step"]
    assert len({r["loss"] for r in separate}) == 5  # the steps really differ


@pytest.mark.timeout(600)
def test_async_recipe_trains_on_most_tokens(uninterrupted):
    """The example recipe's correction suits stale batches: tiny_cpu.yaml's DAPO block (geometric RS
    within [0.99, 1.01]) rejected 89-97% of the tokens at steps 2-4 of a launch of this recipe at its
    own staleness 1 (2026-11-27); the ppo_is_bypass block keeps them, here at staleness 2."""
    assert [r["rollout/staleness_max"] for r in uninterrupted] == [0, 1, 2, 2, 2]
    for record in uninterrupted:
        assert kept_token_fraction(record) >= MOST_TOKENS, (record["step"], kept_token_fraction(record))


# ---- 2. dp2 x tp2 trainer + 2 rollout ranks == colocated tp2 (and step 1 == one process) ----

TP_STEPS = 3


@pytest.mark.timeout(900)
def test_tp2_trainer_with_two_rollout_ranks_repeats_the_colocated_run(tmp_path):
    steps = f"trainer.steps={TP_STEPS}"
    separate = in_pool(6, tmp_path, "separate", *SEPARATE, "parallel.tp=2", "rollout.num_ranks=2",
                      "rollout.max_staleness=1", steps)
    tp2 = colocated(4, tmp_path, "colocated", "parallel.tp=2", "rollout.policy_lag=1", steps)
    single = colocated(1, tmp_path, "single", "rollout.policy_lag=1", steps)
    assert [r["step"] for r in separate] == [r["step"] for r in tp2] == list(range(1, TP_STEPS + 1))
    assert rows(separate) == rows(tp2)
    assert [r["rollout/staleness_max"] for r in separate] == [0, 1, 1]
    # Step 1 samples with the initial weights, which do not depend on the layout: its rollouts, and so
    # every statistic of them, are those of one process, bit for bit.
    first, reference = separate[0], single[0]
    for key in STEP1_LAYOUT_FREE:
        assert first[key] == reference[key], key
    # The training side sums in another order under tp2 (fp32, eps 1.2e-7, sums of a few hundred
    # terms): the losses agree to rounding. Observed: relative 1.4e-6 at most; the later steps
    # sample the same tokens (their weights differ by rounding only), so they agree as closely.
    for sep, one in zip(separate, single):
        for key in ("loss", "grad_norm"):
            assert sep[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), (sep["step"], key)


# The statistics of the sampled tokens and their rewards (and the bf16 rollout's log-probs, with
# the same initial weights and rollout TP on both sides).
STEP1_LAYOUT_FREE = ("reward_mean", "reward/acc_mean", "reward/batch_reward_mean", "reward/batch_score_mean",
                     "response_length_mean", "response_length_max", "response/clip_fraction",
                     "batch/valid_response_tokens", "dynamic_sampling/num_gen_batches",
                     "dynamic_sampling/informative_fraction", "rollout_corr/rollout_log_ppl",
                     "rollout/staleness_max")


# ---- 3. exact resume with S=2 ----

RESUME = ["rollout.max_staleness=2", "trainer.steps=5"]  # on tiny_cpu_async.yaml (1 rollout rank)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 5-step S=2 run that the resumed ones must repeat, and that repeats the colocated
    policy_lag=2 run (section 1)."""
    return in_pool(3, tmp_path_factory.mktemp("uninterrupted"), "whole", *RESUME, recipe=ASYNC)


@pytest.mark.timeout(600)
def test_exit_interval_then_resume_repeats_the_uninterrupted_run(uninterrupted, tmp_path):
    first = in_pool(3, tmp_path, "exit", *RESUME, "trainer.exit_interval=2", recipe=ASYNC)
    assert [r["step"] for r in first] == [1, 2]
    run_dir = tmp_path / "exit"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "2"
    # The batches asked for before the checkpoint (steps 3 and 4) are saved beside it.
    assert (run_dir / "checkpoints" / "step_000002" / "rollouts" / "dp0.pt").is_file()
    resumed = in_pool(3, tmp_path, "exit", *RESUME, "trainer.resume=true", recipe=ASYNC)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert resumed[:2] == first  # not re-run
    assert rows(resumed) == rows(uninterrupted)
    assert [r["rollout/staleness_max"] for r in resumed] == [0, 1, 2, 2, 2]
    assert len({r["loss"] for r in uninterrupted}) == 5


def _kill_self_after_checkpoint(latest: Path, finished: threading.Event) -> None:
    """SIGKILL this process as soon as `latest` names a complete checkpoint (a thread of the rank to kill)."""
    while not finished.is_set():
        if latest.exists() and latest.read_text().strip():
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.02)


def killed_after_checkpoint(rank, world_size, argv, latest, kill_rank):
    """train's entry point on a pool rank (tests/runs.py `entry_point`); rank `kill_rank` is SIGKILLed
    once a checkpoint is complete, whatever it is doing then."""
    finished = threading.Event()
    if rank == kill_rank:
        threading.Thread(target=_kill_self_after_checkpoint, args=(Path(latest), finished), daemon=True).start()
    try:
        return entry_point(rank, world_size, "train", argv)
    finally:
        finished.set()


def _kill_rank_after_checkpoint(out: Path, name: str, rank: int) -> int:
    """The S=2 run saving every 2 steps on 3 pool processes, rank `rank` SIGKILLed once a checkpoint
    is complete; the pool then kills the other ranks, as torchrun's agent does when a rank dies. The
    step `latest` names afterwards."""
    argv = ["--config", str(ASYNC), *COMMON, f"trainer.output_dir={out}", f"name={name}", *RESUME,
            "trainer.save_every=2"]
    latest = out / name / "checkpoints" / "latest"
    with pytest.raises(WorkerFailure, match=rf"rank {rank} of 3 died \(exit code -{int(signal.SIGKILL)}\)"):
        run_distributed(killed_after_checkpoint, 3, argv, str(latest), rank)
    return int(latest.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rank", [0, 2], ids=["trainer_rank0", "rollout_rank"])
def test_resume_after_sigkill_repeats_the_uninterrupted_run(uninterrupted, tmp_path, rank):
    saved = _kill_rank_after_checkpoint(tmp_path, "killed", rank)
    assert saved in (2, 4)  # 5 would mean the run finished before the kill
    assert (tmp_path / "killed" / "checkpoints" / f"step_{saved:06d}" / "rollouts" / "dp0.pt").is_file()
    resumed = in_pool(3, tmp_path, "killed", *RESUME, "trainer.save_every=2", "trainer.resume=true", recipe=ASYNC)
    # The rows a killed run logged after its checkpoint are replaced by the resumed run's.
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert rows(resumed) == rows(uninterrupted)


# ---- 4. bad input at launch ----

@pytest.mark.timeout(120)
def test_launch_without_trainer_ranks_is_refused(tmp_path):
    proc = subprocess.run(_command(2, tmp_path, "bad", [*SEPARATE, "rollout.num_ranks=2", "rollout.max_staleness=1"]),
                          check=False, capture_output=True, text=True, timeout=90, env=_env(), cwd=ROOT)
    # Rank 0 exits 2 with the one message (runtime.report_bad_input); torchrun itself exits 1 and
    # names the root cause's exit code.
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "rollout.num_ranks=2" in errors[0] and "no trainer" in errors[0], errors
    assert "exitcode  : 2 " in proc.stderr
    assert not (tmp_path / "bad").exists()
