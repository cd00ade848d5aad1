"""tools/ablate.py: the plan of runs, the argument errors, the table and figures from synthetic
metrics, and one real tiny invocation (2 settings x 1 seed x 2 steps on 1 process: one run trained
beforehand in the test pool and kept by --skip-done, the other launched by ablate)."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from megatron_rlcorr.config import RolloutCorrectionConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
SMALL = ["data.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=4", "trainer.logger=[console]"]


def _load_tool():
    spec = importlib.util.spec_from_file_location("ablate", ROOT / "tools" / "ablate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ablate"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ablate = _load_tool()


def synthetic(steps: int, seed: int, slope: float, spike_at: int | None = None) -> list[dict]:
    """Metrics records like a run's metrics.jsonl: a rising reward, a steady grad norm (one spike)."""
    records = []
    for step in range(1, steps + 1):
        records.append({"step": step, "time": 0.0, "reward_mean": -0.5 + slope * step + 0.01 * seed,
                        "reward/acc_mean": 0.25 + slope * step / 2, "grad_norm": 10.0 if step == spike_at else 1.0,
                        "rollout_corr/k3_kl": 1e-3 * (1 + seed), "rollout_corr/log_ppl_abs_diff": 0.05,
                        "rollout_corr/chi2_seq": 0.2, "rollout_corr/rollout_rs_masked_fraction": 0.1})
    return records


# ---- summaries ----------------------------------------------------------------------------------

def test_grad_spikes_against_the_running_median():
    assert ablate.grad_spikes([1.0] * 30) == 0
    assert ablate.grad_spikes([1.0] * 10 + [3.5] + [1.0] * 10) == 1
    assert ablate.grad_spikes([1.0] * 10 + [2.9] + [1.0] * 10) == 0  # not above 3x
    assert ablate.grad_spikes([10.0] + [1.0] * 5) == 0  # too little history to judge step 1
    assert ablate.grad_spikes([1.0] * 5 + [float("nan"), 4.0]) == 1  # NaN neither counts nor judges
    assert ablate.grad_spikes([1.0] * 5 + [0.0] * 20 + [2.0]) == 0  # nor do steps that did not update


def test_stuck_from_needs_a_final_window_without_updates():
    assert ablate.stuck_from([1.0, 2.0, 0.0, 0.0, 0.0], window=3) == 3.0   # steps 3, 4, 5 did not update
    assert math.isnan(ablate.stuck_from([1.0, 2.0, 0.0, 0.0, 0.0], window=4))
    assert math.isnan(ablate.stuck_from([0.0, 0.0, 0.0, 1.0], window=2))   # it updated again at the end
    assert ablate.stuck_from([0.0, 0.0], window=2) == 1.0
    assert ablate._stuck_cell({"stuck_steps": [7.0, math.nan, 3.0]}) == "2/3 (3, 7)"
    assert ablate._stuck_cell({"stuck_steps": [None, None]}) == "0/2"
    assert ablate._stuck_cell({}) == "n/a"


def test_summarize_run_windows_and_means():
    records = synthetic(30, seed=0, slope=0.01, spike_at=20)
    s = ablate.summarize_run(records, "reward_mean", window=10)
    assert s["steps"] == 30 and s["grad_spikes"] == 1
    assert s["final_reward"] == pytest.approx(-0.5 + 0.01 * 25.5)
    assert s["reward_auc"] == pytest.approx(-0.5 + 0.01 * 15.5)
    assert s["rollout_corr/k3_kl"] == pytest.approx(1e-3)
    assert s["no_update_steps"] == 0
    dead = [{**r, "grad_norm": 0.0, "batch/valid_response_tokens": 0.0, "rollout_corr/k3_kl": 0.0}
            for r in synthetic(5, 0, 0.0)]
    with_dead = ablate.summarize_run([*records, *dead], "reward_mean", window=10)
    assert with_dead["no_update_steps"] == 5 and with_dead["rollout_corr/k3_kl"] == pytest.approx(1e-3)
    missing = ablate.summarize_run([{"step": 1, "reward_mean": 0.0}], "reward_mean", window=10)
    assert math.isnan(missing["rollout_corr/chi2_seq"]) and missing["grad_spikes"] == 0


def test_write_report_from_synthetic_metrics(tmp_path):
    records = {"none": {1: synthetic(30, 1, 0.0, spike_at=15), 2: synthetic(30, 2, 0.0)},
               "token_is": {1: synthetic(30, 1, 0.02), 2: synthetic(28, 2, 0.02)}}
    blocks = {"none": RolloutCorrectionConfig.disabled().to_dict(),
              "token_is": RolloutCorrectionConfig.decoupled_token_is().to_dict()}
    meta = {"recipe": "recipes/tiny_cpu.yaml", "lag": 2, "seeds": [1, 2], "nproc": 1, "steps": 30,
            "reward_key": "reward_mean", "window": 10, "command": "python tools/ablate.py ...", "wall_s": 120.0}
    result = ablate.write_report(tmp_path, records, blocks, meta)

    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ablation.json", "ablation.md", "ablation.png", "ablation_brief.md", "ablation_none.png",
                     "ablation_token_is.png"]
    for png in tmp_path.glob("*.png"):
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 150_000, (png.name, len(data))

    md = (tmp_path / "ablation.md").read_text()
    assert "policy lag 2" in md and "| setting | seeds | final reward |" in md
    none_row = next(line for line in md.splitlines() if line.startswith("| none |"))
    assert "| 2 |" in none_row and "| 0.5 | 0.0 |" in none_row  # one spike in one of two seeds; no dead step
    assert '`token_is`: `{"rollout_is": "token"}`' in md and "`none`: `{} (metrics only)`" in md
    assert "routing mismatch" not in md  # a dense model's runs: no routing column
    brief = (tmp_path / "ablation_brief.md").read_text().splitlines()
    assert brief[0].startswith("| setting | final reward |") and len(brief) == 4
    assert brief[2].startswith("| none | ") and "| 0/2 |" in brief[2]   # no seed stuck

    saved = json.loads((tmp_path / "ablation.json").read_text())  # strict JSON (no NaN)
    assert saved["summary"]["token_is"]["seeds"] == [1, 2]
    assert saved["summary"]["none"]["rollout_corr/k3_kl"] == pytest.approx(2.5e-3)
    assert saved["summary"]["token_is"]["final_reward"] > saved["summary"]["none"]["final_reward"]
    assert len(saved["curves"]["token_is"]["2"]["reward"]) == 28
    assert result["summary"]["none"]["grad_spikes"] == pytest.approx(0.5)


def test_a_reference_ablation_joins_the_table_and_figure(tmp_path):
    meta = {"recipe": "recipes/tiny_cpu.yaml", "seeds": [1], "reward_key": "reward_mean", "window": 10}
    ablate.write_report(tmp_path / "lag0", {"none": {1: synthetic(20, 1, 0.02)}}, {"none": {}}, {**meta, "lag": 0})
    reference = ablate.load_reference(tmp_path / "lag0")
    assert list(reference) == ["none (lag 0)"] and len(reference["none (lag 0)"]["curves"][1]["reward"]) == 20
    ablate.write_report(tmp_path / "lag2", {"none": {1: synthetic(20, 1, 0.0)}}, {"none": {}}, {**meta, "lag": 2},
                        reference)
    md = (tmp_path / "lag2" / "ablation.md").read_text()
    assert "| none | 1 |" in md and "| none (lag 0), reference | 1 |" in md
    args = ablate.parse_args(["--recipe", str(TINY), "--out", str(tmp_path), "--reference", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="--reference .*x: no ablation.json there"):
        ablate.check_args(args)


def test_a_run_without_metrics_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="runs without metrics: none_s3"):
        ablate.write_report(tmp_path, {"none": {3: []}}, {"none": {}}, {})


# ---- arguments and the plan ---------------------------------------------------------------------

def _args(*extra: str):
    return ablate.parse_args(["--recipe", str(TINY), "--out", "/tmp/ablate-unused", *extra])


@pytest.mark.parametrize("extra, message", [
    (["--settings", "none", "tokn_is"], "unknown setting 'tokn_is' \\(did you mean \"token_is\"\\?\\)"),
    (["--seeds", "1", "1"], "--seeds lists a value twice"),
    (["--lag", "-1"], "--lag must be >= 0"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["trainer.seed=5"], "ablate.py sets trainer.seed itself"),
    (["algorithm.rollout_correction={}"], "sets algorithm.rollout_correction itself"),
])
def test_argument_errors(extra, message):
    with pytest.raises(ValueError, match=message):
        ablate.check_args(_args(*extra))


def test_missing_recipe_and_main_exit_code(tmp_path, capsys):
    args = ablate.parse_args(["--recipe", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--recipe .*nope.yaml: no such file"):
        ablate.check_args(args)
    assert ablate.main(["--recipe", str(TINY), "--out", str(tmp_path), "--settings", "bogus"]) == 2
    assert "ablate.py: error: --settings: unknown setting 'bogus'" in capsys.readouterr().err


def test_overrides_may_follow_the_lists():
    args = _args("--settings", "none", "dapo", "optim.lr=2e-3", "--seeds", "4", "5", "rollout.n=4")
    assert args.settings == ["none", "dapo"] and args.seeds == [4, 5]
    assert args.overrides == ["optim.lr=2e-3", "rollout.n=4"]


def test_define_a_setting_of_your_own():
    args = _args("--settings", "none", "--define", "dapo_wide", "dapo", "rollout_rs_threshold_lower=0.3",
                 "rollout_rs_threshold=1.3", "--seeds", "2", "rollout.n=4")
    assert args.settings == ["none", "dapo_wide"] and args.seeds == [2] and args.overrides == ["rollout.n=4"]
    ablate.check_args(args)
    block = ablate.correction_block("dapo_wide", TINY, [], args.defines)
    assert block["rollout_rs"] == "geometric" and block["rollout_is_batch_normalize"] is True   # from dapo
    assert block["rollout_rs_threshold_lower"] == 0.3 and block["rollout_rs_threshold"] == 1.3
    bad = _args("--define", "dapo_typo", "dapo", "rollout_rs_treshold=2")
    with pytest.raises(ValueError, match="--define dapo_typo: .*rollout_rs_treshold"):
        ablate.correction_block("dapo_typo", TINY, [], bad.defines)


@pytest.mark.parametrize("extra, message", [
    (["--define", "dapo", "none"], "the name must be new"),
    (["--define", "mine", "dapoo"], "unknown base setting \\(did you mean \"dapo\"\\?\\)"),
])
def test_define_errors(extra, message):
    with pytest.raises(ValueError, match=message):
        ablate.check_args(_args(*extra))


def test_define_needs_a_name_and_a_base(capsys):
    with pytest.raises(SystemExit) as exit_:
        _args("--define", "mine", "--seeds", "1")
    assert exit_.value.code == 2 and "--define needs NAME BASE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("--define", "mine", "dapo", "--define", "mine", "none")
    assert "--define mine is given twice" in capsys.readouterr().err


def _dump(path: Path, rows: list[tuple[float, list[float]]]) -> None:
    """rows of (reward, per-token log-ratio trainer - engine)."""
    records = [{"step": 1, "prompt_ids": [1, 2], "response_ids": [3] * len(lr), "reward": reward,
                "rollout_log_probs": [-1.0] * len(lr), "log_probs": [-1.0 + x for x in lr]} for reward, lr in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_rejection_by_answer_splits_what_rs_rejects_by_reward(tmp_path):
    # geometric RS [0.9, 1.1]: |mean log-ratio| > ~0.1 is rejected. Right answers: 2 of 4 rejected
    # (one too likely now, one too unlikely); wrong answers: 1 of 4 rejected, in step 2's file.
    _dump(tmp_path / "step_1.jsonl", [(1.0, [0.5, 0.5]), (1.0, [0.0, 0.01]), (-1.0, [0.0, 0.0]),
                                      (-1.0, [0.02, -0.02])])
    _dump(tmp_path / "step_2.jsonl", [(1.0, [-0.4, -0.4]), (1.0, [0.0]), (-1.0, [0.3, 0.3]), (-1.0, [0.0])])
    (tmp_path / "step_3.jsonl").write_text("")   # a step without a training batch
    block = RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=1.1,
                                    rollout_rs_threshold_lower=0.9).to_dict()
    assert ablate.rejection_by_answer(tmp_path, block) == {"rejected_right": 0.5, "rejected_wrong": 0.25}
    assert ablate.rejection_by_answer(tmp_path, RolloutCorrectionConfig.disabled().to_dict()) == {}
    assert ablate.rejection_by_answer(tmp_path / "none", block) == {}


def test_correction_blocks():
    recipe_block = {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True,
                    "rollout_rs": "geometric", "rollout_rs_threshold": 1.01, "rollout_rs_threshold_lower": 0.99,
                    "rollout_token_veto_threshold": 1e-4}
    assert ablate.correction_block("dapo", TINY, []) == RolloutCorrectionConfig(**recipe_block).to_dict()
    assert ablate.correction_block("none", TINY, []) == RolloutCorrectionConfig.disabled().to_dict()
    assert ablate.correction_block("seq_is_rs", TINY, [])["rollout_rs"] == "sequence"
    assert ablate.correction_block("pg_rs", TINY, [])["use_policy_gradient"] is True
    with pytest.raises(ValueError, match="--settings dapo uses the recipe's own"):
        ablate.correction_block("dapo", TINY, ["algorithm.rollout_correction=null"])


def test_routing_replay_runs_each_setting_with_and_without_it(tmp_path):
    args = ablate.parse_args(["--recipe", str(TINY), "--out", str(tmp_path), "--settings", "none", "token_is",
                              "--routing-replay", "both"])
    assert args.settings == ["none", "none_r3", "token_is", "token_is_r3"]
    assert ablate.correction_block("token_is_r3", TINY, []) == ablate.correction_block("token_is", TINY, [])
    only = ablate.parse_args(["--recipe", str(TINY), "--out", str(tmp_path), "--settings", "none",
                              "--routing-replay", "on"])
    assert only.settings == ["none_r3"]
    with pytest.raises(ValueError, match="sets rollout.routing_replay itself"):
        ablate.check_args(ablate.parse_args(["--recipe", str(TINY), "--out", str(tmp_path),
                                             "rollout.routing_replay=true"]))

    def moe_run(seed: int, routing: float) -> list[dict]:
        return [{**r, "moe/routing_mismatch_fraction": routing} for r in synthetic(12, seed, 0.01)]

    records = {"none": {1: moe_run(1, 0.08)}, "none_r3": {1: moe_run(1, 0.06)}}
    blocks = {name: RolloutCorrectionConfig.disabled().to_dict() for name in records}
    meta = {"recipe": "recipes/tiny_hf_moe_cpu.yaml", "lag": 0, "seeds": [1], "nproc": 1, "steps": 12,
            "reward_key": "reward_mean", "window": 5}
    ablate.write_report(tmp_path, records, blocks, meta)
    md = (tmp_path / "ablation.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| setting |")).split(" | ")
    column = header.index("routing mismatch")
    rows = {line.split(" | ")[0]: line.split(" | ") for line in md.splitlines() if line.startswith("| none")}
    assert rows["| none"][column] == "0.080" and rows["| none_r3"][column] == "0.060"


def test_plan_runs_overrides_and_paths(tmp_path):
    args = ablate.parse_args(["--recipe", str(TINY), "--out", str(tmp_path), "--lag", "3", "--seeds", "7", "8",
                              "--settings", "none", "dapo", "--steps", "5", "--nproc", "2", *SMALL])
    runs = ablate.plan_runs(args)
    assert [r.label for r in runs] == ["none_s7", "none_s8", "dapo_s7", "dapo_s8"]
    first = dict(o.split("=", 1) for o in runs[0].overrides)
    assert first["rollout.policy_lag"] == "3" and first["trainer.seed"] == "7" and first["trainer.steps"] == "5"
    assert json.loads(first["algorithm.rollout_correction"]) == RolloutCorrectionConfig.disabled().to_dict()
    assert first["trainer.resume"] == "false" and first["trainer.save_every"] == "0"
    assert runs[0].metrics == tmp_path / "runs" / "none_s7" / "tiny_cpu" / "metrics.jsonl" and runs[0].steps == 5
    assert not ablate.is_done(runs[0])
    runs[0].metrics.parent.mkdir(parents=True)
    runs[0].metrics.write_text("".join(json.dumps(r) + "\n" for r in synthetic(4, 7, 0.0)))
    assert not ablate.is_done(runs[0])  # 4 of 5 steps: --skip-done trains it again
    runs[0].metrics.write_text("".join(json.dumps(r) + "\n" for r in synthetic(5, 7, 0.0)))
    assert ablate.is_done(runs[0])
    bad = ablate.parse_args(["--recipe", str(TINY), "--out", str(tmp_path), "--nproc", "3", *SMALL])
    with pytest.raises(ValueError, match="setting none, seed 1: .*prompts_per_step"):
        ablate.plan_runs(bad)


# ---- the real thing, tiny -----------------------------------------------------------------------

@pytest.mark.distributed
def test_end_to_end_two_settings_one_seed(tmp_path, capsys):
    """The "none" run is trained first, on a pool process, with the overrides ablate plans for it
    (train's entry point, as the launch runs it): ablate --skip-done keeps it and launches only the
    "dapo" run (torchrun, one process), and the report reads both."""
    from tests.dist import run_distributed
    from tests.runs import entry_point

    argv = ["--recipe", str(TINY), "--out", str(tmp_path), "--lag", "1", "--seeds", "3", "--settings", "none",
            "dapo", "--steps", "2", "--nproc", "1", *SMALL, "trainer.dump_every=1"]
    done = ablate.plan_runs(ablate.parse_args(argv))[0]
    assert done.label == "none_s3"
    (code, _), = run_distributed(entry_point, 1, "train", ["--config", str(TINY), *done.overrides])
    assert code == 0 and ablate.is_done(done)
    assert ablate.main([*argv, "--skip-done"]) == 0
    assert "[1/2] none_s3: done already" in capsys.readouterr().out
    assert not (tmp_path / "runs" / "none_s3" / "train.log").exists()  # not launched
    saved = json.loads((tmp_path / "ablation.json").read_text())
    assert set(saved["summary"]) == {"none", "dapo"} and saved["meta"]["lag"] == 1
    # the DAPO block rejects; its rejections are split by answer from the runs' dumps, none has none
    dapo, none = saved["summary"]["dapo"], saved["summary"]["none"]
    assert 0 <= dapo["rejected_right"] <= 1 and 0 <= dapo["rejected_wrong"] <= 1
    assert none["rejected_right"] is None and none["rejected_wrong"] is None
    for setting in ("none", "dapo"):
        records = ablate.read_metrics(tmp_path / "runs" / f"{setting}_s3" / "tiny_cpu" / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2]
        assert "rollout_corr/k3_kl" in records[-1]
    resolved = (tmp_path / "runs" / "dapo_s3" / "train.log").read_text()
    assert "rollout.policy_lag=1" in resolved and "trainer.seed=3" in resolved
    assert (tmp_path / "ablation.png").is_file() and (tmp_path / "ablation_dapo.png").is_file()
    # the report rebuilds from the runs alone
    (tmp_path / "ablation.md").unlink()
    assert ablate.main([*argv, "--report-only"]) == 0 and (tmp_path / "ablation.md").is_file()
