"""`trainer.dump_every`: the step's rollouts with the trainer's log-probs in runs/<name>/dumps, the
same records under every layout as on one process (rollouts are layout-free; the trainer's
log-probs agree to float rounding), bounded by trainer.dump_max_samples, also in bypass mode.

The one-process run is the session's `one_process_run` (tests/distributed/conftest.py): this file's
recipe on one process for 3 steps, dumped every step (its trackers, and its resume after step 2, change
no dump). Its steps 1 and 2 are the reference of the layouts; `analyze` reads the whole run."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_rlcorr.data.rollout_file import read_rollouts
from tests.dist import run_distributed
from tests.runs import train_runs

pytestmark = [pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
SMALL = ["data.prompts_per_step=4", "rollout.n=4", "trainer.micro_batch_size=4", "trainer.save_every=0",
         "trainer.logger=[console]", "trainer.steps=2", "algorithm.dynamic_sampling.enabled=false"]


def _dump(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "dumps" / f"step_{step}.jsonl").read_text().splitlines()]


def _runs(tmp_path, layouts):
    return [(TINY, [*SMALL, f"name={name}", f"trainer.output_dir={tmp_path}", *extra]) for name, extra in layouts]


def test_dumps_hold_the_step_batch_the_same_under_every_layout(one_process_run, tmp_path):
    dump = ["trainer.dump_every=1"]
    one = one_process_run.run_dir  # the same recipe on one process (its first 2 of 3 steps: lr is constant)
    layouts = [("dp2", dump), ("tp2", [*dump, "parallel.tp=2"]), ("pp2", [*dump, "parallel.pp=2"]),
               ("bounded", [*dump, "trainer.dump_max_samples=6", "trainer.dump_every=2"]),
               ("bypass", [*dump, "algorithm.rollout_correction={bypass_mode: true, use_policy_gradient: true, "
                                  "rollout_is: token, rollout_is_threshold: 2.0}", "trainer.steps=1"])]
    run_distributed(train_runs, 2, _runs(tmp_path, layouts))
    for step in (1, 2):
        ref = _dump(one, step)
        assert len(ref) == 16 and {r["step"] for r in ref} == {step}
        for r in ref:
            assert len(r["log_probs"]) == len(r["rollout_log_probs"]) == len(r["response_ids"]) >= 1
            assert r["finish_reason"] in ("eos", "length") and math.isfinite(r["reward"])
            # bf16 engine vs fp32 trainer: close, not equal (the mismatch the correction is for)
            assert max(abs(a - b) for a, b in zip(r["log_probs"], r["rollout_log_probs"])) < 0.1
        assert any(r["log_probs"] != r["rollout_log_probs"] for r in ref)
        # Step 1 samples with the initial weights, the same bits under every layout: its records are
        # equal but for the trainer's log-probs. After the first update the weights agree to float
        # rounding only (tp2 sums in another order), so step 2's bf16 log-probs of the same sampled
        # tokens do too (observed on tp2: 2.5e-4 apart at most).
        rounded = ("log_probs",) if step == 1 else ("log_probs", "rollout_log_probs")
        for name in ("dp2", "tp2", "pp2"):
            other = _dump(tmp_path / name, step)
            assert [{k: v for k, v in r.items() if k not in rounded} for r in other] == \
                [{k: v for k, v in r.items() if k not in rounded} for r in ref], name
            for a, b in zip(other, ref):
                assert a["log_probs"] == pytest.approx(b["log_probs"], rel=1e-5, abs=1e-5), name
                assert a["rollout_log_probs"] == pytest.approx(b["rollout_log_probs"], rel=0, abs=2e-3), name
    assert not (tmp_path / "bounded" / "dumps" / "step_1.jsonl").exists()
    bounded = _dump(tmp_path / "bounded", 2)
    assert len(bounded) == 6  # 3 from each of the 2 replicas, in DP-rank order
    ref2 = _dump(one, 2)
    assert [r["response_ids"] for r in bounded] == [r["response_ids"] for r in ref2[:3] + ref2[8:11]]
    bypass = _dump(tmp_path / "bypass", 1)  # bypass mode has no pi_old pass: the dump runs one
    assert [r["response_ids"] for r in bypass] == [r["response_ids"] for r in _dump(one, 1)]
    for a, b in zip(bypass, _dump(one, 1)):
        assert a["log_probs"] == pytest.approx(b["log_probs"], rel=1e-5, abs=1e-5)
    records = read_rollouts(tmp_path / "dp2" / "dumps" / "step_1.jsonl")  # the score format reads it
    assert len(records) == 16 and records[0].rollout_log_probs == _dump(tmp_path / "dp2", 1)[0]["rollout_log_probs"]


def test_analyze_reads_a_tiny_cpu_run_and_reproduces_the_trainers_metrics(one_process_run, tmp_path):
    """`analyze` on the dumps of a real tiny_cpu run (3 steps, dumped every step): one step's file
    gives exactly the correction metrics the trainer logged for that step; the run directory adds the
    trend over steps."""
    from megatron_rlcorr.cli import main
    from tests.runs import read_metrics

    run_dir = one_process_run.run_dir
    logged = read_metrics(run_dir)
    assert [r["step"] for r in logged] == [1, 2, 3]
    for step in (1, 3):
        out = tmp_path / f"analysis_{step}"
        assert main(["analyze", str(run_dir / "dumps" / f"step_{step}.jsonl"), "--out", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["num_sequences"] == 16
        for name in ("kl", "k3_kl", "log_ppl_diff", "chi2_token"):
            assert summary["statistics"][name] == pytest.approx(logged[step - 1][f"rollout_corr/{name}"], rel=1e-5,
                                                                abs=1e-9), name
        assert summary["findings"] == []  # bf16 against fp32 on a tiny model: nothing to flag
    out = tmp_path / "analysis_run"
    assert main(["analyze", str(run_dir), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_sequences"] == 48 and len(summary["trend"]["steps"]) == 3
    assert (out / "report.md").is_file() and any(out.glob("*.png"))
