"""Import a verl run into a recipe: `megatron-rlcorr import-verl SCRIPT_OR_YAML --out RECIPE.yaml`.

Input: a verl run script (bash ending in `python3 -m verl.trainer.main_ppo a.b=c ...` or
`python3 -m recipe.dapo.main_dapo ...`, possibly behind `ray job submit ... --` or `torchrun`), a
verl YAML config (a nested mapping such as ppo_trainer.yaml's layout, or Hydra's list of override
strings), or a text file of `key=value` override lines. Output: `ImportResult` with the recipe tree
and three lists for the report: every verl key mapped (to which recipe key, with what value), every
key whose meaning differs here (the reasons are `DIFFERENCES`, one table the docs can reuse), and
every key not mapped (with why). Recipe keys not written keep this project's defaults.

A run script is resolved by running it in a sandbox where nothing external executes
(verl_script.py).

The recorded command lines are searched for the launch: `-m verl.trainer.main_ppo`,
`-m recipe.<...>.main_<...>` (or those as .py paths), else any `-m` module followed by at least
three dotted `key=value` arguments. Its Hydra overrides (`a.b=v`, `+a.b=v`, `++a.b=v`, `~a.b`) are
the verl keys. Values are YAML scalars as Hydra reads them (`HydraLoader`): `True`/`False`,
`1e-6` as a float, `null`, flow lists like `[a.parquet,b.parquet]`, quoted strings; `yes`/`no`
stay strings. `${a.b}` and `${oc.select:a.b,default}` interpolations resolve against the other
keys; `_target_` keys (Hydra instantiation) are dropped.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from ..config import RolloutCorrectionConfig
from .verl_script import ScriptRun, caller_home, find_launches, run_script

# Reasons for "meaning differs" lines, keyed by our concept; `_differ` attaches one to a verl key.
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
    "vllm_engine": "rollout.engine: vllm needs the vllm extra (`pip install -e .[vllm]`, vLLM 0.25.1) and a CUDA GPU "
                   "on every rank; rollout.engine: embedded runs without them",
}

# data_source values verl's default_compute_score sends to math_dapo (as do those starting with "aime")
_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
_KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")   # verl's, less "full" (whole distributions)
_A = "actor_rollout_ref.actor."
_R = "actor_rollout_ref.rollout."
_RC = "algorithm.rollout_correction"
_OVERRIDE = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][\w\-]*(?:\.[\w\-]+)*)(=(.*))?$", re.DOTALL)
_INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?([\w.\-]+)(?:,(.*))?\}$", re.DOTALL)


# ---- Hydra values -------------------------------------------------------------------------------

class HydraLoader(yaml.SafeLoader):
    """YAML as Hydra/OmegaConf read override values: bools are only true/false (any of YAML's
    cases), `1e-6` is a float (YAML 1.1 wants a dot), `yes`/`no`/`on`/`off` stay strings."""


HydraLoader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
HydraLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))
HydraLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_hydra_value(text: str) -> Any:
    """The value of a Hydra override `key=TEXT`: a YAML scalar, flow list or mapping; `key=` is ''."""
    if not text.strip():
        return ""
    return yaml.load(text, Loader=HydraLoader)


# ---- results ------------------------------------------------------------------------------------

@dataclass
class ImportResult:
    """What `import_verl` found. Lists are in the order the verl keys appear in the source."""

    source: Path
    kind: str                                     # "script", "yaml" or "overrides"
    tree: dict[str, Any]                          # the recipe mapping, sections in recipe order
    mapped: list[tuple[str, str, Any]] = field(default_factory=list)   # (verl key, recipe key, value)
    differs: list[tuple[str, str]] = field(default_factory=list)       # (verl key, reason)
    unmapped: list[tuple[str, str]] = field(default_factory=list)      # (verl key, reason)
    launch: list[str] | None = None               # the launch command line of a script
    launch_args: int = 0                          # where verl's own arguments start in `launch`
    home: str = ""                                # what $HOME meant in the resolved values


# ---- reading the source -------------------------------------------------------------------------

@dataclass
class _Source:
    path: Path
    kind: str
    values: dict[str, Any]                        # verl key -> value, in order
    notes: list[tuple[str, str]]                  # keys not mapped for reasons found while reading
    text: str = ""
    launch: list[str] | None = None
    launch_args: int = 0
    home: str = ""

    def where(self, key: str) -> str:
        """' (line N)' for the first line of the source that sets `key`, or ''."""
        pattern = re.compile(rf"(^|[\s'\"+~]){re.escape(key)}\s*=")
        for number, line in enumerate(self.text.splitlines(), 1):
            if pattern.search(line):
                return f" (line {number})"
        return ""


def import_verl(path: str | Path, env: Mapping[str, str] | None = None) -> ImportResult:
    """Read a verl run script, YAML config or override file and map it onto a recipe.

    env: the environment a script runs with (default: this process's); with a mapping, exactly
    those variables (the sandbox sets PATH and HOME itself; env's HOME, else this process's, is what
    $HOME means in the resolved values).
    """
    source = _read_source(Path(path), env)
    return _Mapper(source).run()


def _read_source(path: Path, env: Mapping[str, str] | None) -> _Source:
    if not path.is_file():
        raise ValueError(f"{path}: no such file (give a verl run script, a verl YAML config or a file of "
                         "key=value overrides)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot be read as text ({err})") from None
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        return _read_yaml(path, text)
    if _looks_like_overrides(text):
        values, notes = _parse_overrides(_override_tokens(text), path)
        return _Source(path, "overrides", values, notes, text=text)
    return _read_script(path, text, env)


def _read_yaml(path: Path, text: str) -> _Source:
    try:
        data = yaml.load(text, Loader=HydraLoader)
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {err}") from None
    if isinstance(data, list) and all(isinstance(item, str) for item in data):
        values, notes = _parse_overrides(data, path)        # Hydra's .hydra/overrides.yaml
        return _Source(path, "overrides", values, notes, text="\n".join(data))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a verl config must be a YAML mapping (or a list of key=value overrides), "
                         f"got {type(data).__name__}")
    values: dict[str, Any] = {}
    _flatten(data, "", values)
    notes = [(key, reason) for key, reason in (("defaults", "Hydra's defaults list: only this file is read"),
                                               ("hydra", "Hydra's own settings"))
             if any(k == key or k.startswith(key + ".") for k in values)]
    values = {k: v for k, v in values.items() if k.split(".")[0] not in ("defaults", "hydra")}
    return _Source(path, "yaml", values, notes)


def _flatten(node: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in node.items():
        if key == "_target_":
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            _flatten(value, dotted + ".", out)
        else:
            out[dotted] = value


def _looks_like_overrides(text: str) -> bool:
    try:
        tokens = _override_tokens(text)
    except ValueError:
        return False
    return bool(tokens) and all(_OVERRIDE.match(t) and ("=" in t or t.startswith("~")) and "." in t
                                for t in tokens)


def _override_tokens(text: str) -> list[str]:
    tokens: list[str] = []
    for line in text.splitlines():
        line = line.strip().removesuffix("\\")
        tokens += shlex.split(line, comments=True)
    return tokens


def _parse_overrides(args: Sequence[str], path: Path) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """verl keys and values from Hydra command-line arguments; the other arguments as notes."""
    values: dict[str, Any] = {}
    notes: list[tuple[str, str]] = []
    args = list(args)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        option = arg.split("=", 1)[0]
        if option in ("--config-path", "--config-name", "-cp", "-cn", "--config-dir", "-cd"):
            value = arg.split("=", 1)[1] if "=" in arg else (args[i] if i < len(args) else "")
            i += "=" not in arg
            notes.append((f"{option}={value}", "verl's base config is not read: only the overrides are imported, "
                                               "and every key they leave out takes this project's default"))
            continue
        match = _OVERRIDE.match(arg)
        if not match or (match.group(1) != "~" and match.group(3) is None):
            notes.append((arg, "not a Hydra override (key=value)"))
            continue
        prefix, key, text = match.group(1), match.group(2), match.group(4)
        if key.split(".")[0] == "hydra":
            notes.append((key, "Hydra's own settings"))
            continue
        if prefix == "~":
            for old in [k for k in values if k == key or k.startswith(key + ".")]:
                del values[old]
            notes.append((f"~{key}", "deletes a key of verl's base config: nothing to import"))
            continue
        try:
            value = parse_hydra_value(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: {key}={text}: not a value Hydra reads ({str(err).splitlines()[0]})") from None
        values.pop(key, None)   # a repeated key: the last one wins, in its own position
        if isinstance(value, Mapping) and value:
            _flatten(value, key + ".", values)
        else:
            values[key] = value
    return values, notes


def _read_script(path: Path, text: str, env: Mapping[str, str] | None) -> _Source:
    run = run_script(path, env)
    launches = find_launches(run.commands)
    if not launches:
        raise ValueError(_no_launch_message(path, run))
    launch, first = launches[0]
    values, notes = _parse_overrides(launch[first:], path)
    if len(launches) > 1:
        notes.append((f"({len(launches)} launches)", f"the script launches verl {len(launches)} times; only the "
                                                     "first launch is imported"))
    return _Source(path, "script", values, notes, text=text, launch=launch, launch_args=first,
                   home=caller_home(env))


def _no_launch_message(path: Path, run: ScriptRun) -> str:
    ran = [shlex.join(cmd[:4]) + (" ..." if len(cmd) > 4 else "") for cmd in run.commands[:5]]
    message = (f"{path}: no verl launch command found (python3 -m verl.trainer.main_ppo or -m "
               "recipe.<name>.main_<name> with key=value overrides); the script ran "
               + ("; ".join(ran) + (f" and {len(run.commands) - 5} more" if len(run.commands) > 5 else "")
                  if ran else "no external command"))
    problems = [line for line in run.stderr.splitlines() if line and not line.startswith("+")]
    refused = [line for line in problems if "restricted: cannot specify" in line]
    if refused:
        message += (f"; commands named by a path are never run nor recorded ({refused[0]}): call the launch by "
                    "name (python3 -m ...)")
    elif problems:
        message += f"; the script said: {problems[-1]}"
    if run.returncode not in (0,) and not refused:
        message += ("; if it reads variables from the environment (e.g. NUM_GPUS), set them when you import "
                    "(NUM_GPUS=8 megatron-rlcorr import-verl ...)")
    return message


# ---- values -------------------------------------------------------------------------------------

class _Bad(Exception):
    """A verl value that cannot be converted; the message says what was expected."""


def _int(value: Any) -> int:
    if isinstance(value, bool):
        raise _Bad("an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"[-+]?\d+", value.strip()):
        return int(value)
    raise _Bad("an integer")


def _pos_int(value: Any) -> int:
    number = _int(value)
    if number < 1:
        raise _Bad("an integer >= 1")
    return number


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise _Bad("a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise _Bad("a number") from None
    if not math.isfinite(number):
        raise _Bad("a finite number")
    return number


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise _Bad("True or False")


def _str(value: Any) -> str:
    if isinstance(value, (dict, list)) or value is None:
        raise _Bad("a string")
    return str(value)


def _str_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise _Bad("a file path or a list of file paths")


def _short(number: float) -> float:
    """A product of floats without binary noise in the YAML (0.1 * 1e-6 -> 1e-07)."""
    return float(f"{number:.12g}")


# ---- mapping ------------------------------------------------------------------------------------

# verl key -> (recipe key, converter); a value of null keeps our default (a "not mapped" line).
_DIRECT: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "trainer.experiment_name": ("name", _str),
    "actor_rollout_ref.model.path": ("model.hf_checkpoint", _str),
    _A + "megatron.tensor_model_parallel_size": ("parallel.tp", _pos_int),
    _A + "megatron.pipeline_model_parallel_size": ("parallel.pp", _pos_int),
    _A + "megatron.context_parallel_size": ("parallel.cp", _pos_int),
    _A + "megatron.virtual_pipeline_model_parallel_size": ("parallel.vpp", _pos_int),
    _A + "megatron.param_offload": ("model.offload_params", _bool),
    _A + "megatron.grad_offload": ("model.offload_grads", _bool),
    _A + "megatron.optimizer_offload": ("optim.offload_optimizer", _bool),
    _R + "temperature": ("rollout.temperature", _float),
    _R + "top_p": ("rollout.top_p", _float),
    "data.max_response_length": ("rollout.max_new_tokens", _pos_int),
    _R + "n": ("rollout.n", _pos_int),
    "data.train_files": ("data.train_files", _str_list),
    "data.prompt_key": ("data.prompt_key", _str),
    "data.max_prompt_length": ("data.max_prompt_length", _pos_int),
    "data.train_batch_size": ("data.prompts_per_step", _pos_int),
    "data.shuffle": ("data.shuffle", _bool),
    "data.tokenizer": ("data.tokenizer", _str),
    "algorithm.norm_adv_by_std_in_grpo": ("algorithm.norm_adv_by_std", _bool),
    "algorithm.filter_groups.enable": ("algorithm.dynamic_sampling.enabled", _bool),
    "reward_model.overlong_buffer.enable": ("algorithm.overlong_penalty.enabled", _bool),
    "reward_model.overlong_buffer.len": ("algorithm.overlong_penalty.buffer", _pos_int),
    "reward_model.overlong_buffer.penalty_factor": ("algorithm.overlong_penalty.penalty", _float),
    _A + "use_kl_loss": ("algorithm.kl_loss.enabled", _bool),
    _A + "kl_loss_coef": ("algorithm.kl_loss.coef", _float),
    _A + "kl_loss_type": ("algorithm.kl_loss.type", _str),
    "algorithm.use_kl_in_reward": ("algorithm.kl_in_reward.enabled", _bool),
    "algorithm.kl_ctrl.kl_coef": ("algorithm.kl_in_reward.coef", _float),
    "algorithm.kl_penalty": ("algorithm.kl_in_reward.type", _str),
    "algorithm.kl_ctrl.target_kl": ("algorithm.kl_in_reward.target_kl", _float),
    "algorithm.kl_ctrl.horizon": ("algorithm.kl_in_reward.horizon", _pos_int),
    _A + "clip_ratio": ("algorithm.loss.clip_ratio", _float),
    _A + "clip_ratio_low": ("algorithm.loss.clip_ratio_low", _float),
    _A + "clip_ratio_high": ("algorithm.loss.clip_ratio_high", _float),
    _A + "clip_ratio_c": ("algorithm.loss.clip_ratio_c", _float),
    _A + "loss_scale_factor": ("algorithm.loss.loss_scale_factor", _float),
    _A + "entropy_coeff": ("algorithm.loss.entropy_coeff", _float),
    _A + "optim.lr": ("optim.lr", _float),
    _A + "optim.weight_decay": ("optim.weight_decay", _float),
    "trainer.total_training_steps": ("trainer.steps", _pos_int),
    _A + "ppo_mini_batch_size": ("trainer.mini_batch_prompts", _pos_int),
    _A + "ppo_micro_batch_size_per_gpu": ("trainer.micro_batch_size", _pos_int),
    _A + "ppo_epochs": ("trainer.ppo_epochs", _pos_int),
    "data.seed": ("trainer.seed", _int),
}

# Recipe keys in the order the YAML lists them; the rollout correction block keeps the script's order.
_ORDER = (
    "name", "model.hf_checkpoint", "model.bf16", "model.offload_params", "model.offload_grads", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.vpp",
    "rollout.engine", "rollout.precision", "rollout.temperature", "rollout.top_p", "rollout.max_new_tokens",
    "rollout.n", "data.train_files", "data.prompt_key", "data.answer_key", "data.max_prompt_length",
    "data.prompts_per_step", "data.shuffle", "data.tokenizer", "data.reward", "data.on_long_prompt",
    "algorithm.advantage_estimator", "algorithm.norm_adv_by_std", "algorithm.dynamic_sampling.enabled",
    "algorithm.dynamic_sampling.metric", "algorithm.dynamic_sampling.max_num_gen_batches",
    "algorithm.dynamic_sampling.on_exhausted", "algorithm.overlong_penalty.enabled",
    "algorithm.overlong_penalty.buffer", "algorithm.overlong_penalty.penalty", "algorithm.kl_loss.enabled",
    "algorithm.kl_loss.coef", "algorithm.kl_loss.type", "algorithm.kl_in_reward.enabled",
    "algorithm.kl_in_reward.coef", "algorithm.kl_in_reward.type", "algorithm.kl_in_reward.controller",
    "algorithm.kl_in_reward.target_kl", "algorithm.kl_in_reward.horizon", "algorithm.reference.offload",
    "algorithm.loss.loss_type", "algorithm.loss.clip_ratio", "algorithm.loss.clip_ratio_low",
    "algorithm.loss.clip_ratio_high", "algorithm.loss.clip_ratio_c", "algorithm.loss.loss_agg_mode",
    "algorithm.loss.loss_scale_factor", "algorithm.loss.entropy_coeff", _RC, "optim.lr", "optim.min_lr",
    "optim.warmup_steps", "optim.decay_style", "optim.weight_decay", "optim.clip_grad", "optim.offload_optimizer",
    "trainer.steps",
    "trainer.mini_batch_prompts", "trainer.micro_batch_size", "trainer.max_tokens_per_micro_batch",
    "trainer.ppo_epochs", "trainer.seed", "trainer.save_every",
)

_FSDP = "FSDP settings: this trainer is Megatron-Core only (its layout is parallel: tp/pp/cp/vpp)"
_LOG_PROB_BUDGET = ("the log-prob passes (pi_old, reference) pack with the actor's budget, "
                    "trainer.max_tokens_per_micro_batch")
_ENGINE_TUNING = ("import-verl does not map this vLLM setting: set the matching rollout.* key by hand "
                  "(rollout.tensor_parallel_size, rollout.gpu_memory_utilization, ...: docs/configuration.md)")
# (pattern, reason) for keys no rule consumed; the first match wins.
_UNMAPPED: tuple[tuple[str, str], ...] = (
    (r"ulysses_sequence_parallel_size$", "Ulysses sequence parallelism (FSDP): use parallel.cp (context "
                                         "parallelism) for long sequences here"),
    (r"\.fsdp_config\.|\.strategy$|^actor_rollout_ref\.hybrid_engine$", _FSDP),
    (r"log_prob_use_dynamic_bsz$|log_prob_max_token_len(_per_gpu)?$", _LOG_PROB_BUDGET),
    (r"log_prob_micro_batch_size(_per_gpu)?$", "the log-prob passes use trainer.micro_batch_size"),
    (rf"^{re.escape(_A)}ppo_micro_batch_size$", "verl's deprecated global micro-batch size: set "
                                               "trainer.micro_batch_size (sequences per rank)"),
    (r"^trainer\.(test_freq|val_before_train|val_only|log_val_generations|validation_data_dir)$|^data\.val_|"
     r"\.val_kwargs\.|^reward_model\.val_", "validation is not run by this trainer"),
    (r"^trainer\.(logger|project_name|rollout_data_dir)$|^trainer\.(profile|.*profil)|profiler",
     "logging: metrics go to runs/<name>/metrics.jsonl (and TensorBoard)"),
    (r"^trainer\.(n_gpus_per_node|nnodes|device)$|^ray_init\.|^ray_kwargs\.",
     "hardware comes from the launch (torchrun / megatron-rlcorr train --nproc)"),
    (rf"^{re.escape(_R)}(gpu_memory_utilization|enable_chunked_prefill|max_num_batched_tokens|"
     r"tensor_model_parallel_size|max_model_len|max_num_seqs|enforce_eager|free_cache_engine|load_format|mode|"
     r"engine_kwargs\..*|disable_log_stats|calculate_log_probs|layered_summon|update_weights_bucket_megabytes|"
     r"data_parallel_size|expert_parallel_size|pipeline_model_parallel_size|cudagraph_capture_sizes|"
     r"skip_tokenizer_init)$", _ENGINE_TUNING),
    (r"^data\.gen_batch_size$", "the top-up rounds of dynamic sampling are sized by the keep rate here, not by a "
                                "fixed generation batch"),
    (r"^trainer\.(default_local_dir|default_hdfs_dir|resume_mode|resume_from_path|max_actor_ckpt_to_keep|"
     r"max_critic_ckpt_to_keep|del_local_ckpt_after_load)$|\.checkpoint\.",
     "checkpoints go to runs/<name>/checkpoints and a relaunch resumes from the latest (trainer.resume)"),
    (r"ref\.megatron\.(grad_offload|optimizer_offload)$", "the reference has no gradients or optimizer state (its "
                                                           "weights: algorithm.reference.offload)"),
    (r"megatron\.(expert_model_parallel_size|expert_tensor_parallel_size)$", "MoE models are not supported"),
    (r"megatron\.sequence_parallel$", "set parallel.sequence_parallel: true yourself when tp > 1 and Transformer "
                                     "Engine is installed (off by default here)"),
    (r"megatron\.", "a Megatron worker setting of verl with no counterpart here"),
    (r"^critic\.", "no critic: GRPO and RLOO advantages only"),
    (r"^algorithm\.(gamma|lam)$", "GAE parameters: GRPO and RLOO use no critic"),
    (r"^algorithm\.(rollout_is|rollout_is_threshold|rollout_is_threshold_lower|rollout_is_level|rollout_is_mode|"
     r"rollout_is_veto_threshold|rollout_is_batch_normalize)$",
     "verl's older rollout-IS keys: rewrite them as an algorithm.rollout_correction block (rollout_is: "
     "token|sequence, rollout_is_threshold, rollout_rs, ...)"),
    (r"^reward_model\.(enable|model\.|micro_batch_size|max_length|strategy|use_dynamic_bsz)",
     "model-based rewards are not supported: data.reward is a function"),
    (r"^reward_model\.overlong_buffer\.log$", "the overlong penalty is always logged"),
    (r"^actor_rollout_ref\.model\.", "a model-loading option of verl's workers (the architecture comes from "
                                     "model.hf_checkpoint's config.json)"),
    (rf"^{re.escape(_R)}(top_k|do_sample|ignore_eos)$", "sampling here is set by rollout.temperature and "
                                                       "rollout.top_p only"),
    (rf"^{re.escape(_R)}(prompt_length|response_length)$", "verl derives it from data.max_prompt_length / "
                                                           "data.max_response_length"),
    (rf"^{re.escape(_R)}(multi_turn|agent|trace)\.", "multi-turn and agent rollouts are not supported"),
    (r"^data\.(filter_overlong_prompts_workers|dataloader_num_workers|return_raw_chat|return_raw_input_ids|"
     r"return_full_prompt|custom_cls\..*|use_shm|image_key|video_key|trust_remote_code|sampler\..*|reward_fn_key|"
     r"return_multi_modal_inputs|apply_chat_template_kwargs\..*|datagen\..*|tool_config_path)$",
     "a dataset-loading option of verl (prompts go through the tokenizer's chat template; rewards are chosen by "
     "data.reward)"),
    (rf"^{re.escape(_A)}optim\.(total_training_steps|num_cycles|lr_warmup_init|lr_decay_steps|betas|"
     r"weight_decay_incr_style|lr_wsd_decay_style|lr_wsd_decay_steps|use_checkpoint_opt_param_scheduler|"
     r"optimizer|min_lr_ratio)$", "this optimizer setting has no counterpart here (optim: lr, min_lr, warmup_steps, "
                                  "decay_style, weight_decay, clip_grad)"),
    (r"^trainer\.(balance_batch|critic_warmup|esi_redundant_time|ray_wait_register_center_timeout|"
     r"use_legacy_worker_impl)$", "a scheduling option of verl's trainer"),
)


class _Mapper:
    def __init__(self, source: _Source) -> None:
        self.src = source
        self.values = _resolve_interpolations(source.values)
        self.order = {key: i for i, key in enumerate(self.values)}
        self.done: set[str] = set()
        self.flat: dict[str, Any] = {}
        self.mapped: list[tuple[str, str, Any]] = []
        self.differs: list[tuple[str, str]] = []
        self.unmapped: list[tuple[str, str]] = list(source.notes)

    # -- bookkeeping --
    def has(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def convert(self, key: str, convert: Callable[[Any], Any]) -> Any:
        try:
            return convert(self.values[key])
        except _Bad as bad:
            raise ValueError(f"{self.src.path}: {key}={_show(self.values[key])}{self.src.where(key)}: expected {bad}"
                             ) from None

    def map(self, key: str, recipe_key: str, value: Any) -> None:
        self.done.add(key)
        self.flat[recipe_key] = value
        self.mapped.append((key, recipe_key, value))

    def skip(self, key: str, reason: str) -> None:
        self.done.add(key)
        self.unmapped.append((key, reason))

    def differ(self, key: str, concept: str) -> None:
        self.differs.append((key, DIFFERENCES[concept]))

    # -- the run --
    def run(self) -> ImportResult:
        self._unresolved()
        for rule in (self._engine, self._precision, self._reward, self._long_prompts, self._estimator,
                     self._dynamic_sampling, self._kl, self._reference, self._loss, self._correction,
                     self._optim, self._trainer, self._micro_batching):
            rule()
        for key in self.values:
            if key in _DIRECT and self._pending(key):
                recipe_key, convert = _DIRECT[key]
                self.map(key, recipe_key, self.convert(key, convert))
            elif key not in self.done:
                self.skip(key, _unmapped_reason(key))
        position = self._position
        return ImportResult(
            source=self.src.path, kind=self.src.kind, tree=_build_tree(self.flat),
            mapped=sorted(self.mapped, key=lambda m: position(m[0])),
            differs=sorted(self.differs, key=lambda d: position(d[0])),
            unmapped=sorted(self.unmapped, key=lambda u: position(u[0])),
            launch=self.src.launch, launch_args=self.src.launch_args, home=self.src.home)

    def _position(self, key: str) -> int:
        """Report order: notes about the command line first, then the source's order, derived entries last."""
        if key in self.order:
            return self.order[key]
        return len(self.order) if key.startswith("(") else -1

    def _pending(self, key: str) -> bool:
        """The key is present, not yet handled, and not null (a null is reported here)."""
        if key not in self.values or key in self.done:
            return False
        if self.values[key] is None:
            self.skip(key, "null: verl's default applies there, this project's default here")
            return False
        return True

    def _unresolved(self) -> None:
        for key, value in self.values.items():
            if isinstance(value, str) and "${" in value:
                self.skip(key, f"the interpolation {value} refers to verl's base config, which is not read: set "
                               "the recipe key yourself")
            elif value == "???":
                self.skip(key, "a mandatory value left unset (???) in the config")

    # -- rules: each consumes the keys it maps --
    def _engine(self) -> None:
        key = _R + "name"
        if self._pending(key):
            name = self.convert(key, _str)
            if name == "vllm":
                self.map(key, "rollout.engine", "vllm")
                self.differ(key, "vllm_engine")
            else:
                self.skip(key, f"rollout engine {name!r}: ours are embedded and vllm (the recipe keeps embedded)")

    def _precision(self) -> None:
        quant, dtype = _R + "quantization", _R + "dtype"
        fp8 = str(self.get(quant)).lower() == "fp8"
        if self._pending(quant):
            if fp8:
                self.map(quant, "rollout.precision", "fp8")
            else:
                self.skip(quant, "only fp8 rollout quantization is emulated here")
        if self._pending(dtype):
            precision = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32",
                         "fp8": "fp8", "float8": "fp8"}.get(str(self.get(dtype)).lower())
            if fp8 and precision != "fp8":
                self.skip(dtype, "the rollout weights are quantized to fp8 (rollout.quantization)")
            elif precision is None:
                self.skip(dtype, f"rollout dtype {self.get(dtype)!r}: ours are fp32, bf16 and fp8")
            else:
                self.map(dtype, "rollout.precision", precision)
        self._model_dtype(_A + "megatron.dtype", dtype)

    def _model_dtype(self, actor: str, rollout: str) -> None:
        """model.bf16 from the Megatron actor's dtype, else the rollout's, else verl's default (bf16)."""
        table = {"bfloat16": True, "bf16": True, "float32": False, "fp32": False}
        if self._pending(actor):
            bf16 = table.get(str(self.get(actor)).lower())
            if bf16 is not None:
                self.map(actor, "model.bf16", bf16)
                return
            self.skip(actor, f"training dtype {self.get(actor)!r}: ours is bf16 (model.bf16: true) or fp32")
        bf16 = table.get(str(self.get(rollout)).lower())
        if bf16 is not None:
            self.map(rollout, "model.bf16", bf16)
        else:
            self._derive("model.bf16", True, "(verl's default dtype: bf16)")

    def _reward(self) -> None:
        path, name = "custom_reward_function.path", "custom_reward_function.name"
        manager = "reward_model.reward_manager"
        custom, kind = self.get(path), self.get(manager)
        if custom:
            self.skip(path, f"a reward function in a file ({custom}, function {self.get(name) or 'compute_score'}) "
                            "cannot be named as is: put it in an importable module and set data.reward: "
                            "package.module:function")
            for key in (name, manager):
                if self.has(key):
                    self.skip(key, f"the score function is {path}'s (see there)")
            return
        for key in (path, name):
            if self.has(key):
                self.skip(key, "no custom reward file (null path): verl scores each row by its data_source")
        if self._pending(manager) and self.convert(manager, _str) == "dapo":
            self.map(manager, "data.reward", "dapo_math")
        elif kind is None and self._dapo_recipe():
            self._derive("data.reward", "dapo_math", f"(-m {self._module()}: reward_manager dapo)")
        elif kind in (None, "naive"):
            self._reward_by_data_source(manager)
        elif manager not in self.done:
            self.skip(manager, f"verl's {kind!r} reward manager: set data.reward to the score it computes "
                               "(dapo_math, boxed_math, math_verify or package.module:function)")

    def _reward_by_data_source(self, manager: str) -> None:
        """verl's default (naive) manager scores a row by its data_source; math_dapo rows -> dapo_math."""
        files = self.get("data.train_files")
        found = _data_sources(files)
        if found and all(source in _DAPO_SOURCES or source.startswith("aime") for source in found):
            self._derive("data.reward", "dapo_math", f"(data_source {', '.join(sorted(found))} of data.train_files)")
            if self.has(manager):
                self.skip(manager, "verl's naive manager scores each row by its data_source: see data.reward")
            return
        what = (f"the train files' data_source is {', '.join(sorted(found))}" if found
                else "the train files could not be read here")
        self.skip(manager if self.has(manager) else "(reward)",
                  f"verl scores each row by its data_source and {what}: set data.reward to match (dapo_math for "
                  "math_dapo rows, boxed_math, math_verify or package.module:function)")

    def _derive(self, recipe_key: str, value: Any, why: str) -> None:
        """A recipe key that follows from the run rather than from one verl key."""
        self.flat[recipe_key] = value
        self.mapped.append((why, recipe_key, value))

    def _module(self) -> str:
        launch = self.src.launch or []
        for i, arg in enumerate(launch[:-1]):
            if arg in ("-m", "--module"):
                return launch[i + 1]
        return next((a for a in launch if a.endswith(".py")), "")

    def _dapo_recipe(self) -> bool:
        return self._module().startswith(("recipe.dapo.", "recipe/dapo/")) or "/recipe/dapo/" in self._module()

    def _long_prompts(self) -> None:
        filt, trunc = "data.filter_overlong_prompts", "data.truncation"
        truncation = self.get(trunc)
        if self._pending(filt):
            if self.convert(filt, _bool):
                self.map(filt, "data.on_long_prompt", "drop")
                self.differ(filt, "long_prompts")
            elif truncation in (None, "error"):
                self.map(filt, "data.on_long_prompt", "error")
            else:
                self.skip(filt, "verl truncates long prompts (data.truncation); ours drops or stops")
        if self._pending(trunc):
            if self.get(filt) is True:
                self.skip(trunc, "unused: long prompts are filtered out (data.filter_overlong_prompts)")
            elif truncation == "error":
                self.map(trunc, "data.on_long_prompt", "error")
            else:
                self.skip(trunc, f"truncation {truncation!r}: a prompt is never truncated here: it is dropped "
                                 "(data.on_long_prompt: drop) or stops the run (error)")

    def _estimator(self) -> None:
        key = "algorithm.adv_estimator"
        if self._pending(key):
            value = self.convert(key, _str)
            if value in ("grpo", "rloo"):
                self.map(key, "algorithm.advantage_estimator", value)
            else:
                self.skip(key, f"advantage estimator {value!r}: only grpo and rloo here (no critic); the recipe "
                               "keeps grpo")

    def _dynamic_sampling(self) -> None:
        enable, metric, rounds = ("algorithm.filter_groups.enable", "algorithm.filter_groups.metric",
                                  "algorithm.filter_groups.max_num_gen_batches")
        if self._pending(enable):
            on = self.convert(enable, _bool)
            self.map(enable, "algorithm.dynamic_sampling.enabled", on)
            if on:
                self._derive("algorithm.dynamic_sampling.on_exhausted", "error", enable)
                self.differ(enable, "dynamic_sampling")
        if self._pending(metric):
            value = self.convert(metric, _str)
            ours = {"acc": "acc", "score": "score", "seq_reward": "reward", "seq_final_reward": "reward"}.get(value)
            if ours is None:
                self.skip(metric, f"filter metric {value!r}: ours are acc, score, reward (verl's seq_reward)")
            else:
                self.map(metric, "algorithm.dynamic_sampling.metric", ours)
                if value == "seq_final_reward":
                    self.differ(metric, "seq_final_reward")
        if self._pending(rounds):
            # verl: <= 0 is no limit; ours spells that 0
            self.map(rounds, "algorithm.dynamic_sampling.max_num_gen_batches", max(self.convert(rounds, _int), 0))

    def _kl(self) -> None:
        for key in (_A + "kl_loss_type", "algorithm.kl_penalty"):
            value = str(self.get(key))
            if self._pending(key) and value.removesuffix("+") not in _KL_TYPES:
                self.skip(key, f"KL type {value!r}: ours are {', '.join(_KL_TYPES)} and their '+' forms")
            elif self.has(key) and value.endswith("+"):
                self.differ(key, "straight_through_kl")
        if self.get(_A + "use_kl_loss") is True:
            self.differ(_A + "use_kl_loss", "entropy_kl_aggregation")
        key = "algorithm.kl_ctrl.type"
        if self._pending(key):
            value = self.convert(key, _str)
            if value in ("fixed", "adaptive"):
                self.map(key, "algorithm.kl_in_reward.controller", value)
            else:
                self.skip(key, f"KL controller {value!r}: ours are fixed and adaptive")

    def _reference(self) -> None:
        megatron = "actor_rollout_ref.ref.megatron.param_offload"
        fsdp = "actor_rollout_ref.ref.fsdp_config.param_offload"
        if self._pending(megatron):
            self.map(megatron, "algorithm.reference.offload", self.convert(megatron, _bool))
            if self.has(fsdp):
                self.skip(fsdp, "superseded by actor_rollout_ref.ref.megatron.param_offload")
        elif self._pending(fsdp):
            self.map(fsdp, "algorithm.reference.offload", self.convert(fsdp, _bool))

    def _loss(self) -> None:
        mode, agg = _A + "policy_loss.loss_mode", _A + "loss_agg_mode"
        if self._pending(mode):
            value = self.convert(mode, _str)
            if value == "vanilla":
                self.map(mode, "algorithm.loss.loss_type", "ppo_clip")
            else:
                self.skip(mode, f"policy loss {value!r}: only vanilla PPO-clip here (and the rollout correction's "
                                "policy gradient, use_policy_gradient)")
        if self._pending(agg):
            value = self.convert(agg, _str)
            if value in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
                self.map(agg, "algorithm.loss.loss_agg_mode", value)
                self.differ(agg, "loss_agg_mode")
                if value == "seq-mean-token-sum-norm" and self.get(_A + "loss_scale_factor") is None:
                    self.differ(agg, "loss_scale_factor")
            else:
                self.skip(agg, f"loss aggregation {value!r}: ours are token-mean, seq-mean-token-sum, "
                               "seq-mean-token-mean, seq-mean-token-sum-norm")
        coeff = _A + "entropy_coeff"
        if self.has(coeff) and self.get(coeff) not in (None, 0, 0.0):
            self.differ(coeff, "entropy_kl_aggregation")

    def _correction(self) -> None:
        keys = [k for k in self.values if k.startswith(_RC + ".") or k == _RC]
        if not keys:
            return
        if keys == [_RC]:   # a whole block set to null / {}
            self.skip(_RC, "no rollout correction block (null): this project's default (metrics only) applies")
            return
        block = {k[len(_RC) + 1:]: self.values[k] for k in keys if k != _RC}
        nested = [k for k in block if "." in k]
        if nested:
            raise ValueError(f"{self.src.path}: {_RC}.{nested[0]}: the rollout correction block takes flat keys "
                             f"(rollout_is, rollout_rs_threshold, ...){self.src.where(_RC + '.' + nested[0])}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                cfg = RolloutCorrectionConfig.from_dict(block)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{self.src.path}: {_RC}: {err}{self.src.where(keys[-1])}") from None
        for key in keys:
            if key != _RC:
                self.done.add(key)
                self.mapped.append((key, key, self.values[key]))
        self.done.add(_RC)
        self.flat[_RC] = block
        if cfg.bypass_mode:
            legacy = [k for k in ("bypass_mode", "bypass_old_logprob_for_rollout", "use_pure_rollout_correction",
                                  "loss_type") if k in block]
            self.differ(f"{_RC}.{(legacy or list(block))[0]}", "bypass_mode")
        elif any(block.get(k) is not None for k in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold")):
            first = next(k for k in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold")
                         if block.get(k) is not None)
            self.differ(f"{_RC}.{first}", "decoupled_correction")

    def _optim(self) -> None:
        o = _A + "optim."
        lr = self.get(o + "lr")
        if self._pending(o + "min_lr"):
            self.map(o + "min_lr", "optim.min_lr", self.convert(o + "min_lr", _float))
            if self.has(o + "min_lr_ratio"):
                self.skip(o + "min_lr_ratio", f"superseded by {o}min_lr")
        elif self._pending(o + "min_lr_ratio"):
            ratio = self.convert(o + "min_lr_ratio", _float)
            if lr is None:
                self.skip(o + "min_lr_ratio", f"needs {o}lr to give optim.min_lr (= min_lr_ratio * lr)")
            else:
                self.map(o + "min_lr_ratio", "optim.min_lr", _short(ratio * self.convert(o + "lr", _float)))
        self._warmup(o)
        styles = [k for k in (o + "lr_decay_style", o + "lr_scheduler_type", o + "warmup_style") if self.has(k)]
        for i, key in enumerate(styles):
            if not self._pending(key):
                continue
            value = self.convert(key, _str)
            if i > 0:
                self.skip(key, f"superseded by {styles[0]}")
            elif value in ("constant", "linear", "cosine"):
                self.map(key, "optim.decay_style", value)
            else:
                self.skip(key, f"learning-rate schedule {value!r}: ours are constant, linear and cosine")
        for i, key in enumerate([k for k in (o + "clip_grad", _A + "grad_clip") if self.has(k)]):
            if self._pending(key):
                if i == 0:
                    self.map(key, "optim.clip_grad", self.convert(key, _float))
                else:
                    self.skip(key, f"superseded by {o}clip_grad")

    def _warmup(self, o: str) -> None:
        steps_key, ratio_key = o + "lr_warmup_steps", o + "lr_warmup_steps_ratio"
        steps = self.convert(steps_key, _int) if self._pending(steps_key) else None
        if steps is not None and steps >= 0:
            self.map(steps_key, "optim.warmup_steps", steps)
            if self.has(ratio_key):
                self.skip(ratio_key, f"unused: {steps_key} is set")
            return
        if steps is not None:
            self.skip(steps_key, f"{steps}: verl then uses {ratio_key}")
        if not self._pending(ratio_key):
            return
        ratio = self.convert(ratio_key, _float)
        total = self.get("trainer.total_training_steps")
        if ratio <= 0:
            self.map(ratio_key, "optim.warmup_steps", 0)
        elif total is None:
            self.skip(ratio_key, "needs trainer.total_training_steps to give optim.warmup_steps")
        else:
            # verl truncates: int(ratio * total training steps)
            self.map(ratio_key, "optim.warmup_steps", int(ratio * self.convert("trainer.total_training_steps", _int)))

    def _trainer(self) -> None:
        epochs, steps, save = "trainer.total_epochs", "trainer.total_training_steps", "trainer.save_freq"
        if self.has(epochs) and epochs not in self.done:
            if self.get(steps) is None:
                self.skip(epochs, "ours counts steps, not epochs: trainer.steps must be set (epochs * prompts in the "
                                  "dataset / data.train_batch_size)")
            else:
                self.skip(epochs, f"superseded by {steps} (verl stops at whichever comes first)")
        if self.has(steps) and self.get(steps) is None and steps not in self.done:
            self.skip(steps, "null: verl trains total_epochs; set trainer.steps here")
        if self._pending(save):
            value = self.convert(save, _int)
            self.map(save, "trainer.save_every", max(value, 0))
            if value <= 0:
                self.differ(save, "save_freq")


    def _micro_batching(self) -> None:
        """verl's dynamic batch size: packed micro-batches of a token budget per GPU, which is
        trainer.max_tokens_per_micro_batch (both count a rank's tokens after the CP split)."""
        dynamic, budget = _A + "use_dynamic_bsz", _A + "ppo_max_token_len_per_gpu"
        if not self._pending(dynamic):
            if self._pending(budget):
                self.skip(budget, f"unused: {dynamic} is not set (verl's default: false)")
            return
        if not self.convert(dynamic, _bool):
            self.skip(dynamic, "false: padded micro-batches of trainer.micro_batch_size sequences")
            if self._pending(budget):
                self.skip(budget, f"unused: {dynamic} is false")
            return
        if self._pending(budget):
            self.map(budget, "trainer.max_tokens_per_micro_batch", self.convert(budget, _pos_int))
            self.skip(dynamic, f"true: packed micro-batches (see {budget})")
        else:
            self.map(dynamic, "trainer.max_tokens_per_micro_batch", 16384)  # verl's default budget


def _resolve_interpolations(values: dict[str, Any]) -> dict[str, Any]:
    """`${a.b}` / `${oc.select:a.b,default}` whole-value references to other keys, resolved."""
    out = dict(values)
    for _ in range(8):  # chains of references
        changed = False
        for key, value in out.items():
            match = _INTERPOLATION.match(value) if isinstance(value, str) else None
            if match and (match.group(1) in out or match.group(2) is not None):
                target = out.get(match.group(1))
                if target is None and match.group(2) is not None:
                    target = parse_hydra_value(match.group(2))
                if target != value:
                    out[key], changed = target, True
        if not changed:
            break
    return out


def _data_sources(files: Any, max_rows: int = 100_000) -> set[str]:
    """The data_source values of the train files (parquet, or JSONL's first `max_rows` lines); empty
    when a file is missing, unreadable or has no data_source."""
    try:
        paths = [Path(f) for f in _str_list(files)]
    except _Bad:
        return set()
    found: set[str] = set()
    try:
        for path in paths:
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                column = pq.read_table(path, columns=["data_source"]).column("data_source")
                found |= {str(v) for v in column.unique().to_pylist()}
            elif path.suffix in (".jsonl", ".json"):
                with path.open() as lines:
                    found |= {str(json.loads(line).get("data_source")) for _, line in zip(range(max_rows), lines)
                              if line.strip()}
            else:
                return set()
    except (OSError, ValueError, KeyError, AttributeError, ImportError):
        return set()
    return found


def _unmapped_reason(key: str) -> str:
    for pattern, reason in _UNMAPPED:
        if re.search(pattern, key):
            return reason
    return "no counterpart here"


def _build_tree(flat: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(flat) - set(_ORDER)
    assert not unknown, f"recipe keys missing from _ORDER: {unknown}"
    tree: dict[str, Any] = {}
    for key in _ORDER:
        if key not in flat:
            continue
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = flat[key]
    return tree


# ---- output -------------------------------------------------------------------------------------

def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def recipe_yaml(result: ImportResult) -> str:
    """The recipe file: a header naming the source, then the mapped keys in recipe order."""
    header = [f"# Imported from {result.source.resolve()} by `megatron-rlcorr import-verl`.",
              "# Check every path (model.hf_checkpoint, data.train_files, data.tokenizer) before a run: they are",
              "# the source's own" + (f", with $HOME = {result.home} and the working directory {os.getcwd()}."
                                      if result.kind == "script" else "."),
              "# Keys not written here take this project's defaults; the import report lists what was mapped,",
              "# what means something different here and what was not mapped."]
    body = yaml.safe_dump(result.tree, sort_keys=False, default_flow_style=False, width=100)
    return "\n".join(header) + "\n" + body


def write_recipe(result: ImportResult, out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and out.resolve() == result.source.resolve():
        raise ValueError(f"--out {out} is the verl source itself; write the recipe to another file")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; give a file name such as {out / 'recipe.yaml'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(recipe_yaml(result))
    return out


def format_report(result: ImportResult) -> str:
    """Three lists: mapped (verl key -> recipe key = value), meaning differs, not mapped."""
    lines = [f"imported {result.source} ({result.kind})"]
    if result.launch:
        rest = len(result.launch) - result.launch_args
        lines.append(f"launch: {shlex.join(result.launch[:result.launch_args])} ... ({rest} arguments)")
    lines.append(f"mapped ({len(result.mapped)}):")
    lines += [f"  {verl} -> {ours} = {_show(value)}" for verl, ours, value in result.mapped]
    lines.append(f"meaning differs ({len(result.differs)}):")
    lines += [f"  {verl}: {reason}" for verl, reason in result.differs]
    lines.append(f"not mapped ({len(result.unmapped)}):")
    lines += [f"  {verl}: {reason}" for verl, reason in result.unmapped]
    return "\n".join(lines)
