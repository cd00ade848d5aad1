"""Rules for the model, its layout and the rollout engine: which engine, its precision and
settings, the training dtype, the Megatron layout keys, activation recomputation and offload.

verl's defaults that matter here, where the source leaves a key out: the rollout engine is vLLM
when the source sets vLLM's tensor-parallel size, memory share or context length without naming an
engine; a Megatron actor runs with sequence parallelism (verl's `megatron.sequence_parallel: true`);
the dtype is bf16.
"""
from __future__ import annotations

from typing import Any

from .core import Mapper
from .tables import A, R
from .values import Bad, pos_int, to_bool, to_float, to_str

_VLLM_SETTINGS = (R + "tensor_model_parallel_size", R + "gpu_memory_utilization", R + "max_model_len")
_EAGER = R + "enforce_eager"  # mapped with the three above, but on its own it does not make the engine vllm
_MEGATRON_LAYOUT = {"tensor_model_parallel_size": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp",
                    "context_parallel_size": "parallel.cp", "virtual_pipeline_model_parallel_size": "parallel.vpp",
                    "expert_model_parallel_size": "parallel.ep", "expert_tensor_parallel_size": "parallel.etp"}
_RECOMPUTE = A + "megatron.override_transformer_config.recompute_"
_RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
FULL_RECOMPUTE = {"granularity": "full", "method": "uniform", "num_layers": 1}


def _engine(m: Mapper) -> None:
    key = R + "name"
    if m.pending(key):
        name = m.convert(key, to_str)
        if name == "vllm":
            m.map(key, "rollout.engine", "vllm")
            m.differ(key, "vllm_engine")
        else:
            m.skip(key, f"rollout engine {name!r}: ours are embedded and vllm (the recipe keeps embedded)")
    elif not m.has(key) and any(m.has(k) for k in _VLLM_SETTINGS):
        why = f"(no {key}: vllm, the engine the source's {R}* settings are for)"
        m.derive("rollout.engine", "vllm", why)
        m.differ(why, "vllm_engine")


def _engine_settings(m: Mapper) -> None:
    """vLLM's tensor-parallel size, memory share, context length and eager mode (the embedded engine
    has none)."""
    tp, share, length = _VLLM_SETTINGS
    if m.flat.get("rollout.engine") != "vllm":
        for key in (*_VLLM_SETTINGS, _EAGER):
            if m.pending(key):
                m.skip(key, "a setting of verl's rollout engine; the embedded engine (rollout.engine here) runs the "
                            "whole model on each rank and has none")
        return
    if m.pending(tp):
        m.map(tp, "rollout.tensor_parallel_size", m.convert(tp, pos_int))
    if m.pending(share):
        m.map(share, "rollout.gpu_memory_utilization", m.convert(share, _share))
    if m.pending(_EAGER):
        m.map(_EAGER, "rollout.enforce_eager", m.convert(_EAGER, to_bool))
    if m.pending(length):
        value = m.convert(length, pos_int)
        prompt, response = m.get("data.max_prompt_length"), m.get("data.max_response_length")
        needed = prompt + response if isinstance(prompt, int) and isinstance(response, int) else None
        if needed is not None and value < needed:
            m.skip(length, f"{value} cannot hold data.max_prompt_length + data.max_response_length = {needed}: "
                           "rollout.max_model_len stays null here (derived from those two)")
        else:
            m.map(length, "rollout.max_model_len", value)


def _share(value: Any) -> float:
    share = to_float(value)
    if not 0 < share <= 1:
        raise Bad("a share of GPU memory in (0, 1]")
    return share


def _precision(m: Mapper) -> None:
    quant, dtype = R + "quantization", R + "dtype"
    fp8 = str(m.get(quant)).lower() == "fp8"
    if m.pending(quant):
        if fp8:
            m.map(quant, "rollout.precision", "fp8")
        else:
            m.skip(quant, "only fp8 rollout quantization is emulated here")
    if m.pending(dtype):
        precision = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32",
                     "fp8": "fp8", "float8": "fp8"}.get(str(m.get(dtype)).lower())
        if fp8 and precision != "fp8":
            m.skip(dtype, "the rollout weights are quantized to fp8 (rollout.quantization)")
        elif precision is None:
            m.skip(dtype, f"rollout dtype {m.get(dtype)!r}: ours are fp32, bf16 and fp8")
        else:
            m.map(dtype, "rollout.precision", precision)
    _model_dtype(m, A + "megatron.dtype", dtype)


def _model_dtype(m: Mapper, actor: str, rollout: str) -> None:
    """model.bf16 from the Megatron actor's dtype, else the rollout's, else verl's default (bf16)."""
    table = {"bfloat16": True, "bf16": True, "float32": False, "fp32": False}
    if m.pending(actor):
        bf16 = table.get(str(m.get(actor)).lower())
        if bf16 is not None:
            m.map(actor, "model.bf16", bf16)
            return
        m.skip(actor, f"training dtype {m.get(actor)!r}: ours is bf16 (model.bf16: true) or fp32")
    bf16 = table.get(str(m.get(rollout)).lower())
    if bf16 is not None:
        m.map(rollout, "model.bf16", bf16)
    else:
        m.derive("model.bf16", True, "(verl's default dtype: bf16)")


def _layout(m: Mapper) -> None:
    """The Megatron actor's layout keys, and its sequence parallelism (verl's default: on)."""
    for name, recipe_key in _MEGATRON_LAYOUT.items():
        key = A + "megatron." + name
        if m.pending(key):
            m.map(key, recipe_key, m.convert(key, pos_int))
    if not any(k.startswith(A + "megatron.") for k in m.values) and m.get(A + "strategy") != "megatron":
        return
    key = A + "megatron.sequence_parallel"
    tp = m.flat.get("parallel.tp", 1)
    on = m.convert(key, to_bool) if m.pending(key) else None
    if tp == 1:
        if on is not None:
            m.skip(key, "tp is 1: sequence parallelism splits activations over TP ranks (parallel.sequence_parallel "
                        "needs parallel.tp > 1)")
    elif on is not None:
        m.map(key, "parallel.sequence_parallel", on)
    else:
        m.derive("parallel.sequence_parallel", True, "(verl's Megatron default: megatron.sequence_parallel true)")


def _recompute(m: Mapper) -> None:
    """Megatron's recompute_* overrides, else FSDP's gradient checkpointing (each decoder layer's input
    kept and the layer run again in the backward: Megatron's full recomputation of 1-layer chunks)."""
    keys = {name: _RECOMPUTE + name for name in ("granularity", "method", "num_layers", "modules")}
    checkpointing = "actor_rollout_ref.model.enable_gradient_checkpointing"
    granularity = m.convert(keys["granularity"], to_str) if m.pending(keys["granularity"]) else None
    if granularity is None:
        for key in keys.values():
            if m.pending(key):
                m.skip(key, f"unused: {keys['granularity']} is not set (verl's default: no recomputation)")
        if m.pending(checkpointing):
            if m.convert(checkpointing, to_bool):
                m.map(checkpointing, "model.recompute", dict(FULL_RECOMPUTE))
            else:
                m.skip(checkpointing, "false: no recomputation (model.recompute: null, the default)")
        return
    if m.has(checkpointing):
        m.skip(checkpointing, f"superseded by {keys['granularity']}")
    if granularity == "full":
        value = {"granularity": "full",
                 "method": m.convert(keys["method"], to_str) if m.pending(keys["method"]) else "uniform",
                 "num_layers": m.convert(keys["num_layers"], pos_int) if m.pending(keys["num_layers"]) else 1}
        if value["method"] not in ("uniform", "block"):
            m.skip(keys["method"], f"recompute method {value['method']!r}: ours are uniform and block")
            value["method"] = "uniform"
        m.map(keys["granularity"], "model.recompute", value)
        m.done.update((keys["method"], keys["num_layers"]))
        if m.pending(keys["modules"]):
            m.skip(keys["modules"], "unused with full recomputation")
    elif granularity == "selective":
        modules = m.convert(keys["modules"], _modules) if m.pending(keys["modules"]) else ["core_attn"]
        ours = [module for module in modules if module in _RECOMPUTE_MODULES]
        if ours:
            m.map(keys["granularity"], "model.recompute", {"granularity": "selective", "modules": ours})
            m.done.add(keys["modules"])
        if len(ours) < len(modules):
            m.skip(keys["modules"], f"modules {', '.join(x for x in modules if x not in ours)}: ours are "
                                    f"{', '.join(_RECOMPUTE_MODULES)}")
        for key in (keys["method"], keys["num_layers"]):
            if m.pending(key):
                m.skip(key, "unused with selective recomputation")
    else:
        m.skip(keys["granularity"], f"recompute granularity {granularity!r}: ours are full and selective")


def _modules(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise Bad("a list of module names")


def _offload(m: Mapper) -> None:
    """FSDP's param_offload / optimizer_offload: the same states off the GPU while the engine generates
    (training/offload.py); the Megatron actor's own keys win (tables.DIRECT)."""
    for name, recipe_key in (("param_offload", "model.offload_params"), ("optimizer_offload", "optim.offload_optimizer")):
        key, megatron = A + "fsdp_config." + name, A + "megatron." + name
        if m.pending(key):
            if m.has(megatron):
                m.skip(key, f"superseded by {megatron}")
            else:
                m.map(key, recipe_key, m.convert(key, to_bool))


def _router_replay(m: Mapper) -> None:
    """verl's router_replay.mode: R3 replays the rollout engine's routing in the trainer's forwards, as
    rollout.routing_replay does here; R2 replays the routing the trainer's own pi_old pass recorded."""
    enable = R + "enable_rollout_routing_replay"
    for key in (A + "router_replay.mode", "actor_rollout_ref.ref.router_replay.mode"):
        if not m.pending(key):
            continue
        mode = m.convert(key, to_str)
        if key.startswith("actor_rollout_ref.ref."):
            m.skip(key, "the reference policy replays the rollout engine's routing whenever rollout.routing_replay "
                        "is on (the actor's router_replay.mode)")
        elif mode == "R3":
            m.map(key, "rollout.routing_replay", True)
        elif mode == "disabled":
            m.map(key, "rollout.routing_replay", False)
        else:
            m.skip(key, f"{mode}: verl records the routing of the trainer's own pi_old pass and replays it in the "
                        "updates; that has no counterpart here. rollout.routing_replay is R3 (the rollout engine's "
                        "routing replayed in every trainer forward, docs/moe.md); without it routing stays free")
    if m.has(enable) and "rollout.routing_replay" in m.flat and m.pending(enable):
        value = m.convert(enable, to_bool)
        if value != m.flat["rollout.routing_replay"]:
            m.skip(enable, f"{str(value).lower()}: superseded by {A}router_replay.mode (see the mapped "
                           "rollout.routing_replay)")


RULES = (_engine, _engine_settings, _precision, _layout, _recompute, _offload, _router_replay)
