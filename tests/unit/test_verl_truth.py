"""`import-verl` tells the truth at verl HEAD: every key it leaves unmapped really has no counterpart.

TABLE is what each verl key the fixtures set is here: a recipe key (or keys) when this project has
the feature, None when it really has no counterpart. It grows with each feature: map a key in the
importer, then move it here from None to its recipe key. The fixtures are verl's own scripts
(tests/verl_scripts/verl_head_*.sh, copied from volcengine/verl at b178a3cd) and the scripts
written for test_import_verl.py.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from megatron_rlcorr.recipe.verl import import_verl

SCRIPTS = Path(__file__).resolve().parents[1] / "verl_scripts"
HOME = {"HOME": "/home/tester"}
ONE_STEP_OFF = "verl_head_dapo_7b_math_megatron_4_12.sh"
ROUTER_REPLAY = "verl_head_run_qwen30_a3b_megatron_vllm.sh"
MULTITURN = "verl_head_run_qwen3_4b_dapo_multiturn.sh"
QWEN3_235B = "verl_head_run_qwen3-235b_megatron_96gb.sh"
HEAD = (ONE_STEP_OFF, ROUTER_REPLAY, MULTITURN, QWEN3_235B)
FIXTURES = {**{name: HOME for name in HEAD}, "dapo_qwen2_5_32b_rollout_corr.sh": HOME,
            "dapo_qwen2_5_32b_fsdp.sh": HOME, "grpo_qwen2_5_7b_kl_fsdp.sh": HOME, "dapo_config.yaml": None}

A, R, REF, OB = ("actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref.",
                 "reward_model.reward_kwargs.overlong_buffer_cfg.")
TC = A + "megatron.override_transformer_config."
OOC = A + "optim.override_optimizer_config."

TABLE: dict[str, str | tuple[str, ...] | None] = {
    # mapped: the features of issue 30
    A + "megatron.expert_model_parallel_size": "parallel.ep",
    A + "megatron.expert_tensor_parallel_size": "parallel.etp",
    R + "enable_rollout_routing_replay": "rollout.routing_replay",
    OB + "enable": "algorithm.overlong_penalty.enabled",
    OB + "len": "algorithm.overlong_penalty.buffer",
    OB + "penalty_factor": "algorithm.overlong_penalty.penalty",
    "actor_rollout_ref.hybrid_engine": "rollout.placement",
    "rollout.nnodes": "rollout.num_ranks",
    "rollout.n_gpus_per_node": "rollout.num_ranks",
    "actor_rollout_ref.nccl_timeout": "trainer.timeout_minutes",
    # mapped, and reported as not mapped only for a value-dependent reason (WHEN_NOT_MAPPED)
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "actor_rollout_ref.model.path": "model.hf_checkpoint",
    A + "ppo_max_token_len_per_gpu": "trainer.max_tokens_per_micro_batch",
    R + "name": "rollout.engine",
    R + "tensor_model_parallel_size": "rollout.tensor_parallel_size",
    R + "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    R + "enforce_eager": "rollout.enforce_eager",
    A + "optim.lr_warmup_steps_ratio": "optim.warmup_steps",
    A + "optim.lr_warmup_steps": "optim.warmup_steps",
    A + "megatron.virtual_pipeline_model_parallel_size": "parallel.vpp",
    A + "router_replay.mode": "rollout.routing_replay",
    "reward_model.reward_manager": "data.reward",
    # really no counterpart here (the reason says which of ours covers it, or that nothing does)
    "data.truncation": None, A + "strategy": None, "critic.strategy": None,
    "actor_rollout_ref.model.override_config.max_position_embeddings": None,
    REF + "log_prob_micro_batch_size_per_gpu": None, R + "log_prob_micro_batch_size_per_gpu": None,
    R + "enable_chunked_prefill": None, R + "max_num_batched_tokens": None,
    R + "free_cache_engine": None, R + "mode": None, R + "multi_stage_wake_up": None,
    R + "calculate_log_probs": None, R + "response_length": None,
    **{R + "multi_turn." + k: None for k in ("enable", "max_user_turns", "max_assistant_turns", "tool_config_path",
                                             "format")},
    **{REF + "megatron." + k: None for k in ("pipeline_model_parallel_size", "tensor_model_parallel_size",
                                             "context_parallel_size", "expert_model_parallel_size",
                                             "expert_tensor_parallel_size")},
    OB + "log": None, "reward_model.reward_kwargs.max_resp_len": None,
    "trainer.total_epochs": None, "trainer.default_local_dir": None, "trainer.resume_mode": None,
    "trainer.nnodes": None, "trainer.n_gpus_per_node": None, "trainer.critic_warmup": None,
    "trainer.balance_batch": None,
    "actor_rollout_ref.model.use_fused_kernels": None, "actor_rollout_ref.model.use_remove_padding": None,
    A + "megatron.use_mbridge": None, A + "use_dynamic_bsz": None,
    REF + "log_prob_use_dynamic_bsz": None, R + "log_prob_use_dynamic_bsz": None,
    REF + "log_prob_max_token_len_per_gpu": None, R + "log_prob_max_token_len_per_gpu": None,
    **{OOC + k: None for k in ("optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                               "use_precision_aware_optimizer", "optimizer_cpu_offload")},
    **{TC + k: None for k in ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion",
                              "bias_dropout_fusion", "gradient_accumulation_fusion", "deallocate_pipeline_outputs",
                              "persist_layer_norm", "moe_grouped_gemm", "moe_permute_fusion",
                              "moe_token_dispatcher_type", "moe_router_dtype", "moe_enable_deepep",
                              "account_for_loss_in_pipeline_split", "account_for_embedding_in_pipeline_split")},
    "data.return_raw_chat": None, "data.custom_cls.path": None, "data.custom_cls.name": None,
    "custom_reward_function.path": None, "custom_reward_function.name": None, "data.gen_batch_size": None,
    A + "ulysses_sequence_parallel_size": None, REF + "ulysses_sequence_parallel_size": None,
    A + "fsdp_config.fsdp_size": None, "defaults": None, "hydra": None,
}

# A key the table maps may still be reported as not mapped for its value; the reason then says this.
WHEN_NOT_MAPPED = {
    A + "ppo_max_token_len_per_gpu": "use_dynamic_bsz is false",
    R + "name": "ours are embedded and vllm",
    R + "tensor_model_parallel_size": "the embedded engine",
    R + "gpu_memory_utilization": "the embedded engine",
    R + "enforce_eager": "the embedded engine",
    A + "optim.lr_warmup_steps_ratio": "needs the run's length",
    A + "optim.lr_warmup_steps": "verl then uses",
    A + "router_replay.mode": "R2: ",
    "reward_model.reward_manager": "the score function is",
}
ANY_VALUE = ("null: ", "empty in the source")

# What a reason must not say of a feature the table maps (a missing feature that is here).
DENIES = {
    "parallel.ep": r"\bMoE\b[^.;]*not supported|mixture-of-experts[^.;]*not supported|expert[- ]parallel[^.;]*"
                   r"(not supported|no counterpart)",
    "rollout.routing_replay": r"routing replay[^.;]*(not supported|no counterpart)",
    "algorithm.overlong_penalty.enabled": r"overlong[^.;]*(not supported|no counterpart)",
    "rollout.placement": r"(placement|hybrid|one-step-off|separate)[^.;]*(not supported|no counterpart)",
    "trainer.timeout_minutes": r"timeout[^.;]*(not supported|no counterpart)",
}


def _keys(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else value


@pytest.fixture(scope="module")
def results():
    return {name: import_verl(SCRIPTS / name, env=env) for name, env in FIXTURES.items()}


def test_head_fixtures_are_verls_scripts():
    for name in HEAD:
        text = (SCRIPTS / name).read_text()
        assert "python3 -m verl." in text, name


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_unmapped_key_really_has_no_counterpart(results, name):
    for key, reason in results[name].unmapped:
        if key.startswith(("(", "--")):        # notes on the command line and derived entries
            continue
        assert key in TABLE, f"{name}: {key} is not in TABLE: add it (None if it really has no counterpart)"
        if TABLE[key] is not None:
            expected = WHEN_NOT_MAPPED.get(key)
            assert reason.startswith(ANY_VALUE) or (expected is not None and expected in reason), (
                f"{name}: {key} maps to {TABLE[key]} but is reported as not mapped: {reason}")


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_no_reason_claims_a_feature_the_table_maps_is_missing(results, name):
    mapped = {k for value in TABLE.values() for k in _keys(value)}
    for key, reason in [*results[name].unmapped, *results[name].differs]:
        for feature, pattern in DENIES.items():
            assert feature not in mapped or not re.search(pattern, reason), (
                f"{name}: {key}: the reason denies {feature}, which is here: {reason}")


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_mapped_keys_go_where_the_table_says(results, name):
    for key, recipe_key, _ in results[name].mapped:
        if TABLE.get(key) is not None:
            assert recipe_key in _keys(TABLE[key]), f"{name}: {key} -> {recipe_key}, TABLE says {TABLE[key]}"


# ---- the features of issue 30, one by one ---------------------------------------------------------

def _mapped(result) -> dict[str, object]:
    return {key: value for key, _, value in result.mapped}


def test_moe_layout_is_imported(results):
    result = results[QWEN3_235B]
    assert result.tree["parallel"]["ep"] == 4 and result.tree["parallel"]["etp"] == 1
    assert not any("MoE" in reason for _, reason in result.unmapped)


def test_overlong_buffer_cfg_is_the_overlong_penalty(results):
    for name in (ONE_STEP_OFF, QWEN3_235B):
        penalty = results[name].tree["algorithm"]["overlong_penalty"]
        assert penalty == {"enabled": True, "buffer": 4096 if name == ONE_STEP_OFF else 1024, "penalty": 1.0}, name


def test_nccl_timeout_is_the_collective_timeout_in_minutes(results, tmp_path):
    assert results[QWEN3_235B].tree["trainer"]["timeout_minutes"] == 20           # 1200 s
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("actor_rollout_ref.nccl_timeout=601\n")
    assert import_verl(overrides).tree["trainer"]["timeout_minutes"] == 11          # rounded up


def test_one_step_off_is_the_separate_placement(results):
    result = results[ONE_STEP_OFF]
    rollout = result.tree["rollout"]
    assert (rollout["placement"], rollout["num_ranks"]) == ("separate", 4)          # rollout.nnodes 2 x 2 GPUs
    note = dict(result.unmapped)["trainer.nnodes"]
    assert "the launch gives the 2 x 8 GPUs, the trainer's 2 x 6 and the rollout's 2 x 2" in note


def test_hybrid_engine_true_is_colocated(tmp_path):
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("actor_rollout_ref.hybrid_engine=True\n")
    assert import_verl(overrides).tree["rollout"]["placement"] == "colocated"


def test_one_step_off_names_why_no_layout_fits_and_plans_once_divisible(tmp_path):
    """12 trainer ranks (2 x 6) cannot split the script's 512 prompts for any layout the search tries: the note
    says so (not memory); with 516 prompts (dp 3, 6 or 12 divide it) the recipe plans on its own 2 x 8 GPUs."""
    from megatron_rlcorr.plan import plan_report

    result = import_verl(SCRIPTS / ONE_STEP_OFF, env=HOME, overrides=["model.architecture=qwen2.5-7b"])
    note = dict(result.unmapped)["trainer.nnodes"]
    assert "no layout validates for 12 trainer ranks" in note and "data.prompts_per_step=512 must be divisible" in note
    assert "token budget" not in note
    result = import_verl(SCRIPTS / ONE_STEP_OFF, env=HOME, overrides=[
        "model.architecture=qwen2.5-7b", "data.prompts_per_step=516", "trainer.mini_batch_prompts=43"])
    assert any(verl.startswith("(plan --search for 2 x 8 GPUs") for verl, _, _ in result.mapped), result.unmapped
    out = tmp_path / "one_step_off.yaml"
    out.write_text(yaml.safe_dump(result.tree, sort_keys=False))
    report = plan_report(out, [], nodes=2, gpus_per_node=8)
    assert report["fits"] and report["trainer_ranks"] == 12 and report["rollout_ranks"]["count"] == 4


def test_rollout_routing_replay(tmp_path):
    overrides = tmp_path / "overrides.txt"
    overrides.write_text(f"{R}enable_rollout_routing_replay=True\n")
    assert import_verl(overrides).tree["rollout"]["routing_replay"] is True
    overrides.write_text(f"{A}router_replay.mode=R3\n")
    assert import_verl(overrides).tree["rollout"]["routing_replay"] is True


def test_enforce_eager_is_the_vllm_engines_eager_mode(results, tmp_path):
    assert results[QWEN3_235B].tree["rollout"]["enforce_eager"] is True        # rollout.name=vllm in the script
    assert R + "enforce_eager" not in dict(results[QWEN3_235B].unmapped)
    overrides = tmp_path / "overrides.txt"
    overrides.write_text(f"{R}name=sglang {R}enforce_eager=True\n")            # the embedded engine here: none
    result = import_verl(overrides)
    assert "enforce_eager" not in result.tree.get("rollout", {})
    assert "the embedded engine" in dict(result.unmapped)[R + "enforce_eager"]


def test_r2_router_replay_says_it_has_no_counterpart(results):
    reason = dict(results[ROUTER_REPLAY].unmapped)[A + "router_replay.mode"]
    assert reason.startswith("R2: ") and "no counterpart" in reason and "rollout.routing_replay is R3" in reason


def test_qwen3_30b_a3b_plans_on_1x8_with_ep_8(tmp_path):
    """The router-replay script names no checkpoint or data (empty variables): given them, its recipe
    fits its own 1 x 8 GPUs with the script's ep 8, and the layout line says what was written."""
    from megatron_rlcorr.plan import plan_report

    result = import_verl(SCRIPTS / ROUTER_REPLAY, env=HOME, overrides=[
        "model.architecture=qwen3-30b-a3b", "model.hf_checkpoint=/models/Qwen3-30B-A3B",
        "data.train_files=[/data/train.parquet]"])
    parallel = result.tree["parallel"]
    assert (parallel["tp"], parallel["ep"], parallel["etp"]) == (2, 8, 1)
    why = next(verl for verl, _, _ in result.mapped if verl.startswith("(plan --search"))
    written = f"tp {parallel['tp']}, pp {parallel.get('pp', 1)}, cp {parallel.get('cp', 1)}, ep 8, etp 1"
    assert written in why, why
    out = tmp_path / "qwen3_30b.yaml"
    out.write_text(yaml.safe_dump(result.tree, sort_keys=False))
    report = plan_report(out, [], nodes=1, gpus_per_node=8)
    assert report["fits"] and report["layout"]["ep"] == 8


# ---- empty values ---------------------------------------------------------------------------------

def test_empty_paths_are_unset_with_a_note(results):
    result = results[ROUTER_REPLAY]
    reasons = dict(result.unmapped)
    for key, recipe_key in (("actor_rollout_ref.model.path", "model.hf_checkpoint"),
                            ("data.train_files", "data.train_files"), ("data.val_files", "data.val_files")):
        assert reasons[key].startswith("empty in the source") and recipe_key in reasons[key]
    assert "hf_checkpoint" not in result.tree.get("model", {})
    assert "train_files" not in result.tree.get("data", {})
    assert "unsupported extension" not in reasons["trainer.nnodes"]


def test_the_layout_note_names_the_real_reason_the_recipe_does_not_load(results):
    # the architecture given, the recipe still does not load: the note says why, not "import again with it"
    result = import_verl(SCRIPTS / MULTITURN, env=HOME, overrides=["model.architecture=qwen3-8b"])
    note = dict(result.unmapped)["trainer.n_gpus_per_node"]
    assert "unsupported extension" in note and "import again with model.architecture" not in note
    assert "set what it names in the recipe written" in note


def test_qwen3_235b_note_says_it_is_memory_on_4x8():
    # verl's script is for 96 GB GPUs with CPU optimizer offload; on 80 GiB GPUs no layout fits here, and the
    # note says it is the memory (each layout validates), not a setting
    result = import_verl(SCRIPTS / QWEN3_235B, env=HOME, overrides=["model.architecture=qwen3-235b-a22b"])
    note = dict(result.unmapped)["trainer.n_gpus_per_node"]
    assert "every layout that validates needs at least" in note and "no layout validates" not in note


def test_hybrid_engine_false_without_the_rollout_gpus_says_what_to_set(tmp_path):
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("actor_rollout_ref.hybrid_engine=False\n")
    result = import_verl(overrides)
    assert "placement" not in result.tree.get("rollout", {})
    reason = dict(result.unmapped)["actor_rollout_ref.hybrid_engine"]
    assert reason.startswith("false, without both") and "rollout.placement: separate and rollout.num_ranks" in reason


def test_rollout_gpus_under_actor_rollout_ref_join_the_launch(tmp_path):
    overrides = tmp_path / "overrides.txt"
    overrides.write_text("actor_rollout_ref.hybrid_engine=False\ntrainer.nnodes=1\ntrainer.n_gpus_per_node=6\n"
                         f"{R}nnodes=1\n{R}n_gpus_per_node=2\n")
    result = import_verl(overrides)
    assert (result.tree["rollout"]["placement"], result.tree["rollout"]["num_ranks"]) == ("separate", 2)
    assert "the launch gives the 1 x 8 GPUs, the trainer's 1 x 6 and the rollout's 1 x 2" in \
        dict(result.unmapped)["trainer.nnodes"]
