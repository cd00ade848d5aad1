"""`megatron-rlcorr import-verl`: verl run scripts and configs -> recipe YAML and the import report.

The scripts in tests/verl_scripts/ are written in verl's format for these tests: bash with
defaults, arithmetic and $(basename ...), launched by `ray job submit -- python3 -m
recipe.dapo.main_dapo` or `python3 -m verl.trainer.main_ppo`; a verl YAML config; a script whose
commands must never run; a script with no launch. The verl_head_*.sh scripts are verl's own (see
tests/verl_scripts/README.md; test_verl_truth.py checks what the import says of them).
"""
from __future__ import annotations

import subprocess
import sys
import re
from pathlib import Path

import pytest
import yaml

from megatron_rlcorr.cli import main
from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.recipe.verl import DIFFERENCES, format_report, import_verl, parse_hydra_value, recipe_yaml
from megatron_rlcorr.recipe.verl_script import run_script

SCRIPTS = Path(__file__).resolve().parents[1] / "verl_scripts"
DAPO = SCRIPTS / "dapo_qwen2_5_32b_rollout_corr.sh"
GRPO = SCRIPTS / "grpo_qwen2_5_7b_kl_fsdp.sh"
CONFIG = SCRIPTS / "dapo_config.yaml"
HOME = {"HOME": "/home/tester"}


@pytest.fixture(scope="module")
def dapo():
    return import_verl(DAPO, env=HOME)


@pytest.fixture(scope="module")
def grpo():
    return import_verl(GRPO, env=HOME)


def _mapped(result) -> dict[str, tuple[str, object]]:
    """verl key -> (recipe key, value); a key mapped twice keeps its first recipe key."""
    out: dict[str, tuple[str, object]] = {}
    for verl, ours, value in result.mapped:
        out.setdefault(verl, (ours, value))
    return out


def _reasons(pairs) -> dict[str, str]:
    return dict(pairs)


# ---- the DAPO script (ray job submit -- python3 -m recipe.dapo.main_dapo) ------------------------

def test_dapo_script_resolves_the_shell_and_maps_every_section(dapo):
    tree = dapo.tree
    assert list(tree) == ["name", "model", "parallel", "rollout", "data", "algorithm", "optim", "trainer"]
    assert tree["name"] == "DAPO-Qwen2.5-32B-RC-dapo_qwen2_5_32b_rollout_corr"    # $(basename "$0" .sh)
    # offload=True: the actor's megatron.param_offload / grad_offload / optimizer_offload (training/offload.py)
    assert tree["model"] == {"hf_checkpoint": "/home/tester/verl/models/Qwen2.5-32B", "bf16": True,
                             "offload_params": True, "offload_grads": True}
    # verl's Megatron default: sequence parallelism on (the checkpoint is not here: no layout search)
    assert tree["parallel"] == {"tp": 8, "pp": 1, "sequence_parallel": True}
    # no rollout.name, vLLM's settings given: vLLM, with its tensor-parallel size and memory share
    assert tree["rollout"] == {"engine": "vllm", "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 20480,
                               "n": 16, "tensor_parallel_size": 4, "gpu_memory_utilization": 0.8,
                               "val_kwargs": {"n": 1, "temperature": 1.0, "top_p": 0.7, "do_sample": True}}
    assert tree["data"] == {"train_files": ["/home/tester/verl/data/dapo-math-17k.parquet"],
                            "val_files": ["/home/tester/verl/data/aime-2024.parquet"], "prompt_key": "prompt",
                            "max_prompt_length": 2048, "prompts_per_step": 512, "reward": "dapo_math"}
    algo = tree["algorithm"]
    assert algo["advantage_estimator"] == "grpo"
    assert algo["dynamic_sampling"] == {"enabled": True, "metric": "acc", "max_num_gen_batches": 10,
                                        "on_exhausted": "error"}
    assert algo["overlong_penalty"] == {"enabled": True, "buffer": 4096, "penalty": 1.0}
    assert algo["kl_loss"] == {"enabled": False, "coef": 0.0}
    assert algo["kl_in_reward"] == {"enabled": False, "coef": 0.0}
    assert algo["reference"] == {"offload": True}
    assert algo["loss"] == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 10.0,
                            "loss_agg_mode": "token-mean", "entropy_coeff": 0.0}
    assert tree["optim"] == {"lr": 1e-6, "warmup_steps": 10, "weight_decay": 0.1, "clip_grad": 1.0,
                             "offload_optimizer": True}
    # ppo_mini_batch_size=$((train_prompt_bsz / 16)) with train_prompt_bsz=512
    assert tree["trainer"] == {"steps": 200, "mini_batch_prompts": 32, "max_tokens_per_micro_batch": 45056,
                               "save_every": 5, "logger": ["console", "wandb"], "project_name": "DAPO",
                               "experiment_name": tree["name"], "test_freq": 5, "val_before_train": True}


def test_dapo_rollout_correction_block_is_the_scripts(dapo):
    block = dapo.tree["algorithm"]["rollout_correction"]
    assert block == {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": True,
                     "rollout_rs": "geometric", "rollout_rs_threshold": 1.01, "rollout_rs_threshold_lower": 0.99,
                     "rollout_token_veto_threshold": 1e-4, "bypass_mode": False}
    expected = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0,
                                       rollout_is_batch_normalize=True, rollout_rs="geometric",
                                       rollout_rs_threshold=1.01, rollout_rs_threshold_lower=0.99,
                                       rollout_token_veto_threshold=1e-4)
    assert RolloutCorrectionConfig.from_dict(block) == expected
    # and after a round trip through the written YAML
    written = yaml.safe_load(recipe_yaml(dapo))
    assert RolloutCorrectionConfig.from_dict(written["algorithm"]["rollout_correction"]) == expected


def test_dapo_report_lists(dapo):
    mapped = _mapped(dapo)
    assert mapped["data.train_batch_size"] == ("data.prompts_per_step", 512)
    assert mapped["actor_rollout_ref.actor.ppo_mini_batch_size"] == ("trainer.mini_batch_prompts", 32)
    assert mapped["data.max_response_length"] == ("rollout.max_new_tokens", 20480)
    assert mapped["reward_model.reward_manager"] == ("data.reward", "dapo_math")
    assert mapped["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"] == ("parallel.tp", 8)
    assert mapped["actor_rollout_ref.actor.grad_clip"] == ("optim.clip_grad", 1.0)
    assert ("algorithm.filter_groups.enable", "algorithm.dynamic_sampling.on_exhausted", "error") in dapo.mapped
    assert ("(verl's default dtype: bf16)", "model.bf16", True) in dapo.mapped
    differs = _reasons(dapo.differs)
    engine = "(no actor_rollout_ref.rollout.name: vllm, the engine the source's actor_rollout_ref.rollout.* settings are for)"
    assert ("(no actor_rollout_ref.rollout.name: vllm, the engine the source's actor_rollout_ref.rollout.* settings "
            "are for)", "rollout.engine", "vllm") in dapo.mapped
    assert differs == {
        "algorithm.filter_groups.enable": DIFFERENCES["dynamic_sampling"],
        "algorithm.rollout_correction.rollout_is": DIFFERENCES["decoupled_correction"],
        "actor_rollout_ref.actor.loss_agg_mode": DIFFERENCES["loss_agg_mode"],
        "trainer.logger": DIFFERENCES["trackers"],
        engine: DIFFERENCES["vllm_engine"],
    }
    assert "micro-batch" in differs["actor_rollout_ref.actor.loss_agg_mode"]
    unmapped = _reasons(dapo.unmapped)
    # verl's dynamic batch size: (2048 + 20480) * 2 tokens per GPU -> packed micro-batches
    assert mapped["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == ("trainer.max_tokens_per_micro_batch", 45056)
    assert "packed micro-batches" in unmapped["actor_rollout_ref.actor.use_dynamic_bsz"]
    assert "pack with the actor's budget" in unmapped["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"]
    assert mapped["actor_rollout_ref.rollout.gpu_memory_utilization"] == ("rollout.gpu_memory_utilization", 0.8)
    assert mapped["actor_rollout_ref.rollout.tensor_model_parallel_size"] == ("rollout.tensor_parallel_size", 4)
    assert "engine_arguments" in unmapped["actor_rollout_ref.rollout.enable_chunked_prefill"]
    assert "keep rate" in unmapped["data.gen_batch_size"]
    assert mapped["trainer.test_freq"] == ("trainer.test_freq", 5)
    assert mapped["actor_rollout_ref.rollout.val_kwargs.top_p"] == ("rollout.val_kwargs.top_p", 0.7)
    assert mapped["trainer.logger"] == ("trainer.logger", ["console", "wandb"])
    assert mapped["trainer.project_name"] == ("trainer.project_name", "DAPO")
    assert ("trainer.experiment_name", "trainer.experiment_name", dapo.tree["name"]) in dapo.mapped
    # the layout for 16 x 8 GPUs needs the architecture: the note names the command that chooses it
    assert "NNODES=16 GPUS_PER_NODE=8" in unmapped["trainer.n_gpus_per_node"]
    assert "model.architecture=<name>" in unmapped["trainer.n_gpus_per_node"]
    assert ("megatron-rlcorr plan RECIPE --nodes 16 --gpus-per-node 8 --search"
            in unmapped["trainer.n_gpus_per_node"])
    assert unmapped["trainer.nnodes"] == "see trainer.n_gpus_per_node"
    assert "never truncated" in unmapped["data.truncation"]
    assert "base config" in unmapped["--config-name=dapo_megatron_trainer.yaml"]
    # total_epochs=1 with total_training_steps=200: the train file is not here to count an epoch's steps
    assert "not on this machine" in unmapped["trainer.total_epochs"]
    assert "1 x (rows of data.train_files // data.gen_batch_size 1536)" in unmapped["trainer.total_epochs"]
    # every override of the launch is accounted for exactly once (mapped, or not mapped)
    overrides = {a.split("=", 1)[0].lstrip("+") for a in dapo.launch[dapo.launch_args:] if "=" in a}
    accounted = {v for v, _, _ in dapo.mapped} | {v for v, _ in dapo.unmapped}
    assert overrides - accounted == {"--config-name"}
    assert dapo.launch[:3] == ["ray", "job", "submit"] and "recipe.dapo.main_dapo" in dapo.launch


def test_report_text_has_the_three_lists(dapo):
    text = format_report(dapo)
    assert f"mapped ({len(dapo.mapped)}):" in text and "meaning differs (5):" in text and f"not mapped ({len(dapo.unmapped)}):" in text
    assert "  data.train_batch_size -> data.prompts_per_step = 512" in text
    assert "  actor_rollout_ref.actor.optim.lr -> optim.lr = 1e-06" in text
    assert f"  actor_rollout_ref.actor.loss_agg_mode: {DIFFERENCES['loss_agg_mode']}" in text
    assert "launch: ray job submit" in text and "recipe.dapo.main_dapo ... (" in text


# ---- the GRPO script (python3 -m verl.trainer.main_ppo, FSDP) ------------------------------------

def test_grpo_script_kl_loss_and_fsdp_settings(grpo):
    tree = grpo.tree
    assert tree["algorithm"]["kl_loss"] == {"enabled": True, "coef": 0.001, "type": "low_var_kl"}
    assert tree["algorithm"]["kl_in_reward"] == {"enabled": False}
    assert tree["algorithm"]["reference"] == {"offload": True}
    assert tree["algorithm"]["loss"] == {"loss_agg_mode": "seq-mean-token-sum-norm", "entropy_coeff": 0.0}
    assert tree["data"]["train_files"] == ["/home/tester/data/gsm8k/train.parquet",
                                           "/home/tester/data/gsm8k/train_extra.parquet"]
    assert tree["data"]["on_long_prompt"] == "drop"
    assert tree["rollout"] == {"engine": "vllm", "precision": "bf16", "max_new_tokens": 1024, "n": 5,
                               "tensor_parallel_size": 2, "gpu_memory_utilization": 0.6}
    assert tree["optim"] == {"lr": 1e-6, "min_lr": 1e-7, "decay_style": "cosine", "offload_optimizer": False}
    # FSDP's gradient checkpointing: each layer's input kept, the layer run again (full, uniform, 1 layer)
    assert tree["model"]["recompute"] == {"granularity": "full", "method": "uniform", "num_layers": 1}
    assert tree["model"]["offload_params"] is False                    # fsdp_config.param_offload
    assert tree["data"]["val_files"] == ["/home/tester/data/gsm8k/test.parquet"]
    assert tree["trainer"] == {"mini_batch_prompts": 256, "micro_batch_size": 8, "max_tokens_per_micro_batch": 24000,
                               "save_every": 0, "logger": ["console", "tensorboard"],
                               "project_name": "verl_grpo_example_gsm8k", "experiment_name": "qwen2_5_7b_function_rm_kl",
                               "test_freq": 5, "val_before_train": False}  # $((64 / 8))
    assert "parallel" not in tree and "steps" not in tree["trainer"]
    unmapped = _reasons(grpo.unmapped)
    assert "Ulysses" in unmapped["actor_rollout_ref.actor.ulysses_sequence_parallel_size"]
    assert "packed micro-batches" in unmapped["actor_rollout_ref.actor.use_dynamic_bsz"]
    assert "set trainer.steps to 15 x (rows of data.train_files // data.train_batch_size 1024)" in unmapped[
        "trainer.total_epochs"]
    assert "needs the run's length" in unmapped["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"]
    assert "megatron-rlcorr train --config RECIPE --nproc 8" in unmapped["trainer.n_gpus_per_node"]
    differs = _reasons(grpo.differs)
    assert differs["actor_rollout_ref.actor.use_kl_loss"] == DIFFERENCES["entropy_kl_aggregation"]
    assert differs["trainer.save_freq"] == DIFFERENCES["save_freq"]
    assert differs["actor_rollout_ref.rollout.name"] == DIFFERENCES["vllm_engine"]
    loss_agg = [reason for key, reason in grpo.differs if key == "actor_rollout_ref.actor.loss_agg_mode"]
    assert loss_agg == [DIFFERENCES["loss_agg_mode"], DIFFERENCES["loss_scale_factor"]]


def test_environment_changes_resolved_values(grpo):
    four = import_verl(GRPO, env={**HOME, "NUM_GPUS": "4", "MODEL": "/models/q7b"})
    assert four.tree["trainer"]["micro_batch_size"] == 16        # $((64 / NUM_GPUS))
    assert four.tree["model"]["hf_checkpoint"] == "/models/q7b"
    assert grpo.tree["trainer"]["micro_batch_size"] == 8
    assert grpo.tree["model"]["hf_checkpoint"] == "Qwen/Qwen2.5-7B-Instruct"
    assert ("trainer.n_gpus_per_node=4" in four.launch) and ("trainer.n_gpus_per_node=8" in grpo.launch)


def test_reward_follows_the_data_source_of_the_train_files(tmp_path, grpo):
    from tests.hf_fixtures import dapo_row, write_parquet

    for name in ("train", "train_extra"):
        write_parquet(tmp_path / f"{name}.parquet", [dapo_row("What is 1+1?", "2")])
    result = import_verl(GRPO, env={**HOME, "DATA_DIR": str(tmp_path)})
    assert result.tree["data"]["reward"] == "dapo_math"
    assert ("(data_source math_dapo of data.train_files)", "data.reward", "dapo_math") in result.mapped
    assert "reward" not in grpo.tree["data"]        # the files are not there: say so
    assert "could not be read" in _reasons(grpo.unmapped)["(reward)"]


# ---- a verl YAML config and override files ------------------------------------------------------

def test_yaml_config():
    result = import_verl(CONFIG)
    tree = result.tree
    assert tree["parallel"] == {"tp": 2, "pp": 2, "cp": 2, "sequence_parallel": True}
    assert tree["rollout"] == {"engine": "vllm", "precision": "fp8", "temperature": 0.9, "top_p": 1.0,
                               "max_new_tokens": 4096, "n": 8}
    assert tree["algorithm"]["advantage_estimator"] == "rloo"
    assert tree["algorithm"]["kl_in_reward"] == {"enabled": True, "coef": 0.002, "type": "low_var_kl",
                                                 "controller": "adaptive", "target_kl": 0.1, "horizon": 10000}
    assert tree["algorithm"]["dynamic_sampling"]["metric"] == "reward"
    assert tree["algorithm"]["loss"]["loss_type"] == "ppo_clip"
    assert tree["algorithm"]["rollout_correction"] == {"rollout_is": "token", "rollout_is_threshold": 2.0,
                                                       "rollout_rs": None, "bypass_mode": True,
                                                       "use_policy_gradient": False}   # _target_ dropped
    # lr_warmup_steps -1: int(lr_warmup_steps_ratio 0.1 * total_training_steps 300)
    assert tree["optim"] == {"lr": 2e-6, "min_lr": 0.0, "warmup_steps": 30, "decay_style": "cosine",
                             "weight_decay": 0.01, "clip_grad": 0.5}
    assert tree["trainer"] == {"steps": 300, "mini_batch_prompts": 16, "micro_batch_size": 2, "ppo_epochs": 1,
                               "seed": 7, "save_every": 50, "logger": ["console"],
                               "experiment_name": "qwen3_8b_dapo_yaml"}
    assert "reward" not in tree["data"]
    differs = _reasons(result.differs)
    assert differs["actor_rollout_ref.actor.kl_loss_type"] == DIFFERENCES["straight_through_kl"]
    assert differs["algorithm.filter_groups.metric"] == DIFFERENCES["seq_final_reward"]
    assert differs["algorithm.rollout_correction.bypass_mode"] == DIFFERENCES["bypass_mode"]
    unmapped = _reasons(result.unmapped)
    assert "package.module:function" in unmapped["custom_reward_function.path"]
    assert "/home/me/rewards/my_math.py" in unmapped["custom_reward_function.path"]
    assert ("actor_rollout_ref.actor.megatron.sequence_parallel", "parallel.sequence_parallel", True) in result.mapped
    assert "data.max_response_length" in unmapped["actor_rollout_ref.rollout.response_length"]  # ${...} resolved
    assert set(unmapped) >= {"defaults", "hydra"}


def test_override_files(tmp_path):
    text = tmp_path / "overrides.txt"
    text.write_text("# verl overrides\n"
                    "data.train_batch_size=64 data.train_files=[a.parquet,b.parquet]\n"
                    "+actor_rollout_ref.actor.optim.lr=3e-7 \\\n"
                    "++algorithm.rollout_correction.rollout_is=token\n"
                    "actor_rollout_ref.rollout.n=4\n"
                    "~actor_rollout_ref.rollout.n\n"
                    "trainer.experiment_name='my run'\n")
    result = import_verl(text)
    assert result.kind == "overrides"
    assert result.tree == {"name": "my run", "model": {"bf16": True},
                           "data": {"train_files": ["a.parquet", "b.parquet"], "prompts_per_step": 64},
                           "algorithm": {"rollout_correction": {"rollout_is": "token"}}, "optim": {"lr": 3e-7},
                           "trainer": {"experiment_name": "my run"}}
    assert "deletes a key" in _reasons(result.unmapped)["~actor_rollout_ref.rollout.n"]
    hydra_list = tmp_path / "overrides.yaml"          # Hydra's .hydra/overrides.yaml
    hydra_list.write_text("- data.train_batch_size=32\n- algorithm.adv_estimator=gae\n")
    result = import_verl(hydra_list)
    assert result.tree["data"] == {"prompts_per_step": 32}
    assert "only grpo and rloo" in _reasons(result.unmapped)["algorithm.adv_estimator"]


@pytest.mark.parametrize("text, value", [
    ("True", True), ("false", False), ("1e-6", 1e-6), ("1E+3", 1000.0), ("2.0", 2.0), ("512", 512),
    ("null", None), ("[a.parquet,b.parquet]", ["a.parquet", "b.parquet"]), ("'left'", "left"),
    ('"[1, 2]"', "[1, 2]"), ("yes", "yes"), ("off", "off"), ("", ""), ("token-mean", "token-mean"),
    ("['console','wandb']", ["console", "wandb"]),
])
def test_hydra_values(text, value):
    assert parse_hydra_value(text) == value and type(parse_hydra_value(text)) is type(value)


# ---- the sandbox --------------------------------------------------------------------------------

def test_dangerous_commands_never_run(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "sentinel").write_text("still here")
    env = {"SENTINEL_DIR": str(victim), "HOME": str(tmp_path)}
    run = run_script(SCRIPTS / "dangerous.sh", env=env)
    assert (victim / "sentinel").read_text() == "still here"
    assert sorted(p.name for p in victim.iterdir()) == ["sentinel"]      # no redirect, no touch
    assert run.commands[0] == ["rm", "-rf", str(victim)]
    # `curl ... | bash`: both sides of the pipeline run at once, so either may be recorded first
    assert sorted(run.commands[1:3]) == [["bash"], ["curl", "-fsSL", "https://example.invalid/install.sh"]]
    assert run.commands[3] == ["touch", f"{victim}/touched"]
    assert "/bin/rm: restricted" in run.stderr and "cannot redirect output" in run.stderr
    result = import_verl(SCRIPTS / "dangerous.sh", env=env)    # `exec python3 -m ...` is the launch
    assert result.tree["data"] == {"prompts_per_step": 8} and result.tree["rollout"] == {"n": 2}
    assert (victim / "sentinel").exists()


def test_sandbox_stand_ins(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text('set -euo pipefail\n'
                      'here=$(cd "$(dirname "$0")" && pwd)\n'
                      'python3 -m verl.trainer.main_ppo a.b="$(basename /x/y/model.tar .tar)" c.d="$(dirname /x/y/z)" '
                      'e.f=$(date +%Y%m%d) g.h=$(nproc) i.j=$(realpath -m ./k) k.l="$here" m.n="$(nvidia-smi -L)" '
                      'o.p=$HOME/q\n')
    run = run_script(script, env={"HOME": "/home/tester"})
    assert run.commands[-1][3:] == ["a.b=model", "c.d=/x/y", "e.f=20250101-000000", "g.h=8", "i.j=./k",
                                    f"k.l={tmp_path}", "m.n=", "o.p=/home/tester/q"]


def test_pipelines_and_long_arguments_are_recorded_whole(tmp_path):
    # verl's quick-start form: the launch piped into tee with xtrace on; tee's stand-in returns at once
    long_value = "é" * 1500 + "x" * 2500
    script = tmp_path / "tee.sh"
    script.write_text("set -xeuo pipefail\n"
                      "for seed in 1 2 3; do\n"
                      f"  python3 -m verl.trainer.main_ppo data.seed=$seed a.b={long_value} 2>&1 | tee log_$seed.txt\n"
                      "done\n")
    for _ in range(3):
        commands = run_script(script, env={}).commands
        assert len(commands) == 6
        launches = [c for c in commands if c[0] == "python3"]
        assert launches == [["python3", "-m", "verl.trainer.main_ppo", f"data.seed={seed}", f"a.b={long_value}"]
                            for seed in (1, 2, 3)]


def test_a_script_that_never_ends_is_stopped(tmp_path):
    script = tmp_path / "wait.sh"
    script.write_text("while true; do sleep 1; done\n")
    with pytest.raises(ValueError, match=r"did not finish within 1 s"):
        run_script(script, env={}, timeout=1.0)


# ---- errors -------------------------------------------------------------------------------------

def test_no_launch_is_an_error():
    with pytest.raises(ValueError, match=r"no_launch.sh: no verl launch command found .*the script ran python3 "
                                         r"examples/data_preprocess/gsm8k.py --local_dir"):
        import_verl(SCRIPTS / "no_launch.sh", env=HOME)


def test_unset_variable_error_says_to_set_it(tmp_path):
    script = tmp_path / "needs_env.sh"
    script.write_text("set -u\nbsz=$((NUM_GPUS * 8))\npython3 -m verl.trainer.main_ppo data.train_batch_size=$bsz\n")
    with pytest.raises(ValueError, match=r"NUM_GPUS: unbound variable.*set them when you import"):
        import_verl(script, env={})
    assert import_verl(script, env={"NUM_GPUS": "2"}).tree["data"] == {"prompts_per_step": 16}


def test_values_that_cannot_be_converted(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("data.max_prompt_length=1024\ndata.train_batch_size=lots\n")
    with pytest.raises(ValueError, match=r"bad.txt: data.train_batch_size=lots \(line 2\): expected an integer"):
        import_verl(bad)
    bad.write_text("algorithm.rollout_correction.rollout_is=seqence\n")
    with pytest.raises(ValueError, match=r"algorithm.rollout_correction: rollout_is must be .*did you mean "
                                         r"\"sequence\"\?\) \(line 1\)"):
        import_verl(bad)
    with pytest.raises(ValueError, match=r"nothere.sh: no such file"):
        import_verl(tmp_path / "nothere.sh")


# ---- the command line ---------------------------------------------------------------------------

def test_cli_writes_the_recipe_and_prints_the_report(tmp_path, capsys):
    out = tmp_path / "recipes" / "dapo.yaml"
    assert main(["import-verl", str(CONFIG), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = import_verl(CONFIG)
    assert f"mapped ({len(result.mapped)}):" in printed and f"meaning differs ({len(result.differs)}):" in printed
    assert f"not mapped ({len(result.unmapped)}):" in printed
    assert f"wrote {out}" in printed
    text = out.read_text()
    assert text.startswith(f"# Imported from {CONFIG}") and "Check every path" in text
    assert yaml.safe_load(text) == import_verl(CONFIG).tree


@pytest.mark.parametrize("source, message", [
    ("no_launch.sh", "no verl launch command found"),
    ("missing.sh", "missing.sh: no such file"),
])
def test_cli_errors_exit_2(tmp_path, capsys, source, message):
    assert main(["import-verl", str(SCRIPTS / source), "--out", str(tmp_path / "r.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: import-verl: ") and message in err
    assert not (tmp_path / "r.yaml").exists()


def test_the_importer_does_not_import_megatron():
    code = ("import sys, megatron_rlcorr.recipe.verl; "
            "sys.exit(1 if any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- the written YAML is a recipe (needs the schema with kl_loss, mini_batch_prompts, ...) ----------

def test_written_recipe_loads(tmp_path):
    from megatron_rlcorr.recipe import load_recipe
    from tests.hf_fixtures import dapo_row, write_parquet
    from tests.hf_models import make_checkpoint

    model = make_checkpoint(tmp_path / "model", "qwen2")
    train = write_parquet(tmp_path / "dapo.parquet", [dapo_row(f"What is {i}+1?", str(i + 1), i) for i in range(4)])
    out = tmp_path / "dapo.yaml"
    result = import_verl(DAPO, env={**HOME, "MODEL_PATH": str(model), "TRAIN_FILE": str(train)})
    assert result.tree["model"]["hf_checkpoint"] == str(model)
    out.write_text(recipe_yaml(result))
    recipe = load_recipe(out)
    assert recipe.model.hf_checkpoint == str(model) and recipe.data.train_files == [str(train)]
    assert (recipe.parallel.tp, recipe.data.prompts_per_step, recipe.rollout.n) == (8, 512, 16)
    assert recipe.trainer.mini_batch_prompts == 32 and recipe.trainer.steps == 200
    ds = recipe.algorithm.dynamic_sampling
    assert (ds.enabled, ds.metric, ds.max_num_gen_batches, ds.on_exhausted) == (True, "acc", 10, "error")
    assert (recipe.algorithm.loss.clip_ratio_low, recipe.algorithm.loss.clip_ratio_high) == (0.2, 0.28)
    assert recipe.algorithm.reference.offload is True and recipe.algorithm.kl_loss.enabled is False
    assert recipe.algorithm.rollout_correction == RolloutCorrectionConfig.from_dict(
        result.tree["algorithm"]["rollout_correction"])


# ---- every message is true of the code as it is now ------------------------------------------------

# verl's DAPO scripts (and the other sources) in tests/verl_scripts, with the environment each needs
SOURCES = {"dapo_qwen2_5_32b_rollout_corr.sh": HOME, "dapo_qwen2_5_32b_fsdp.sh": HOME,
           "grpo_qwen2_5_7b_kl_fsdp.sh": HOME, "dapo_config.yaml": None,
           **{name: HOME for name in ("verl_head_dapo_7b_math_megatron_4_12.sh",
                                      "verl_head_run_qwen30_a3b_megatron_vllm.sh",
                                      "verl_head_run_qwen3_4b_dapo_multiturn.sh",
                                      "verl_head_run_qwen3-235b_megatron_96gb.sh")}}
# Phrases that once named a feature as missing which this project now has (validation, trackers,
# the vLLM engine and its settings, top-k, offload, the layout search): none may come back.
STALE = ("validation is not run", "later release", "does not have yet", "not yet", "metrics go to runs/<name>",
         "(and TensorBoard)", "sampling here is set by rollout.temperature and rollout.top_p only",
         "set the matching rollout.* key by hand", "import-verl does not map",
         "logging:", "this release")
# What "not supported" may still be said of: features this project does not have
NOT_SUPPORTED = ("model-based rewards are not supported",
                 "multi-turn and agent rollouts are not supported")
# verl's keys a message may name although the source does not set them
VERL_KEYS = ("trainer.total_training_steps", "trainer.total_epochs", "data.train_batch_size", "data.gen_batch_size",
             "data.max_prompt_length", "data.max_response_length", "data.filter_overlong_prompts")


def _recipe_schema() -> dict[str, type]:
    from megatron_rlcorr.data.tasks import DataSettings
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.parallel.layout import ParallelSettings
    from megatron_rlcorr.rl.settings import AlgorithmSettings, TrainerSettings
    from megatron_rlcorr.rollout.base import RolloutConfig
    from megatron_rlcorr.training.optimizer import OptimSettings

    return {"model": ModelConfig, "parallel": ParallelSettings, "rollout": RolloutConfig, "data": DataSettings,
            "algorithm": AlgorithmSettings, "optim": OptimSettings, "trainer": TrainerSettings}


def _is_recipe_key(dotted: str) -> bool:
    """A key of the recipe schema (nested settings followed through their defaults)."""
    import dataclasses

    section, *rest = dotted.split(".")
    node: object = _recipe_schema().get(section)
    for name in rest:
        if node is None or not dataclasses.is_dataclass(node):
            return True      # a mapping-valued setting (model.recompute, ...): its keys are free here
        fields = {f.name: f for f in dataclasses.fields(node)}
        if name not in fields:
            return False
        f = fields[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        node = type(default) if dataclasses.is_dataclass(default) else None
    return True


def _messages(result) -> list[str]:
    return ([f"{verl} -> {ours}" for verl, ours, _ in result.mapped] + [reason for _, reason in result.differs]
            + [reason for _, reason in result.unmapped])


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_message_is_true_of_the_code(name):
    result = import_verl(SCRIPTS / name, env=SOURCES[name])
    verl_keys = {verl for verl, _, _ in result.mapped} | {verl for verl, _ in result.unmapped}
    root = Path(__file__).resolve().parents[2]
    for message in _messages(result):
        for phrase in STALE:
            assert phrase not in message, f"{name}: stale message: {message}"
        if "not supported" in message:
            assert any(ok in message for ok in NOT_SUPPORTED), f"{name}: names a feature as missing: {message}"
        # every recipe key named exists in the recipe schema (verl's own keys are the source's)
        for dotted in re.findall(r"(?<![\w.])(?:model|parallel|rollout|data|algorithm|optim|trainer)(?:\.\w+)+", message):
            assert _is_recipe_key(dotted) or dotted in verl_keys or dotted in VERL_KEYS, (
                f"{name}: {dotted} is no recipe key: {message}")
        # every file named exists (the package's modules, tools/, docs/)
        for path in re.findall(r"(?<![\w./])[\w/]+\.(?:py|sh|md)\b", message):
            if "/" in path and not path.startswith("/"):
                assert (root / path).exists() or (root / "megatron_rlcorr" / path).exists(), f"{name}: {path}"
        for command in re.findall(r"megatron-rlcorr (\w[\w-]*)", message):
            assert command in ("train", "plan", "presets", "import-verl", "score", "eval", "export", "analyze")
    for key in ("trainer.logger", "trainer.test_freq", "trainer.val_before_train", "data.val_files",
                "actor_rollout_ref.rollout.val_kwargs.n", "actor_rollout_ref.rollout.tensor_model_parallel_size",
                "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.top_k"):
        # an empty value in the script, or an engine's setting the recipe's engine (not verl's sglang) has not
        if any(v == key and not r.startswith("empty in the source") and "the embedded engine" not in r
               for v, r in result.unmapped):
            raise AssertionError(f"{name}: {key} is a feature here but was not mapped")


# ---- verl's 32B DAPO scripts pass `plan` on their own 16 x 8 H100s ------------------------------------

DAPO_32B = ("dapo_qwen2_5_32b_rollout_corr.sh", "dapo_qwen2_5_32b_fsdp.sh")


def _plan(recipe: Path) -> dict:
    from megatron_rlcorr.plan import plan_report

    return plan_report(recipe, [], nodes=16, gpus_per_node=8)


@pytest.mark.parametrize("name", DAPO_32B)
def test_32b_dapo_import_fits_16x8_with_the_architecture_given(tmp_path, name):
    out = tmp_path / "dapo.yaml"
    assert main(["import-verl", str(SCRIPTS / name), "--out", str(out), "model.architecture=qwen2.5-32b"]) == 0
    result = import_verl(SCRIPTS / name, env=HOME, overrides=["model.architecture=qwen2.5-32b"])
    report = _plan(out)
    assert report["fits"] and report["world_size"] == 128, report["memory_gib_per_gpu"]
    assert report["memory_gib_per_gpu"]["total"] <= report["usable_gib"]
    # what makes it fit is the source's own: the vLLM engine's share, offload, and a layout plan --search chose
    layout, tree = report["layout"], result.tree
    assert (layout["rollout_engine"], layout["rollout_tensor_parallel_size"]) == ("vllm", 4)
    assert report["offload"]["params"] and report["offload"]["optimizer"]
    assert layout["tp"] == tree["parallel"]["tp"] and layout["sequence_parallel"] is (layout["tp"] > 1)
    derived = [ours for verl, ours, _ in result.mapped if verl.startswith("(plan --search for 16 x 8 GPUs")]
    assert "parallel.cp" in derived
    assert "the layout for them is plan --search's" in _reasons(result.unmapped)["trainer.n_gpus_per_node"]
    assert ("(command line)", "model.architecture", "qwen2.5-32b") in result.mapped
    # the chosen layout is the cheapest that fits among those keeping the source's tp/pp (verl's own search)
    from megatron_rlcorr.recipe.layout_search import search_layouts

    source = {k: v for k, v in (("tp", 8), ("pp", 1)) if name == DAPO_32B[0]}
    fitting = [c for c in search_layouts(out, [], nodes=16, gpus_per_node=8, gpu_memory_gib=80.0)
               if all(getattr(c, k) == v for k, v in source.items())]
    best = fitting[0]
    assert (best.tp, best.pp, best.cp) == (layout["tp"], layout["pp"], layout["cp"])
    assert (layout["recompute"] or "none") == best.recompute


def test_32b_dapo_import_fits_with_the_architecture_from_a_readable_checkpoint(tmp_path):
    import json

    from megatron_rlcorr.model.presets import ARCHITECTURES

    model = tmp_path / "Qwen2.5-32B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(ARCHITECTURES["qwen2.5-32b"]))
    out = tmp_path / "dapo.yaml"
    result = import_verl(DAPO, env={**HOME, "MODEL_PATH": str(model)})
    out.write_text(recipe_yaml(result))
    assert "architecture" not in result.tree["model"]
    report = _plan(out)
    assert report["fits"], report["memory_gib_per_gpu"]
    assert (report["layout"]["tp"], report["layout"]["pp"]) == (8, 1)       # the script's, kept
    # before the import chose the engine and the layout, the same script gave the embedded engine (a whole
    # copy of the model on every GPU) and no recomputation: 16 x 8 GPUs cannot hold that
    before = _plan_overrides(out, ["rollout.engine=embedded", "rollout.tensor_parallel_size=1", "model.recompute=null",
                                   "parallel.sequence_parallel=false"])
    assert not before["fits"]


def _plan_overrides(recipe: Path, overrides: list[str]) -> dict:
    from megatron_rlcorr.plan import plan_report

    return plan_report(recipe, overrides, nodes=16, gpus_per_node=8)


def test_without_the_architecture_the_layout_note_names_the_command(dapo):
    note = _reasons(dapo.unmapped)["trainer.n_gpus_per_node"]
    assert "is not a directory" in note          # why the recipe does not load here
    assert "import again with model.architecture=<name>" in note
    assert "megatron-rlcorr plan RECIPE --nodes 16 --gpus-per-node 8 --search model.architecture=<name>" in note


# ---- total_epochs -> trainer.steps from the train files ----------------------------------------------

def _rows(path: Path, count: int) -> Path:
    from tests.hf_fixtures import dapo_row, write_parquet

    return write_parquet(path, [dapo_row(f"What is {i}+1?", str(i + 1), i) for i in range(count)])


def test_total_epochs_counts_steps_from_the_train_files(tmp_path):
    fsdp = SCRIPTS / "dapo_qwen2_5_32b_fsdp.sh"
    # recipe.dapo: verl's loader batches data.gen_batch_size (3 x 512) prompts; the last partial batch is dropped
    train = _rows(tmp_path / "train.parquet", 3100)
    result = import_verl(fsdp, env={**HOME, "TRAIN_FILE": str(train)})
    assert result.tree["trainer"]["steps"] == 3100 // 1536 == 2
    assert _mapped(result)["trainer.total_epochs"] == ("trainer.steps", 2)
    assert _reasons(result.differs)["trainer.total_epochs"] == DIFFERENCES["epochs"]
    # main_ppo: data.train_batch_size; with total_training_steps too, the fewer of the two (verl stops at the first)
    script = tmp_path / "ppo.sh"
    script.write_text(f"python3 -m verl.trainer.main_ppo data.train_files={train} data.train_batch_size=100 "
                      "trainer.total_epochs=3 trainer.total_training_steps=$STEPS "
                      "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1\n")
    by_epochs = import_verl(script, env={"STEPS": "1000"})
    assert by_epochs.tree["trainer"]["steps"] == 3 * 31 == 93
    assert by_epochs.tree["optim"]["warmup_steps"] == int(0.1 * 93)       # verl's ratio of the run's steps
    assert "fewer than 1000" in _reasons(by_epochs.unmapped)["trainer.total_training_steps"]
    by_steps = import_verl(script, env={"STEPS": "50"})
    assert by_steps.tree["trainer"]["steps"] == 50 and by_steps.tree["optim"]["warmup_steps"] == 5
    assert "more than trainer.total_training_steps 50" in _reasons(by_steps.unmapped)["trainer.total_epochs"]


# ---- recomputation, layout and trackers ------------------------------------------------------------

def test_megatron_recompute_and_sequence_parallel_keys(tmp_path):
    overrides = tmp_path / "o.txt"
    m = "actor_rollout_ref.actor.megatron."
    overrides.write_text(f"{m}tensor_model_parallel_size=4 {m}sequence_parallel=False\n"
                         f"+{m}override_transformer_config.recompute_granularity=full\n"
                         f"+{m}override_transformer_config.recompute_method=block\n"
                         f"+{m}override_transformer_config.recompute_num_layers=4\n"
                         "actor_rollout_ref.model.enable_gradient_checkpointing=True\n")
    result = import_verl(overrides)
    assert result.tree["model"]["recompute"] == {"granularity": "full", "method": "block", "num_layers": 4}
    assert result.tree["parallel"] == {"tp": 4, "sequence_parallel": False}
    assert "superseded" in _reasons(result.unmapped)["actor_rollout_ref.model.enable_gradient_checkpointing"]
    overrides.write_text(f"+{m}override_transformer_config.recompute_granularity=selective\n"
                         f"+{m}override_transformer_config.recompute_modules=[core_attn,moe_act]\n")
    result = import_verl(overrides)
    assert result.tree["model"]["recompute"] == {"granularity": "selective", "modules": ["core_attn"]}
    assert "moe_act" in _reasons(result.unmapped)[f"{m}override_transformer_config.recompute_modules"]


def test_trackers_verl_has_and_we_do_not_are_dropped_with_the_reason(tmp_path):
    overrides = tmp_path / "o.txt"
    overrides.write_text("trainer.logger=[console,swanlab,file,mlflow]\ntrainer.val_only=True\n"
                         "trainer.test_freq=-1\ntrainer.log_val_generations=10\n")
    result = import_verl(overrides)
    assert result.tree["trainer"] == {"logger": ["console", "mlflow"], "test_freq": 0, "val_only": True,
                                      "log_val_generations": 10}
    dropped = [reason for key, reason in result.unmapped if key == "trainer.logger"]
    assert len(dropped) == 1 and "swanlab: a tracker this project does not have" in dropped[0]
    assert "metrics.jsonl is always written" in dropped[0]
    assert _reasons(result.differs)["trainer.log_val_generations"] == DIFFERENCES["val_generations"]


def test_rollout_engine_settings_only_for_vllm(tmp_path):
    overrides = tmp_path / "o.txt"
    r = "actor_rollout_ref.rollout."
    overrides.write_text(f"{r}name=sglang {r}tensor_model_parallel_size=2 {r}gpu_memory_utilization=0.5\n"
                         "data.max_prompt_length=100 data.max_response_length=200\n")
    result = import_verl(overrides)
    assert "engine" not in result.tree["rollout"] and "tensor_parallel_size" not in result.tree["rollout"]
    assert "embedded engine" in _reasons(result.unmapped)[f"{r}tensor_model_parallel_size"]
    overrides.write_text(f"{r}name=vllm {r}max_model_len=250 data.max_prompt_length=100 data.max_response_length=200\n")
    result = import_verl(overrides)
    assert "max_model_len" not in result.tree["rollout"]
    assert "cannot hold" in _reasons(result.unmapped)[f"{r}max_model_len"]
    overrides.write_text(f"{r}name=vllm {r}max_model_len=400 data.max_prompt_length=100 data.max_response_length=200\n")
    assert import_verl(overrides).tree["rollout"]["max_model_len"] == 400
