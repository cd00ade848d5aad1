"""tools/vllm_e2e.py on CPU: its arguments, that each precision's overrides make a recipe the launch
accepts (against the vLLM stand-in), the table from a metrics.jsonl, and the refusal, naming what is
missing, on a machine without vLLM or without CUDA. The runs themselves need a GPU (tools/gpu_check.sh)."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "vllm_e2e.py"
_spec = importlib.util.spec_from_file_location("vllm_e2e", _PATH)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)

STANDIN = Path(__file__).resolve().parents[1] / "vllm_standin"


def test_defaults_run_bf16_then_fp8():
    args = e2e.parse_args([])
    assert args.precision == ["bf16", "fp8"] and args.steps == 2 and args.overrides == []
    args = e2e.parse_args(["--precision", "fp8", "--steps", "3", "--out", "/tmp/x", "trainer.seed=7"])
    assert args.precision == ["fp8"] and args.steps == 3 and args.out == Path("/tmp/x")
    assert e2e.run_overrides(args, "fp8")[-1] == "trainer.seed=7"  # after the defaults


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--precision", "fp32"], "invalid choice: 'fp32'"),
    (["trainer.steps"], "overrides must be KEY=VALUE"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        e2e.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_each_run_is_a_vllm_recipe_in_eager_mode_that_the_launch_accepts(tiny_hf, tmp_path, monkeypatch, precision):
    from megatron_rlcorr.train import load_and_check

    monkeypatch.syspath_prepend(str(STANDIN))  # the launch check asks for vLLM 0.25.1: the stand-in's metadata
    monkeypatch.setattr(e2e, "files_dir", lambda out: tiny_hf)
    args = e2e.parse_args(["--out", str(tmp_path)])
    recipe = load_and_check(str(e2e.RECIPE), e2e.run_overrides(args, precision), 1)
    rollout = recipe.rollout
    assert (rollout.engine, rollout.enforce_eager, rollout.precision) == ("vllm", True, precision)
    assert recipe.model.hf_checkpoint == str(tiny_hf / "model")
    assert recipe.run_dir == tmp_path / "runs" / f"vllm_e2e_{precision}"
    assert recipe.trainer.steps == 2 and not recipe.data.val_files and not recipe.trainer.resume


def _write_metrics(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_table_holds_the_means_over_training_steps_and_names_the_device(tmp_path):
    rows = [{"step": 0, "val-core/x": 0.5},  # the before-training validation: not a training step
            {"step": 1, "rollout_corr/k3_kl": 1e-4, "rollout_corr/log_ppl_abs_diff": 0.002,
             "rollout_corr/rollout_rs_masked_fraction": 0.25},
            {"step": 2, "rollout_corr/k3_kl": 3e-4, "rollout_corr/log_ppl_abs_diff": 0.004,
             "rollout_corr/rollout_rs_masked_fraction": 0.75}]
    bf16 = e2e.figures(e2e.read_metrics(_write_metrics(tmp_path / "bf16.jsonl", rows)))
    assert bf16["steps"] == 2 and bf16["rollout_corr/k3_kl"] == pytest.approx(2e-4)
    assert bf16["rollout_corr/log_ppl_abs_diff"] == pytest.approx(0.003)
    assert bf16["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)
    no_rs = [{k: v for k, v in r.items() if "rs_masked" not in k} for r in rows]
    fp8 = e2e.figures(e2e.read_metrics(_write_metrics(tmp_path / "fp8.jsonl", no_rs)))
    assert math.isnan(fp8["rollout_corr/rollout_rs_masked_fraction"])
    lines = e2e.table("NVIDIA H100 80GB HBM3", {"bf16": bf16, "fp8": fp8}).splitlines()
    assert lines[0] == ("| device | rollout precision | steps | k3 KL(rollout \\|\\| trainer) | \\|log ppl diff\\| | "
                        "RS-masked tokens |")
    assert lines[1] == "|---|---|---|---|---|---|"
    assert lines[2] == "| NVIDIA H100 80GB HBM3 | bf16 | 2 | 0.0002 | 0.003 | 0.5 |"
    assert lines[3] == "| NVIDIA H100 80GB HBM3 | fp8 | 2 | 0.0002 | 0.003 | - |"
    assert all(line.count("|") - line.count("\\|") == 7 for line in lines)  # 6 cells in every row


def test_metrics_without_a_training_step_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no training step"):
        e2e.figures(e2e.read_metrics(_write_metrics(tmp_path / "m.jsonl", [{"step": 0, "val-core/x": 1.0}])))


def _vllm_installed(monkeypatch, installed: bool) -> None:
    find_spec = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        if name == "vllm":
            return importlib.machinery.ModuleSpec("vllm", None) if installed else None
        return find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)


@pytest.mark.parametrize("vllm, cuda, says, not_says", [
    (False, False, ["vLLM is not installed", "vllm==0.25.1", "no CUDA GPU is visible"], []),
    (True, False, ["no CUDA GPU is visible"], ["vLLM is not installed"]),
    (False, True, ["vLLM is not installed"], ["no CUDA GPU"]),
])
def test_without_vllm_or_cuda_it_says_what_is_missing_and_exits_2(tmp_path, monkeypatch, capsys, vllm, cuda, says,
                                                                 not_says):
    import torch

    _vllm_installed(monkeypatch, vllm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert e2e.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm_e2e: needs vLLM and a CUDA GPU: ")
    assert all(s in err for s in says) and not any(s in err for s in not_says), err
    assert not (tmp_path / "out").exists()  # refused before anything is made


def test_the_script_refuses_in_its_own_process_on_this_cpu_machine(tmp_path):
    import subprocess

    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM and a GPU are here: the script would run")
    proc = subprocess.run([sys.executable, str(_PATH), "--out", str(tmp_path)], capture_output=True, text=True,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin"},
                          timeout=120)
    assert proc.returncode == 2 and "vllm_e2e: needs vLLM and a CUDA GPU" in proc.stderr, proc.stderr
