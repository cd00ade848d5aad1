"""Recipes: the shipped ones load; bad ones stop before any process group exists, naming key and fix."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rlcorr import cli, runtime, train
from megatron_rlcorr.config import PRESETS, RolloutCorrectionConfig
from megatron_rlcorr.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
ASYNC = ROOT / "recipes" / "tiny_cpu_async.yaml"
# The tiny model with 4 experts of width 32, top-2, in every layer
MOE = "model.moe={num_experts: 4, router_topk: 2, ffn_hidden_size: 32}"


def test_tiny_recipe_is_the_dapo_correction_on_two_processes():
    recipe = load_recipe(TINY)
    assert recipe.check_layout(2) == 2
    assert recipe.algorithm.rollout_correction == RolloutCorrectionConfig(
        rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True, rollout_rs="geometric",
        rollout_rs_threshold=1.01, rollout_rs_threshold_lower=0.99, rollout_token_veto_threshold=1e-4)
    assert recipe.rollout.precision == "bf16" and recipe.model.bf16 is False  # a real mismatch


@pytest.mark.parametrize("name", PRESETS)
def test_preset_recipe_is_its_preset(name):
    recipe = load_recipe(ROOT / "recipes" / f"preset_{name}.yaml")
    assert recipe.algorithm.rollout_correction == getattr(RolloutCorrectionConfig, name)()
    assert recipe.name == f"preset_{name}"
    assert recipe.model == load_recipe(TINY).model  # inherited through `base:`
    recipe.check_layout(2)


def test_base_chain_and_overrides(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {TINY}\nname: child\noptim: {{lr: 0.5}}\n")
    recipe = load_recipe(child, ["trainer.steps=7", "data.task_args.digits=2"])
    assert recipe.name == "child" and recipe.optim.lr == 0.5 and recipe.optim.clip_grad == 1.0
    assert recipe.trainer.steps == 7 and recipe.data.task_args == {"digits": 2}
    loop = tmp_path / "loop.yaml"
    loop.write_text("base: loop.yaml\n")
    with pytest.raises(ValueError, match="circular"):
        load_recipe(loop)


BAD = [
    (["rollout.weight_sync_bucket_mb=0"], "weight_sync_bucket_mb must be >= 1"),
    (["optim.overlap_param_gather=true", "optim.overlap_grad_reduce=true", "optim.use_distributed_optimizer=false"],
     "overlap_param_gather overlaps the distributed optimizer"),
    (["optim.overlap_param_gather=true"], "needs optim.overlap_grad_reduce: true"),
    (["trainer.stpes=3"], 'unknown key trainer.stpes (did you mean "steps"?)'),
    (["optim.lr=fast"], "optim.lr must be a number, got 'fast'"),
    (["trainer.steps=2.5"], "trainer.steps must be an integer"),
    (["parallel.tp=3"], "must be divisible by parallel.tp=3: use one of 1, 2"),
    (["parallel.cp=4"], "world size 2 is not divisible by tp*pp*cp = 1*1*4 = 4"),
    (["data.prompts_per_step=3"], "prompts_per_step=3 must be divisible by the data-parallel size 2"),
    (["algorithm.rollout_correction.rollout_is=seq"], "algorithm.rollout_correction: rollout_is"),
    (["algorithm.rollout_correction.rollout_rs_threshold_lower=1.5"], "algorithm.rollout_correction"),
    (["model.vocab_size=10"], "model.vocab_size=10 is smaller than the vocabulary"),
    (["rollout.n=1"], "rollout.n=1"),
    (["algorithm.dynamic_sampling.max_num_gen_batchs=1"], 'did you mean "max_num_gen_batches"'),
    (["algorithm.dynamic_sampling.max_rounds=1"], "max_rounds: k is max_num_gen_batches: k + 1"),
    (["trainer.mini_batch_size=32"], "counted in prompts, as verl's ppo_mini_batch_size: set trainer.mini_batch_prompts"),
    (["algorithm.overlong_penalty.enabled=true", "algorithm.overlong_penalty.buffer=4"],
     "overlong_penalty.buffer=4 is not shorter than the response limit rollout.max_new_tokens=4"),
    (["trainer.mini_batch_prompts=3"], "trainer.mini_batch_prompts=3 must divide data.prompts_per_step=16"),
    (["algorithm.rollout_correction.use_policy_gradient=true"], "requires bypass_mode=True"),
    (["algorithm.kl_loss.type=k4"], "algorithm.kl_loss.type must be one of"),
    (["algorithm.loss.loss_agg_mode=seq-mean-token-sum-nrom"], 'did you mean "seq-mean-token-sum-norm"'),
    (["trainer.timeout_minutes=0"], "trainer: timeout_minutes must be >= 1"),
    (["trainer.max_tokens_per_micro_batch=-1"], "max_tokens_per_micro_batch must be >= 0"),
    # a mapping split by the shell at its space: a clear error, not a YAML traceback
    (["data.reward={aime:", "dapo_math}"], "override 'data.reward={aime:': its value is not valid YAML"),
    # expert parallelism: a MoE model, ep dividing the experts, etp their width, ep*etp the ranks of a stage
    (["parallel.ep=2"], "parallel.ep=2, parallel.etp=1: expert parallelism needs a mixture-of-experts model"),
    (["parallel.etp=2"], "this model is dense: set parallel.ep: 1 and parallel.etp: 1"),
    (["rollout.routing_replay=true"], "rollout.routing_replay: true replays the experts the engine routed each "
                                      "token to, and this model is dense (no model.moe): set "
                                      "rollout.routing_replay: false"),
    ([MOE, "parallel.tp=2"], "model.moe with parallel.tp=2 needs parallel.sequence_parallel: true"),
    ([MOE, "parallel.ep=3"], "parallel.ep=3 must divide model.moe.num_experts (4): each expert-parallel rank holds "
                             "num_experts / ep experts; use parallel.ep in 1, 2"),
    ([MOE, "parallel.etp=3"], "parallel.etp=3 must divide model.moe.ffn_hidden_size (32): each expert's SwiGLU is "
                              "split over etp ranks; use parallel.etp in 1, 2"),
    ([MOE, "parallel.ep=4"], "parallel.ep*etp = 4*1 = 4 must divide the 2 ranks of a pipeline stage (tp*cp*dp: world "
                             "size 2 / parallel.pp=1): use parallel.ep in 1, 2, or launch a multiple of 4 processes"),
    ([MOE, "parallel.ep=2", "parallel.etp=2"], "parallel.ep*etp = 2*2 = 4 must divide the 2 ranks of a pipeline stage "
                                               "(tp*cp*dp: world size 2 / parallel.pp=1): use parallel.ep in 1 (with "
                                               "this etp), or launch a multiple of 4 processes"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_recipe_stops_before_any_process_group(overrides, message, monkeypatch, capsys):
    def no_process_group(*args, **kwargs):
        raise AssertionError("a process group was created for a bad recipe")

    monkeypatch.setattr(runtime.dist, "init_process_group", no_process_group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert train.main(["--config", str(TINY), *overrides]) == train.EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    assert message in err and err.startswith(f"error: recipe {TINY}")


@pytest.mark.parametrize("override, message", [
    ("trainer.stpes=3", 'unknown key trainer.stpes (did you mean "steps"?); allowed: steps, '),
    ("trainer.zzzzqq=3", "unknown key trainer.zzzzqq; allowed: steps, "),
    ("trainr.steps=3", "unknown recipe section 'trainr' (did you mean \"trainer\"?); allowed: name, model, "),
    ("zzqq.a=3", "unknown recipe section 'zzqq'; allowed: name, model, "),
    ("model.architecture=qwen3-8", "unknown architecture 'qwen3-8' (did you mean \"qwen3-8b\"?); presets: "),
    ("model.architecture=qwen9", "unknown architecture 'qwen9'; presets: "),
])
def test_unknown_names_get_a_suggestion_only_when_one_is_close(override, message):
    with pytest.raises(ValueError) as err:
        load_recipe(TINY, [override])
    assert message in str(err.value)
    assert ("did you mean" in str(err.value)) is ("did you mean" in message)


def test_bad_recipe_under_torchrun_exits_nonzero_on_every_rank(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
         "megatron_rlcorr.train", "--config", str(TINY), "trainer.stpes=3"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode != 0
    assert proc.stderr.count('unknown key trainer.stpes (did you mean "steps"?)') == 1  # printed once, rank 0
    # Only torchrun's own report of the failed child; no traceback from the recipe check.
    assert "ValueError" not in proc.stderr and "megatron_rlcorr/" not in proc.stderr


def test_cli_presets_lists_every_preset_with_its_settings(capsys):
    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert f"\n{name}(" in "\n" + out
    block = out[out.index("pg_rs("):]
    assert "rs_threshold=1.001" in block and "bypass (2-policy), policy gradient" in block
    for line in ("rollout_rs: geometric", "rollout_token_veto_threshold: 0.0001", "bypass_mode: True",
                 "use_policy_gradient: True"):
        assert f"    {line}" in block
    disabled = out[out.index("disabled("):out.index("decoupled_token_is(")]
    assert "metrics only" in disabled


def test_cli_train_validates_before_launching(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: pytest.fail("launched a bad recipe"))
    assert cli.main(["train", "--config", str(TINY), "--nproc", "3"]) == train.EXIT_BAD_RECIPE
    assert "data-parallel size 3" in capsys.readouterr().err
    launched = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: launched.append(cmd) or 0)
    out = f"trainer.output_dir={tmp_path}"  # not ./runs, whose old runs would be resumed
    assert cli.main(["train", "--config", str(TINY), "--nproc", "2", "trainer.steps=1", out]) == 0
    assert launched[0][1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                               "megatron_rlcorr.train", "--config", str(TINY), "trainer.steps=1", out]


def test_cli_train_counts_the_rollout_ranks(capsys, monkeypatch, tmp_path):
    """Without --nproc, `train` launches tp*pp*cp trainer ranks plus rollout.num_ranks with
    placement separate; a --nproc too small for the recipe is refused naming the one to pass."""
    launched = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: launched.append(cmd) or 0)
    out = f"trainer.output_dir={tmp_path}"
    assert cli.main(["train", "--config", str(ASYNC), out]) == 0  # 1 trains, 1 generates
    assert cli.main(["train", "--config", str(ASYNC), "rollout.num_ranks=2", "parallel.tp=2", out]) == 0
    assert cli.main(["train", "--config", str(TINY), out]) == 0  # colocated: tp*pp*cp alone, as before
    assert [cmd[4] for cmd in launched] == ["--nproc_per_node=2", "--nproc_per_node=4", "--nproc_per_node=1"]
    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: pytest.fail("launched a launch too small"))
    assert cli.main(["train", "--config", str(ASYNC), "--nproc", "1", out]) == train.EXIT_BAD_RECIPE
    assert ("--nproc 1 is too few: the trainer needs parallel tp*pp*cp = 1 rank(s) and rollout.placement: separate "
            "puts rollout.num_ranks=1 more after them: pass --nproc 2 (or more: a multiple of 1 for the trainer, "
            "plus 1)") in capsys.readouterr().err
    assert cli.main(["train", "--config", str(TINY), "--nproc", "1", "parallel.tp=2", out]) == train.EXIT_BAD_RECIPE
    assert ("--nproc 1 is too few: one model replica takes parallel tp*pp*cp = 2 ranks: pass --nproc 2 (or a "
            "multiple of it)") in capsys.readouterr().err


def test_async_recipe_is_ppo_is_bypass_on_rollout_ranks_apart():
    """recipes/tiny_cpu_async.yaml: tiny_cpu.yaml with one rollout rank apart and the correction
    docs/async.md advises at a high learning rate (the DAPO block rejected most one-step-stale tokens)."""
    recipe, tiny = load_recipe(ASYNC), load_recipe(TINY)
    assert recipe.algorithm.rollout_correction == RolloutCorrectionConfig.ppo_is_bypass()
    assert (recipe.rollout.placement, recipe.rollout.num_ranks, recipe.rollout.staleness) == ("separate", 1, 1)
    assert (recipe.model, recipe.optim, recipe.data) == (tiny.model, tiny.optim, tiny.data)
    assert recipe.default_launch_world == 2 and recipe.check_launch(2) == 1 and recipe.check_launch(3) == 2


def test_bypass_pg_batch_norm_needs_one_micro_batch_per_rank():
    overrides = ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.use_policy_gradient=true",
                 "trainer.micro_batch_size=16"]  # tiny: 16 prompts x 8 samples / dp 2 = 64 sequences per rank
    with pytest.raises(ValueError, match="trainer.micro_batch_size=64"):
        load_recipe(TINY, overrides).check_layout(2)
    assert load_recipe(TINY, overrides[:2] + ["trainer.micro_batch_size=64"]).check_layout(2) == 2
    relaxed = overrides + ["algorithm.rollout_correction.rollout_is_batch_normalize=false"]
    assert load_recipe(TINY, relaxed).check_layout(2) == 2
    packed = overrides[:2] + ["trainer.micro_batch_size=64", "trainer.max_tokens_per_micro_batch=512"]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch: 0"):
        load_recipe(TINY, packed).check_layout(2)


def test_token_budget_must_hold_the_longest_possible_sequence():
    import dataclasses

    def with_prompt_limit(overrides, limit):
        recipe = load_recipe(TINY, overrides)
        return dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, max_prompt_length=limit))

    # 8-token prompts + 4 new tokens: 12 per rank; under cp2 padded to 12 (a multiple of 4), 6 per rank
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=10 cannot hold.*at least 12"):
        with_prompt_limit(["trainer.max_tokens_per_micro_batch=10"], 8).check_layout(2)
    assert with_prompt_limit(["trainer.max_tokens_per_micro_batch=12"], 8).check_layout(2) == 2
    assert with_prompt_limit(["trainer.max_tokens_per_micro_batch=6", "parallel.cp=2"], 8).check_layout(2) == 1
    # packing replaces micro_batch_size: it need not divide the sequences per rank any more
    assert load_recipe(TINY, ["trainer.max_tokens_per_micro_batch=64", "trainer.micro_batch_size=7"]).check_layout(2)


def test_other_ranks_report_a_bad_recipe_after_rank_0_had_time_to(monkeypatch, capsys):
    naps = []
    monkeypatch.setattr(runtime.time, "sleep", naps.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert train.main(["--config", str(TINY), "trainer.stpes=3"]) == train.EXIT_BAD_RECIPE
    assert naps == [runtime.REPORT_GRACE_S]  # under torchrun, rank 0's exit stops this rank here
    assert capsys.readouterr().err.startswith(f"error: recipe {TINY} (rank 1): ")


def test_expert_layout_counts_the_ranks_of_a_pipeline_stage():
    """ep * etp divides tp*cp*dp, the ranks of one stage: the same ep*etp that fits 4 ranks of one stage does
    not fit 2 stages of 2."""
    assert load_recipe(TINY, [MOE, "parallel.ep=2"]).check_model_layout(2, here=False) == 2
    assert load_recipe(TINY, [MOE, "parallel.ep=2", "parallel.etp=2"]).check_model_layout(4, here=False) == 4
    assert load_recipe(TINY, [MOE, "parallel.ep=2", "parallel.cp=2"]).check_model_layout(4, here=False) == 2
    assert load_recipe(TINY, [MOE, "parallel.ep=2", "parallel.pp=2"]).check_model_layout(4, here=False) == 2
    with pytest.raises(ValueError, match=r"ep\*etp = 2\*2 = 4 must divide the 2 ranks .* parallel.pp=2\): use "
                                         r"parallel.ep in 1 \(with this etp\), or launch a multiple of 8 processes"):
        load_recipe(TINY, [MOE, "parallel.ep=2", "parallel.etp=2", "parallel.pp=2"]).check_model_layout(4, here=False)


def test_every_shipped_recipe_loads(tiny_hf, tiny_hf_moe, tmp_path, monkeypatch):
    """Every recipes/*.yaml loads (the CPU ones that read a made checkpoint from runs/, where demo.sh puts
    tools/make_tiny_hf.py's files), named after its file; the MoE ones read their experts."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny_hf_files").symlink_to(tiny_hf)
    (tmp_path / "runs" / "tiny_hf_moe_files").symlink_to(tiny_hf_moe)
    monkeypatch.chdir(tmp_path)
    paths = sorted((ROOT / "recipes").glob("*.yaml"))
    assert len(paths) >= 16
    for path in paths:
        recipe = load_recipe(path)
        assert recipe.name == path.stem
    moe = {p.stem: load_recipe(p) for p in paths if load_recipe(p).model.moe is not None}
    assert set(moe) == {"tiny_hf_moe_cpu", "dapo_qwen3_30b_a3b_rollout_corr"}
    assert all(r.rollout.routing_replay for r in moe.values())
