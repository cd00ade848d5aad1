"""tools/bench_async.py: its two runs pass the launch checks on the same process count, its
arguments are checked, and its figures are the documented sums of the per-step records."""
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench_async.py"
_spec = importlib.util.spec_from_file_location("bench_async", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("nproc, rollout_ranks", [(3, 1), (4, 2)])
def test_both_runs_pass_the_launch_checks(tmp_path, nproc, rollout_ranks):
    from megatron_rlcorr.train import load_and_check

    args = bench.parse_args(["--nproc", str(nproc), "--rollout-ranks", str(rollout_ranks)])
    colocated = load_and_check(str(bench.RECIPE), bench.run_overrides(args, "colocated", tmp_path), nproc)
    separate = load_and_check(str(bench.RECIPE), bench.run_overrides(args, "separate", tmp_path), nproc)
    assert not colocated.rollout.separate and separate.rollout.separate
    assert separate.rollout.trainer_world(nproc) == nproc - rollout_ranks
    assert separate.rollout.staleness == 1 and colocated.rollout.staleness == 0
    assert colocated.model == separate.model and colocated.data == separate.data  # only the placement differs
    assert colocated.trainer.seed == separate.trainer.seed and colocated.trainer.steps == separate.trainer.steps


@pytest.mark.parametrize("argv, message", [
    (["--steps", "3"], "--steps must be >= --max-staleness + 3 = 4"),
    (["--steps", "4", "--max-staleness", "2"], "--steps must be >= --max-staleness + 3 = 5"),
    (["--nproc", "3", "--rollout-ranks", "3"], "must leave a trainer rank"),
    (["--rollout-ranks", "0"], "must leave a trainer rank"),
    (["--max-staleness", "0"], "--max-staleness must be >= 1"),
    (["trainer.steps"], "overrides must be KEY=VALUE"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_summary_is_over_steps_2_to_n_minus_s_minus_1():
    def record(step, time, gen, train, sync, wait, reward):
        return {"step": step, "time": time, "timing/gen_s": gen, "timing/train_s": train,
                "timing/weight_sync_s": sync, "timing/wait_for_rollout_s": wait, "reward_mean": reward,
                "rollout/staleness_max": float(step > 1)}

    records = [record(2, 110.0, 4.0, 1.0, 2.0, 1.0, 0.2), record(1, 100.0, 9.0, 7.0, 5.0, 9.0, 0.1),  # out of order
               record(3, 130.0, 6.0, 3.0, 0.0, 4.0, 0.3), record(4, 190.0, 50.0, 50.0, 0.0, 50.0, 0.4),
               record(5, 290.0, 70.0, 70.0, 0.0, 70.0, 0.5)]
    out = bench.summarize(records, max_staleness=1)  # steps 2..3 of 5
    assert out["steps_per_min"] == pytest.approx(60.0 * 2 / 30.0)  # steps 2 and 3, logged 30 s after step 1
    assert out["gen_s_mean"] == pytest.approx(5.0) and out["train_s_mean"] == pytest.approx(2.0)
    assert out["weight_sync_s_mean"] == pytest.approx(1.0) and out["wait_for_rollout_s_mean"] == pytest.approx(2.5)
    assert out["gen_hidden_share"] == pytest.approx(1 - 5.0 / 10.0)
    assert out["gen_hidden_share_with_sync"] == pytest.approx(1 - 7.0 / 10.0)
    assert out["window"] == [2, 3] and out["reward_mean"] == [0.1, 0.2, 0.3, 0.4, 0.5] and out["staleness_max"] == 1.0
    assert bench.summarize(records, max_staleness=2)["window"] == [2, 2]
    colocated = bench.summarize([{k: v for k, v in r.items() if k != "timing/wait_for_rollout_s"} for r in records],
                                max_staleness=1)
    assert colocated["steps_per_min"] == out["steps_per_min"]
    assert not {"gen_hidden_share", "gen_hidden_share_with_sync", "wait_for_rollout_s_mean"} & colocated.keys()


@pytest.mark.parametrize("nproc, trainers", [(3, 2), (3, 1), (4, 2), (4, 3), (8, 6)])
def test_prompts_split_evenly_in_both_runs(nproc, trainers):
    prompts = bench.prompts_per_step(nproc, trainers)
    assert prompts >= 12 and prompts % nproc == 0 and prompts % trainers == 0
    assert prompts - bench.math.lcm(nproc, trainers) < 12  # the smallest such multiple


def test_cuda_without_enough_gpus_skips(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bench, "launch", lambda *a: pytest.fail("launched a run without the GPUs for it"))
    assert bench.main(["--device", "cuda"]) == 0
    assert "needs 3 GPUs" in capsys.readouterr().out
