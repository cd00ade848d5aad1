"""Rules for the algorithm and the data: the reward, long prompts, the advantage estimator,
dynamic sampling, the KL terms, the reference policy, the loss and the rollout correction block."""
from __future__ import annotations

import warnings

from ...config import RolloutCorrectionConfig
from .datafiles import data_sources
from .core import Mapper
from .tables import A, DAPO_SOURCES, KL_TYPES, OB, RC
from .values import pos_int, to_bool, to_int, to_str


def _reward(m: Mapper) -> None:
    path, name = "custom_reward_function.path", "custom_reward_function.name"
    manager = "reward_model.reward_manager"
    custom, kind = m.get(path), m.get(manager)
    if custom:
        m.skip(path, f"a reward function in a file ({custom}, function {m.get(name) or 'compute_score'}) "
                     "cannot be named as is: put it in an importable module and set data.reward: "
                     "package.module:function")
        for key in (name, manager):
            if m.has(key):
                m.skip(key, f"the score function is {path}'s (see there)")
        return
    for key in (path, name):
        if m.has(key):
            m.skip(key, "no custom reward file (null path): verl scores each row by its data_source")
    if m.pending(manager) and m.convert(manager, to_str) == "dapo":
        m.map(manager, "data.reward", "dapo_math")
    elif kind is None and m.dapo_recipe():
        m.derive("data.reward", "dapo_math", f"(-m {m.src.module()}: reward_manager dapo)")
    elif kind in (None, "naive"):
        _reward_by_data_source(m, manager)
    elif manager not in m.done:
        m.skip(manager, f"verl's {kind!r} reward manager: set data.reward to the score it computes "
                        "(dapo_math, boxed_math, math_verify or package.module:function)")


def _reward_by_data_source(m: Mapper, manager: str) -> None:
    """verl's default (naive) manager scores a row by its data_source; math_dapo rows -> dapo_math."""
    files = m.get("data.train_files")
    found = data_sources(files)
    if found and all(source in DAPO_SOURCES or source.startswith("aime") for source in found):
        m.derive("data.reward", "dapo_math", f"(data_source {', '.join(sorted(found))} of data.train_files)")
        if m.has(manager):
            m.skip(manager, "verl's naive manager scores each row by its data_source: see data.reward")
        return
    what = (f"the train files' data_source is {', '.join(sorted(found))}" if found
            else "the train files could not be read here")
    m.skip(manager if m.has(manager) else "(reward)",
           f"verl scores each row by its data_source and {what}: set data.reward to match (dapo_math for "
           "math_dapo rows, boxed_math, math_verify or package.module:function)")


def _long_prompts(m: Mapper) -> None:
    filt, trunc = "data.filter_overlong_prompts", "data.truncation"
    truncation = m.get(trunc)
    if m.pending(filt):
        if m.convert(filt, to_bool):
            m.map(filt, "data.on_long_prompt", "drop")
            m.differ(filt, "long_prompts")
        elif truncation in (None, "error"):
            m.map(filt, "data.on_long_prompt", "error")
        else:
            m.skip(filt, "verl truncates long prompts (data.truncation); ours drops or stops")
    if m.pending(trunc):
        if m.get(filt) is True:
            m.skip(trunc, "unused: long prompts are filtered out (data.filter_overlong_prompts)")
        elif truncation == "error":
            m.map(trunc, "data.on_long_prompt", "error")
        else:
            m.skip(trunc, f"truncation {truncation!r}: a prompt is never truncated here: it is dropped "
                          "(data.on_long_prompt: drop) or stops the run (error)")


def _estimator(m: Mapper) -> None:
    key = "algorithm.adv_estimator"
    if m.pending(key):
        value = m.convert(key, to_str)
        if value in ("grpo", "rloo"):
            m.map(key, "algorithm.advantage_estimator", value)
        else:
            m.skip(key, f"advantage estimator {value!r}: only grpo and rloo here (no critic); the recipe "
                        "keeps grpo")


def _dynamic_sampling(m: Mapper) -> None:
    enable, metric, rounds = ("algorithm.filter_groups.enable", "algorithm.filter_groups.metric",
                              "algorithm.filter_groups.max_num_gen_batches")
    if m.pending(enable):
        on = m.convert(enable, to_bool)
        m.map(enable, "algorithm.dynamic_sampling.enabled", on)
        if on:
            m.derive("algorithm.dynamic_sampling.on_exhausted", "error", enable)
            m.differ(enable, "dynamic_sampling")
    if m.pending(metric):
        value = m.convert(metric, to_str)
        ours = {"acc": "acc", "score": "score", "seq_reward": "reward", "seq_final_reward": "reward"}.get(value)
        if ours is None:
            m.skip(metric, f"filter metric {value!r}: ours are acc, score, reward (verl's seq_reward)")
        else:
            m.map(metric, "algorithm.dynamic_sampling.metric", ours)
            if value == "seq_final_reward":
                m.differ(metric, "seq_final_reward")
    if m.pending(rounds):
        # verl: <= 0 is no limit; ours spells that 0
        m.map(rounds, "algorithm.dynamic_sampling.max_num_gen_batches", max(m.convert(rounds, to_int), 0))


def _kl(m: Mapper) -> None:
    for key in (A + "kl_loss_type", "algorithm.kl_penalty"):
        value = str(m.get(key))
        if m.pending(key) and value.removesuffix("+") not in KL_TYPES:
            m.skip(key, f"KL type {value!r}: ours are {', '.join(KL_TYPES)} and their '+' forms")
        elif m.has(key) and value.endswith("+"):
            m.differ(key, "straight_through_kl")
    if m.get(A + "use_kl_loss") is True:
        m.differ(A + "use_kl_loss", "entropy_kl_aggregation")
    key = "algorithm.kl_ctrl.type"
    if m.pending(key):
        value = m.convert(key, to_str)
        if value in ("fixed", "adaptive"):
            m.map(key, "algorithm.kl_in_reward.controller", value)
        else:
            m.skip(key, f"KL controller {value!r}: ours are fixed and adaptive")


def _reference(m: Mapper) -> None:
    megatron = "actor_rollout_ref.ref.megatron.param_offload"
    fsdp = "actor_rollout_ref.ref.fsdp_config.param_offload"
    if m.pending(megatron):
        m.map(megatron, "algorithm.reference.offload", m.convert(megatron, to_bool))
        if m.has(fsdp):
            m.skip(fsdp, "superseded by actor_rollout_ref.ref.megatron.param_offload")
    elif m.pending(fsdp):
        m.map(fsdp, "algorithm.reference.offload", m.convert(fsdp, to_bool))


def _loss(m: Mapper) -> None:
    mode, agg = A + "policy_loss.loss_mode", A + "loss_agg_mode"
    if m.pending(mode):
        value = m.convert(mode, to_str)
        if value == "vanilla":
            m.map(mode, "algorithm.loss.loss_type", "ppo_clip")
        else:
            m.skip(mode, f"policy loss {value!r}: only vanilla PPO-clip here (and the rollout correction's "
                         "policy gradient, use_policy_gradient)")
    if m.pending(agg):
        value = m.convert(agg, to_str)
        if value in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            m.map(agg, "algorithm.loss.loss_agg_mode", value)
            m.differ(agg, "loss_agg_mode")
            if value == "seq-mean-token-sum-norm" and m.get(A + "loss_scale_factor") is None:
                m.differ(agg, "loss_scale_factor")
        else:
            m.skip(agg, f"loss aggregation {value!r}: ours are token-mean, seq-mean-token-sum, "
                        "seq-mean-token-mean, seq-mean-token-sum-norm")
    coeff = A + "entropy_coeff"
    if m.has(coeff) and m.get(coeff) not in (None, 0, 0.0):
        m.differ(coeff, "entropy_kl_aggregation")


def _correction(m: Mapper) -> None:
    keys = [k for k in m.values if k.startswith(RC + ".") or k == RC]
    if not keys:
        return
    if keys == [RC]:   # a whole block set to null / {}
        m.skip(RC, "no rollout correction block (null): this project's default (metrics only) applies")
        return
    block = {k[len(RC) + 1:]: m.values[k] for k in keys if k != RC}
    nested = [k for k in block if "." in k]
    if nested:
        raise ValueError(f"{m.src.path}: {RC}.{nested[0]}: the rollout correction block takes flat keys "
                         f"(rollout_is, rollout_rs_threshold, ...){m.src.where(RC + '.' + nested[0])}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            cfg = RolloutCorrectionConfig.from_dict(block)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{m.src.path}: {RC}: {err}{m.src.where(keys[-1])}") from None
    for key in keys:
        if key != RC:
            m.done.add(key)
            m.mapped.append((key, key, m.values[key]))
    m.done.add(RC)
    m.flat[RC] = block
    if cfg.bypass_mode:
        legacy = [k for k in ("bypass_mode", "bypass_old_logprob_for_rollout", "use_pure_rollout_correction",
                              "loss_type") if k in block]
        m.differ(f"{RC}.{(legacy or list(block))[0]}", "bypass_mode")
    elif any(block.get(k) is not None for k in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold")):
        first = next(k for k in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold")
                     if block.get(k) is not None)
        m.differ(f"{RC}.{first}", "decoupled_correction")


def _overlong_limit(m: Mapper) -> None:
    """reward_kwargs.max_resp_len: where verl's DAPO reward manager puts the overlong limit; here it is
    always rollout.max_new_tokens (data.max_response_length)."""
    key = "reward_model.reward_kwargs.max_resp_len"
    if not m.pending(key):
        return
    limit, response = m.convert(key, pos_int), m.get("data.max_response_length")
    if limit == response:
        m.skip(key, f"{limit}: the overlong penalty ends at rollout.max_new_tokens here, which is "
                    "data.max_response_length, the same")
    else:
        m.skip(key, f"{limit}: the overlong penalty ends at rollout.max_new_tokens here "
                    f"(data.max_response_length {response}), not at a length of its own")


RULES = (_reward, _overlong_limit, _long_prompts, _estimator, _dynamic_sampling, _kl, _reference, _loss, _correction)
