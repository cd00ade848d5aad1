"""`megatron-rlcorr analyze`: the summary.json contract (docs/api.md) on a scored file, no findings on
clean data, findings with recommendations that fix what they claim on injected mismatch, the
block they are judged under (--config, overrides), dumps and run directories (kl_rising from the
dumps and from metrics.jsonl), bad input (exit 2 with the fix named), and the plots (drawn and
readable; skipped with an install hint when matplotlib is missing)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_rlcorr.analysis import CHECKS, DAPO_BLOCK, analyze, evaluate, load_block, write_outputs
from megatron_rlcorr.analysis.findings import keeping_bounds, round_bound
from megatron_rlcorr.analysis.plots import INSTALL_HINT
from megatron_rlcorr.cli import main
from megatron_rlcorr.config import PRESETS, RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction

ROOT = Path(__file__).resolve().parents[2]
BLOCK = "algorithm.rollout_correction"


def _records(n_seq: int, seed: int = 0, *, noise: float = 0.0, noisy_fraction: float = 1.0,
             shift: float = 0.0, shifted_every: int = 0, catastrophic_every: int = 0,
             lengths: tuple[int, int] = (5, 120), extra: dict | None = None) -> list[dict]:
    """Rollout records with random engine log-probs and the trainer's = engine's + a chosen mismatch:
    Gaussian noise on a fraction of the tokens, a per-token shift on every k-th sequence, one
    catastrophic token (-12 in log-ratio) on every k-th sequence."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n_seq):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        rollout = -torch.empty(n, dtype=torch.float64).exponential_(1.0, generator=g) * 0.7 - 1e-3
        delta = noise * torch.randn(n, generator=g, dtype=torch.float64)
        delta = delta * (torch.rand(n, generator=g) < noisy_fraction)
        if shifted_every and i % shifted_every == 0:
            delta = delta + shift
        if catastrophic_every and i % catastrophic_every == 0:
            delta[int(torch.randint(0, n, (1,), generator=g))] -= 12.0
        old = (rollout + delta).clamp(max=0.0)
        records.append({"prompt_ids": [1, 5, 7], "response_ids": list(range(3, 3 + n)),
                        "rollout_log_probs": rollout.tolist(), "log_probs": old.tolist(), **(extra or {})})
    return records


def _write(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _with(settings_overrides: str, block: RolloutCorrectionConfig) -> RolloutCorrectionConfig:
    """`block` with the recommended 'algorithm.rollout_correction.k=v ...' applied, as a user would."""
    changes = {}
    for item in settings_overrides.split():
        key, value = item.split("=", 1)
        changes[key.removeprefix(BLOCK + ".")] = yaml.safe_load(value)
    return RolloutCorrectionConfig(**{**block.to_dict(), **changes})


# ---- a scored file: the contract ----

def test_scored_file_summary_has_the_contract_and_the_correction_numbers(tmp_path):
    scored = _write(tmp_path / "scored.jsonl", _records(60, noise=0.05))
    assert main(["analyze", str(scored), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {"input", "num_sequences", "num_tokens", "statistics", "presets", "correction", "findings"} <= set(summary)
    assert summary["input"]["kind"] == "scored" and summary["num_sequences"] == 60
    assert set(summary["presets"]) == set(PRESETS)
    for numbers in summary["presets"].values():
        for key in ("kept_token_fraction", "kept_sequence_fraction", "ess", "weight_mean", "weight_std", "weight_max"):
            assert isinstance(numbers[key], float), key
    assert summary["presets"]["disabled"]["kept_token_fraction"] == 1.0
    for finding in summary["findings"]:
        assert set(finding) == {"check", "value", "threshold", "recommendation"} and finding["check"] in CHECKS
    assert (tmp_path / "out" / "report.md").read_text().startswith("# Rollout mismatch analysis")
    if summary["plots_error"] is None:   # the metric curves are a run's only
        assert sorted(summary["plots"]) == ["is_weights.png", "kept_vs_threshold.png", "logratio_vs_prob.png",
                                            "seq_logratio_vs_length.png"]

    # The statistics are the correction's own metrics, and the quantiles torch.quantile's.
    records = _records(60, noise=0.05)
    old = torch.tensor([x for r in records for x in r["log_probs"]], dtype=torch.float64)
    rollout = torch.tensor([x for r in records for x in r["rollout_log_probs"]], dtype=torch.float64)
    cu = torch.tensor([0] + [len(r["log_probs"]) for r in records]).cumsum(0)
    ref = compute_rollout_correction(old, rollout, torch.ones_like(old), RolloutCorrectionConfig(), cu_seqlens=cu)
    stats = summary["statistics"]
    for name in ("kl", "k3_kl", "log_ppl_diff", "chi2_token", "chi2_seq"):
        assert stats[name] == pytest.approx(float(ref.metrics[f"rollout_corr/{name}"]), rel=1e-6, abs=1e-9)
    token_ratio = (old - rollout).exp()
    assert stats["token_ratio"]["p5"] == pytest.approx(float(torch.quantile(token_ratio, 0.05)), rel=1e-9)
    assert stats["token_ratio"]["p50"] == pytest.approx(float(torch.quantile(token_ratio, 0.5)), rel=1e-9)
    dapo = compute_rollout_correction(old, rollout, torch.ones_like(old), RolloutCorrectionConfig(**DAPO_BLOCK),
                                      cu_seqlens=cu)
    corr = summary["correction"]
    assert corr["metrics"]["rollout_is_std"] == pytest.approx(float(dapo.metrics["rollout_corr/rollout_is_std"]))
    assert corr["kept_token_fraction"] == pytest.approx(float(dapo.response_mask.mean()))


def test_clean_data_gives_no_findings(tmp_path):
    records = _records(80, seed=1)
    g = torch.Generator().manual_seed(2)
    for r in records:   # the trainer agrees with the engine up to float32 rounding (~1e-6)
        jitter = 1e-6 * (2 * torch.rand(len(r["rollout_log_probs"]), generator=g, dtype=torch.float64) - 1)
        r["log_probs"] = (torch.tensor(r["rollout_log_probs"], dtype=torch.float64) + jitter).clamp(max=0.0).tolist()
    analysis = analyze(_write(tmp_path / "clean.jsonl", records))
    assert analysis.findings == []
    assert all(not c["flagged"] for c in analysis.checks.values())
    assert analysis.correction.kept_sequence_fraction == 1.0


# ---- injected mismatch: flagged, and the recommendations fix it ----

def test_injected_mismatch_is_flagged_and_the_recommendations_fix_it(tmp_path):
    # Noise of std 0.3 on 30% of the tokens, and a catastrophic token in every 12th sequence.
    path = _write(tmp_path / "mismatch.jsonl", _records(300, seed=3, noise=0.3, noisy_fraction=0.3,
                                                       catastrophic_every=12, lengths=(5, 200)))
    analysis = analyze(path)
    found = {f.check: f for f in analysis.findings}
    assert {"masked_fraction_high", "veto_fraction_high"} <= set(found)
    block = analysis.block.config

    rs = found["masked_fraction_high"]
    assert rs.value > 0.10 and rs.threshold == 0.10
    lower, upper = rs.settings["rollout_rs_threshold_lower"], rs.settings["rollout_rs_threshold"]
    assert lower <= 0.99 and upper >= 1.01
    assert f"rollout_rs_threshold_lower={lower:g}" in rs.recommendation
    assert f"rollout_rs_threshold={upper:g}" in rs.recommendation
    fixed = evaluate(analysis.input.batch, _with(analysis.summary()["recommended"]["masked_fraction_high"]["overrides"],
                                                 block))
    assert fixed.metrics["rollout_rs_seq_masked_fraction"] <= 0.05 + 1e-6   # 15 of 300, in float32
    assert fixed.metrics["rollout_rs_masked_fraction"] <= 0.10
    assert rs.expected["rollout_rs_seq_masked_fraction"] == fixed.metrics["rollout_rs_seq_masked_fraction"]

    veto = found["veto_fraction_high"]
    assert veto.value == pytest.approx(25 / 300)
    v = veto.settings["rollout_token_veto_threshold"]
    assert v < block.rollout_token_veto_threshold and math.log10(v) == round(math.log10(v))  # a power of ten
    assert f"rollout_token_veto_threshold={v:g}" in veto.recommendation
    after = evaluate(analysis.input.batch, RolloutCorrectionConfig(**{**block.to_dict(), **veto.settings}))
    assert after.metrics["rollout_is_veto_fraction"] <= 0.01

    # Both applied: at least 94% of the sequences are kept whole (95% by RS, 99% by the veto).
    both = evaluate(analysis.input.batch, RolloutCorrectionConfig(**{**block.to_dict(), **rs.settings,
                                                                     **veto.settings}))
    assert both.kept_sequence_fraction >= 0.94


def test_a_shifted_subset_is_judged_under_the_recipe_block(tmp_path):
    # 15% of the sequences have every token's log-ratio shifted by +0.3 (sequence ratio e^(0.3 n)).
    path = _write(tmp_path / "shifted.jsonl", _records(200, seed=4, noise=0.01, shift=0.3, shifted_every=7,
                                                      lengths=(10, 12)))
    recipe = tmp_path / "seq_is.yaml"
    recipe.write_text(f"base: {ROOT / 'recipes' / 'tiny_cpu.yaml'}\nalgorithm:\n  rollout_correction:\n"
                      "    rollout_is: sequence\n    rollout_is_threshold: 20.0\n")
    analysis = analyze(path, recipe, [f"{BLOCK}.rollout_is_threshold=50"])
    assert analysis.block.config.rollout_is_threshold == 50.0 and analysis.block.config.rollout_rs is None
    found = {f.check: f for f in analysis.findings}
    assert {"is_std_high", "ess_low", "is_mean_off"} <= set(found)
    assert "masked_fraction_high" not in found and "veto_fraction_high" not in found   # no RS, no veto here
    for check in ("is_std_high", "ess_low"):
        threshold = found[check].settings["rollout_is_threshold"]
        assert threshold < 50 and f"rollout_is_threshold={threshold:g}" in found[check].recommendation
        fixed = evaluate(analysis.input.batch, RolloutCorrectionConfig(**{**analysis.block.config.to_dict(),
                                                                          **found[check].settings}))
        assert fixed.metrics["rollout_is_std"] <= 1.0 and fixed.metrics["rollout_is_eff_sample_size"] >= 0.5
    mean = found["is_mean_off"]
    assert mean.settings == {"rollout_is_batch_normalize": True} and mean.expected["unit_mean"] == pytest.approx(1.0)

    # The same data under the default DAPO block: truncation at 2 with batch normalisation keeps the
    # weights in check, and geometric RS [0.99, 1.01] rejects the shifted sequences instead.
    dapo = {f.check for f in analyze(path).findings}
    assert "masked_fraction_high" in dapo and not {"is_std_high", "ess_low", "is_mean_off"} & dapo


def test_the_block_comes_from_the_recipe_alone(tmp_path):
    # tiny_hf_cpu.yaml names a checkpoint and data that do not exist here: only its block is read.
    block = load_block(ROOT / "recipes" / "tiny_hf_cpu.yaml")
    assert block.config.rollout_rs == "geometric"
    assert load_block(None).config == RolloutCorrectionConfig(**DAPO_BLOCK)
    assert load_block(None, [f"{BLOCK}.rollout_rs_threshold=1.05"]).config.rollout_rs_threshold == 1.05
    with pytest.raises(ValueError, match="only the correction block"):
        load_block(None, ["trainer.steps=3"])
    with pytest.raises(ValueError, match="rollout_is"):
        load_block(None, [f"{BLOCK}.rollout_is=both"])


# ---- dumps and runs: the trend ----

def _dumps(directory: Path, k3_noise: list[float]) -> None:
    for i, noise in enumerate(k3_noise):
        step = 5 * (i + 1)
        records = _records(40, seed=10 + i, noise=noise, lengths=(4, 30),
                           extra={"step": step, "reward": 1.0, "finish_reason": "eos"})
        _write(directory / f"step_{step}.jsonl", records)


def test_dumps_directory_rising_mismatch_is_flagged_from_the_dumps(tmp_path):
    _dumps(tmp_path / "dumps", [0.02, 0.03, 0.05, 0.08, 0.12, 0.18])   # k3 ~ noise^2 / 2: 2e-4 -> 1.6e-2
    (tmp_path / "dumps" / "step_99.jsonl.tmp").write_text("half a dump")   # a dump being written: ignored
    (tmp_path / "dumps" / "step_33.jsonl").write_text("")   # a step without a training batch: skipped
    analysis = analyze(tmp_path / "dumps")
    assert analysis.input.kind == "dumps" and analysis.input.steps == [5, 10, 15, 20, 25, 30]
    assert analysis.trend.source == "dumps" and len(analysis.trend.values) == 6
    rising = {f.check: f for f in analysis.findings}["kl_rising"]
    assert rising.value > 2.0 and "steps 5-10" in rising.recommendation and "steps 25-30" in rising.recommendation


def _run(directory: Path, k3: list[float]) -> Path:
    _dumps(directory / "dumps", [0.01, 0.01])
    lines = [{"step": s + 1, "time": 0.0, "rollout_corr/k3_kl": v, "rollout_corr/kl": v / 2, "reward_mean": 0.1 * s,
              "rollout_corr/rollout_is_mean": 1.0} for s, v in enumerate(k3)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return directory


def test_run_directory_trend_from_metrics(tmp_path):
    rising = analyze(_run(tmp_path / "rising", [1e-3 * 1.3 ** s for s in range(12)]))
    assert rising.input.kind == "run" and rising.trend.source == "metrics.jsonl"
    finding = {f.check: f for f in rising.findings}["kl_rising"]
    assert finding.threshold == 2.0 and "steps 1-4" in finding.recommendation and "slope" in finding.recommendation

    flat = analyze(_run(tmp_path / "flat", [1e-3 * (1 + 0.1 * math.sin(s)) for s in range(12)]))
    assert flat.checks["kl_rising"]["value"] < 2.0 and flat.findings == []
    tiny = analyze(_run(tmp_path / "tiny", [1e-7 * 2 ** s for s in range(8)]))   # rising, but at rounding level
    assert not tiny.checks["kl_rising"]["flagged"]


def test_a_run_is_judged_under_its_own_recipe(tmp_path):
    run = _run(tmp_path / "run", [1e-3] * 4)
    (run / "recipe.yaml").write_text("name: run\nalgorithm:\n  rollout_correction:\n    rollout_is: token\n"
                                     "    rollout_is_threshold: 3.0\n")
    analysis = analyze(run)
    assert analysis.block.config.rollout_is == "token" and "the run's recipe" in analysis.block.source
    assert analyze(run, ROOT / "recipes" / "tiny_cpu.yaml").block.config.rollout_is == "sequence"


# ---- bad input ----

def test_bad_input_exits_2_naming_the_problem_and_the_fix(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(["analyze", str(tmp_path / "missing.jsonl"), "--out", out]) == 2
    assert "does not exist" in capsys.readouterr().err

    unscored = _records(3)
    del unscored[1]["log_probs"]
    path = _write(tmp_path / "unscored.jsonl", unscored)
    assert main(["analyze", str(path), "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2" in err and "log_probs" in err and "megatron-rlcorr score" in err

    no_rollout = _records(2)
    del no_rollout[0]["rollout_log_probs"]
    assert main(["analyze", str(_write(tmp_path / "r.jsonl", no_rollout)), "--out", out]) == 2
    assert ":1: no 'rollout_log_probs'" in capsys.readouterr().err

    short = _records(2)
    short[1]["log_probs"] = short[1]["log_probs"][:-1]
    assert main(["analyze", str(_write(tmp_path / "s.jsonl", short)), "--out", out]) == 2
    assert ":2: log_probs has" in capsys.readouterr().err

    (tmp_path / "empty").mkdir()
    assert main(["analyze", str(tmp_path / "empty"), "--out", out]) == 2
    assert "no step_<N>.jsonl" in capsys.readouterr().err
    (tmp_path / "run" / "dumps").mkdir(parents=True)
    assert main(["analyze", str(tmp_path / "run"), "--out", out]) == 2
    assert "trainer.dump_every" in capsys.readouterr().err

    good = str(_write(tmp_path / "good.jsonl", _records(3)))
    assert main(["analyze", good, "--out", out, "trainer.steps=3"]) == 2
    assert "only the correction block" in capsys.readouterr().err
    assert main(["analyze", good, "--out", good]) == 2
    assert "is a file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_invalid_tokens_are_masked_and_counted(tmp_path):
    records = _records(10, noise=0.01)
    records[3]["rollout_log_probs"][0] = float("-inf")
    records[4]["log_probs"][1] = float("nan")
    analysis = analyze(_write(tmp_path / "x.jsonl", records))
    assert analysis.statistics["invalid_tokens"] == 2
    assert analysis.input.batch.num_tokens == sum(len(r["log_probs"]) for r in records) - 2


# ---- recommendations' arithmetic ----

def test_round_bound_rounds_away_to_two_digits():
    assert round_bound(0.98721, down=True) == 0.987 and round_bound(1.0134, down=False) == 1.014
    assert round_bound(0.0123, down=True) == 0.012 and round_bound(47.3, down=False) == 48.0
    assert round_bound(0.99, down=True) == 0.99 and round_bound(1.0, down=False) == 1.0


def test_keeping_bounds_reject_at_most_the_budget():
    g = torch.Generator().manual_seed(5)
    stat = torch.randn(1000, generator=g, dtype=torch.float64) * 0.02
    lower, upper = keeping_bounds(stat, stat, 0.95)
    rejected = ((stat.exp() < lower) | (stat.exp() > upper)).double().mean()
    assert 0.04 <= float(rejected) <= 0.05 and lower < 1.0 < upper


# ---- plots ----

def test_plots_are_drawn_and_readable(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    run = _run(tmp_path / "run", [1e-3 * 1.2 ** s for s in range(8)])
    _dumps(run / "dumps", [0.05, 0.1, 0.2])
    outputs = write_outputs(analyze(run), tmp_path / "out")
    names = {p.name for p in outputs.plots}
    assert names == {"logratio_vs_prob.png", "is_weights.png", "seq_logratio_vs_length.png", "kept_vs_threshold.png",
                     "metrics.png"}
    for path in outputs.plots:
        assert path.stat().st_size > 20_000, path.name
        pixels = imread(path)
        assert pixels.shape[0] > 400 and pixels.shape[1] > 800 and float(pixels.std()) > 0.05, path.name
    summary = json.loads(outputs.summary.read_text())
    assert sorted(summary["plots"]) == sorted(names) and summary["plots_error"] is None
    assert "![metrics.png](metrics.png)" in outputs.report.read_text()


def test_without_matplotlib_the_rest_is_written_and_the_fix_said(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)    # `import matplotlib...` now raises ImportError
    path = _write(tmp_path / "s.jsonl", _records(20, noise=0.05))
    assert main(["analyze", str(path), "--out", str(tmp_path / "out")]) == 0
    assert "pip install 'megatron-rlcorr[plots]'" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["plots"] == [] and summary["plots_error"] == INSTALL_HINT
    assert "pip install 'megatron-rlcorr[plots]'" in (tmp_path / "out" / "report.md").read_text()
    assert not list((tmp_path / "out").glob("*.png"))


def test_a_dumps_directory_of_empty_dumps_is_an_error(tmp_path):
    (tmp_path / "step_1.jsonl").write_text("")
    with pytest.raises(ValueError, match="every step_<N>.jsonl dump is empty"):
        analyze(tmp_path)
