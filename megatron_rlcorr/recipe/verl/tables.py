"""The tables of the verl import: what each verl key is here.

- `DIFFERENCES`: reasons for "meaning differs" lines, keyed by our concept (the docs reuse them).
- `DIRECT`: verl keys that map one-to-one onto a recipe key, with the converter of the value.
- `ORDER`: recipe keys in the order the written YAML lists them.
- `UNMAPPED`: (pattern, reason) for keys no rule consumed; the first match wins.
Keys whose mapping depends on other keys (the engine, the layout, steps, trackers, ...) are the
rules' (rules_*.py, cluster.py).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from .values import minutes, pos_int, str_list, to_bool, to_float, to_int, to_str

A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
RC = "algorithm.rollout_correction"
OB = "reward_model.reward_kwargs.overlong_buffer_cfg."
# data_source values verl's default_compute_score sends to math_dapo (as do those starting with "aime")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")   # verl's, less "full" (whole distributions)

DIFFERENCES: dict[str, str] = {
    "loss_agg_mode": "token-mean and seq-mean-* normalise by token/sequence counts over the whole mini-batch "
                     "across micro-batches and ranks (verl's default workers average per-micro-batch means), so "
                     "the gradient does not depend on micro-batching",
    "loss_scale_factor": "seq-mean-token-sum-norm divides by loss_scale_factor, which defaults to "
                         "rollout.max_new_tokens here (verl: the padded response width of the micro-batch)",
    "entropy_kl_aggregation": "entropy and KL-loss terms are aggregated with the same global normalisers as the "
                              "policy loss (counts over the whole mini-batch)",
    "straight_through_kl": "the '+' straight-through KL types (e.g. k3+) run here, while verl at b178a3cd raises "
                           "NotImplementedError for them",
    "bypass_mode": "in bypass mode the loss denominator counts the response tokens before rejection sampling",
    "decoupled_correction": "decoupled rollout correction is computed once per RL step over the whole step batch, "
                            "as verl does",
    "dynamic_sampling": "top-up generation rounds are sized by the keep rate instead of verl's fixed "
                        "data.gen_batch_size, and on_exhausted can be fill (inert filler groups) besides error "
                        "(what verl does)",
    "seq_final_reward": "seq_final_reward becomes metric reward, which filters on the reward before the "
                        "KL-in-reward penalty here (verl: after it)",
    "long_prompts": "verl filters long prompts out of the dataset before training; here they are dropped when "
                    "read and counted (data/round0_dropped_long_prompts)",
    "save_freq": "verl with save_freq <= 0 writes no checkpoint; here trainer.save_every: 0 still saves at the "
                 "end of the run",
    "trackers": "runs/<name>/metrics.jsonl is written whatever trainer.logger lists (verl writes no file without its "
                "file logger); wandb and mlflow are optional extras here (`pip install -e .[wandb]`, `.[mlflow]`)",
    "val_generations": "verl logs these samples to its trackers (a wandb table, ...); here they are written to "
                       "runs/<name>/val_generations/step_<k>.jsonl",
    "epochs": "trainer.steps is counted here from the train files as they are now (verl counts them when the run "
              "starts); the run then ends after trainer.steps steps",
    "vllm_engine": "rollout.engine: vllm needs the vllm extra (`pip install -e .[vllm]`, vLLM 0.25.1) and a CUDA GPU "
                   "on every rank; rollout.engine: embedded runs without them",
}


# verl key -> (recipe key, converter); a value of null keeps our default (a "not mapped" line).
DIRECT: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "actor_rollout_ref.model.path": ("model.hf_checkpoint", to_str),
    A + "megatron.param_offload": ("model.offload_params", to_bool),
    A + "megatron.grad_offload": ("model.offload_grads", to_bool),
    A + "megatron.optimizer_offload": ("optim.offload_optimizer", to_bool),
    R + "temperature": ("rollout.temperature", to_float),
    R + "top_p": ("rollout.top_p", to_float),
    R + "top_k": ("rollout.top_k", to_int),               # verl's -1 (vLLM) and 0 (HF) are both "off" here
    R + "val_kwargs.n": ("rollout.val_kwargs.n", pos_int),
    R + "val_kwargs.temperature": ("rollout.val_kwargs.temperature", to_float),
    R + "val_kwargs.top_p": ("rollout.val_kwargs.top_p", to_float),
    R + "val_kwargs.top_k": ("rollout.val_kwargs.top_k", to_int),
    R + "val_kwargs.do_sample": ("rollout.val_kwargs.do_sample", to_bool),
    "data.max_response_length": ("rollout.max_new_tokens", pos_int),
    R + "n": ("rollout.n", pos_int),
    "data.train_files": ("data.train_files", str_list),
    "data.val_files": ("data.val_files", str_list),
    "data.prompt_key": ("data.prompt_key", to_str),
    "data.max_prompt_length": ("data.max_prompt_length", pos_int),
    "data.train_batch_size": ("data.prompts_per_step", pos_int),
    "data.shuffle": ("data.shuffle", to_bool),
    "data.tokenizer": ("data.tokenizer", to_str),
    "algorithm.norm_adv_by_std_in_grpo": ("algorithm.norm_adv_by_std", to_bool),
    "algorithm.filter_groups.enable": ("algorithm.dynamic_sampling.enabled", to_bool),
    "reward_model.overlong_buffer.enable": ("algorithm.overlong_penalty.enabled", to_bool),
    "reward_model.overlong_buffer.len": ("algorithm.overlong_penalty.buffer", pos_int),
    "reward_model.overlong_buffer.penalty_factor": ("algorithm.overlong_penalty.penalty", to_float),
    OB + "enable": ("algorithm.overlong_penalty.enabled", to_bool),      # verl HEAD's key for the same
    OB + "len": ("algorithm.overlong_penalty.buffer", pos_int),
    OB + "penalty_factor": ("algorithm.overlong_penalty.penalty", to_float),
    R + "enable_rollout_routing_replay": ("rollout.routing_replay", to_bool),
    "actor_rollout_ref.nccl_timeout": ("trainer.timeout_minutes", minutes),
    A + "use_kl_loss": ("algorithm.kl_loss.enabled", to_bool),
    A + "kl_loss_coef": ("algorithm.kl_loss.coef", to_float),
    A + "kl_loss_type": ("algorithm.kl_loss.type", to_str),
    "algorithm.use_kl_in_reward": ("algorithm.kl_in_reward.enabled", to_bool),
    "algorithm.kl_ctrl.kl_coef": ("algorithm.kl_in_reward.coef", to_float),
    "algorithm.kl_penalty": ("algorithm.kl_in_reward.type", to_str),
    "algorithm.kl_ctrl.target_kl": ("algorithm.kl_in_reward.target_kl", to_float),
    "algorithm.kl_ctrl.horizon": ("algorithm.kl_in_reward.horizon", pos_int),
    A + "clip_ratio": ("algorithm.loss.clip_ratio", to_float),
    A + "clip_ratio_low": ("algorithm.loss.clip_ratio_low", to_float),
    A + "clip_ratio_high": ("algorithm.loss.clip_ratio_high", to_float),
    A + "clip_ratio_c": ("algorithm.loss.clip_ratio_c", to_float),
    A + "loss_scale_factor": ("algorithm.loss.loss_scale_factor", to_float),
    A + "entropy_coeff": ("algorithm.loss.entropy_coeff", to_float),
    A + "optim.lr": ("optim.lr", to_float),
    A + "optim.weight_decay": ("optim.weight_decay", to_float),
    A + "ppo_mini_batch_size": ("trainer.mini_batch_prompts", pos_int),
    A + "ppo_micro_batch_size_per_gpu": ("trainer.micro_batch_size", pos_int),
    A + "ppo_epochs": ("trainer.ppo_epochs", pos_int),
    "data.seed": ("trainer.seed", to_int),
    "trainer.project_name": ("trainer.project_name", to_str),
    "trainer.val_before_train": ("trainer.val_before_train", to_bool),
    "trainer.val_only": ("trainer.val_only", to_bool),
}

# Recipe keys in the order the YAML lists them; the rollout correction block keeps the script's order.
ORDER = (
    "name", "model.architecture", "model.hf_checkpoint", "model.bf16", "model.recompute", "model.offload_params",
    "model.offload_grads", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.vpp", "parallel.sequence_parallel",
    "parallel.ep", "parallel.etp", "rollout.engine", "rollout.precision", "rollout.temperature", "rollout.top_p",
    "rollout.top_k", "rollout.max_new_tokens", "rollout.n", "rollout.tensor_parallel_size",
    "rollout.gpu_memory_utilization", "rollout.max_model_len", "rollout.enforce_eager", "rollout.routing_replay",
    "rollout.placement", "rollout.num_ranks", "rollout.val_kwargs.n", "rollout.val_kwargs.temperature",
    "rollout.val_kwargs.top_p", "rollout.val_kwargs.top_k", "rollout.val_kwargs.do_sample", "data.train_files",
    "data.val_files",
    "data.prompt_key", "data.answer_key", "data.max_prompt_length", "data.prompts_per_step", "data.shuffle",
    "data.tokenizer", "data.reward", "data.on_long_prompt", "algorithm.advantage_estimator",
    "algorithm.norm_adv_by_std", "algorithm.dynamic_sampling.enabled", "algorithm.dynamic_sampling.metric",
    "algorithm.dynamic_sampling.max_num_gen_batches", "algorithm.dynamic_sampling.on_exhausted",
    "algorithm.overlong_penalty.enabled", "algorithm.overlong_penalty.buffer", "algorithm.overlong_penalty.penalty",
    "algorithm.kl_loss.enabled", "algorithm.kl_loss.coef", "algorithm.kl_loss.type", "algorithm.kl_in_reward.enabled",
    "algorithm.kl_in_reward.coef", "algorithm.kl_in_reward.type", "algorithm.kl_in_reward.controller",
    "algorithm.kl_in_reward.target_kl", "algorithm.kl_in_reward.horizon", "algorithm.reference.offload",
    "algorithm.loss.loss_type", "algorithm.loss.clip_ratio", "algorithm.loss.clip_ratio_low",
    "algorithm.loss.clip_ratio_high", "algorithm.loss.clip_ratio_c", "algorithm.loss.loss_agg_mode",
    "algorithm.loss.loss_scale_factor", "algorithm.loss.entropy_coeff", RC, "optim.lr", "optim.min_lr",
    "optim.warmup_steps", "optim.decay_style", "optim.weight_decay", "optim.clip_grad", "optim.offload_optimizer",
    "trainer.steps", "trainer.mini_batch_prompts", "trainer.micro_batch_size", "trainer.max_tokens_per_micro_batch",
    "trainer.ppo_epochs", "trainer.seed", "trainer.timeout_minutes", "trainer.save_every", "trainer.logger",
    "trainer.project_name", "trainer.experiment_name", "trainer.test_freq", "trainer.val_before_train",
    "trainer.val_only", "trainer.log_val_generations",
)

_FSDP = "FSDP settings: this trainer is Megatron-Core only (its layout is parallel: tp/pp/cp/vpp/ep/etp)"
_LOG_PROB_BUDGET = ("the log-prob passes (pi_old, reference) pack with the actor's budget, "
                    "trainer.max_tokens_per_micro_batch")
_ENGINE_TUNING = ("a vLLM setting this project does not expose: rollout/vllm_engine.py (engine_arguments) sets "
                  "vLLM's other arguments itself; the recipe's are rollout.tensor_parallel_size, "
                  "gpu_memory_utilization, max_model_len, sleep_level and enforce_eager")
UNMAPPED: tuple[tuple[str, str], ...] = (
    (r"ulysses_sequence_parallel_size$", "Ulysses sequence parallelism (FSDP): use parallel.cp (context "
                                         "parallelism) for long sequences here"),
    (r"\.fsdp_config\.|\.strategy$", _FSDP),
    (r"log_prob_use_dynamic_bsz$|log_prob_max_token_len(_per_gpu)?$", _LOG_PROB_BUDGET),
    (r"log_prob_micro_batch_size(_per_gpu)?$", "the log-prob passes use trainer.micro_batch_size"),
    (rf"^{re.escape(A)}ppo_micro_batch_size$", "verl's deprecated global micro-batch size: set "
                                              "trainer.micro_batch_size (sequences per rank)"),
    (r"^trainer\.validation_data_dir$", "the directory is fixed here: trainer.log_val_generations samples per "
                                        "validation go to runs/<name>/val_generations/step_<k>.jsonl"),
    (r"^data\.val_batch_size$", "validation generates every usable row of data.val_files in one pass, each rank "
                                "its share: there is no validation batch size"),
    (r"^data\.val_", "a validation-data option of verl with no counterpart here (data.val_files are read with the "
                     "training keys)"),
    (r"\.val_kwargs\.", "a validation sampling option of verl with no counterpart here (rollout.val_kwargs: n, "
                        "temperature, top_p, top_k, do_sample)"),
    (r"^trainer\.rollout_data_dir$", "the directory is fixed here: trainer.dump_every: 1 writes every step's "
                                     "rollouts to runs/<name>/dumps/"),
    (r"^trainer\.(profile|.*profil)|profiler", "a profiling option of verl with no counterpart here"),
    (r"^trainer\.device$|^ray_init\.|^ray_kwargs\.",
     "hardware comes from the launch (tools/launch.sh, torchrun / megatron-rlcorr train --nproc)"),
    (rf"^{re.escape(R)}calculate_log_probs$", "both engines always report the log-prob of every sampled token (the "
                                             "rollout_log_prob the correction compares)"),
    (rf"^{re.escape(R)}(enable_chunked_prefill|max_num_batched_tokens|max_num_seqs|load_format|mode|"
     r"engine_kwargs\..*|disable_log_stats|layered_summon|update_weights_bucket_megabytes|"
     r"data_parallel_size|expert_parallel_size|pipeline_model_parallel_size|cudagraph_capture_sizes|"
     r"skip_tokenizer_init)$", _ENGINE_TUNING),
    (rf"^{re.escape(R)}free_cache_engine$", "what the vLLM engine keeps while the trainer runs is "
                                            "rollout.sleep_level's (2, the default: nothing; 1: its weights in host "
                                            "memory; 0: everything stays)"),
    (r"^data\.gen_batch_size$", "the top-up rounds of dynamic sampling are sized by the keep rate here, not by a "
                                "fixed generation batch"),
    (r"^trainer\.(default_local_dir|default_hdfs_dir|resume_mode|resume_from_path|max_actor_ckpt_to_keep|"
     r"max_critic_ckpt_to_keep|del_local_ckpt_after_load)$|\.checkpoint\.",
     "checkpoints go to runs/<name>/checkpoints and a relaunch resumes from the latest (trainer.resume)"),
    (r"ref\.megatron\.(grad_offload|optimizer_offload)$", "the reference has no gradients or optimizer state (its "
                                                           "weights: algorithm.reference.offload)"),
    (r"^actor_rollout_ref\.ref\.megatron\.(tensor|pipeline|context|virtual_pipeline|expert|expert_tensor)_(model_)?"
     r"parallel_size$", "the reference policy runs in the trainer's layout (parallel.*), whatever the actor's is"),
    (r"megatron\.", "a Megatron worker setting of verl with no counterpart here"),
    (r"^critic\.", "no critic: GRPO and RLOO advantages only"),
    (r"^algorithm\.(gamma|lam)$", "GAE parameters: GRPO and RLOO use no critic"),
    (r"^algorithm\.(rollout_is|rollout_is_threshold|rollout_is_threshold_lower|rollout_is_level|rollout_is_mode|"
     r"rollout_is_veto_threshold|rollout_is_batch_normalize)$",
     "verl's older rollout-IS keys: rewrite them as an algorithm.rollout_correction block (rollout_is: "
     "token|sequence, rollout_is_threshold, rollout_rs, ...)"),
    (r"^reward_model\.(enable|model\.|micro_batch_size|max_length|strategy|use_dynamic_bsz)",
     "model-based rewards are not supported: data.reward is a function"),
    (r"^reward_model\.(overlong_buffer|reward_kwargs\.overlong_buffer_cfg)\.log$", "the overlong penalty is always "
                                                                                    "logged"),
    (r"^actor_rollout_ref\.model\.", "a model-loading option of verl's workers (the architecture comes from "
                                     "model.hf_checkpoint's config.json)"),
    (rf"^{re.escape(R)}do_sample$", "training rollouts sample at rollout.temperature (0 = greedy, verl's "
                                   "do_sample false)"),
    (rf"^{re.escape(R)}ignore_eos$", "responses end at the model's EOS ids (no ignore_eos)"),
    (rf"^{re.escape(R)}(prompt_length|response_length)$", "verl derives it from data.max_prompt_length / "
                                                          "data.max_response_length"),
    (rf"^{re.escape(R)}(multi_turn|agent|trace)\.", "multi-turn and agent rollouts are not supported"),
    (r"^data\.(filter_overlong_prompts_workers|dataloader_num_workers|return_raw_chat|return_raw_input_ids|"
     r"return_full_prompt|custom_cls\..*|use_shm|image_key|video_key|trust_remote_code|sampler\..*|reward_fn_key|"
     r"return_multi_modal_inputs|apply_chat_template_kwargs\..*|datagen\..*|tool_config_path)$",
     "a dataset-loading option of verl (prompts go through the tokenizer's chat template; rewards are chosen by "
     "data.reward)"),
    (rf"^{re.escape(A)}optim\.(total_training_steps|num_cycles|lr_warmup_init|lr_decay_steps|betas|"
     r"weight_decay_incr_style|lr_wsd_decay_style|lr_wsd_decay_steps|use_checkpoint_opt_param_scheduler|"
     r"optimizer|min_lr_ratio)$", "this optimizer setting has no counterpart here (optim: lr, min_lr, warmup_steps, "
                                  "decay_style, weight_decay, clip_grad)"),
    (r"^trainer\.(balance_batch|critic_warmup|esi_redundant_time|ray_wait_register_center_timeout|"
     r"use_legacy_worker_impl)$", "a scheduling option of verl's trainer"),
)


def unmapped_reason(key: str) -> str:
    for pattern, reason in UNMAPPED:
        if re.search(pattern, key):
            return reason
    return "no counterpart here"


def build_tree(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe mapping of dotted recipe keys, sections and keys in ORDER."""
    unknown = set(flat) - set(ORDER)
    assert not unknown, f"recipe keys missing from ORDER: {unknown}"
    tree: dict[str, Any] = {}
    for key in ORDER:
        if key not in flat:
            continue
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = flat[key]
    return tree
