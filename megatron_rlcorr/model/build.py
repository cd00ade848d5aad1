"""Megatron-Core's GPTModel for a ModelConfig under a parallel layout.

The layers are `model.transformer_impl`'s (implementation.py): Transformer Engine's on a
CUDA machine (BF16/FP8, fused kernels, Megatron-LM's GPU defaults), Megatron-Core's local ones on
the CPU (with our all-gather attention, since Megatron's local attention rejects CP and packed
sequences). A CUDA machine without Transformer Engine is an error naming the fix, never a silent
fall back to the local layers. The output layer is vocabulary-parallel and the logits
of Megatron's vocabulary padding, and of the checkpoint's rows beyond its tokenizer
(ModelConfig.token_vocab_size), are PADDED_VOCAB_LOGIT, so log-softmax over the padded
vocabulary equals the one over the tokenizer's rows, which the rollout engines sample from.

GPTModel stays the model: megatron-core 0.19 marks it deprecated (bug fixes only) in favour of
HybridModel and logs so on every build; it is what 0.16-0.19 build dense decoders with and what
the tests check, so that one notice is filtered out knowingly (`_drop_gptmodel_deprecation`)
and a move to HybridModel waits until GPTModel is gone from a version setup.py admits.

Initialisation: every weight is drawn from its own generator seeded by (seed, neutral name)
(weights.init_full_weights), so a seed gives the same model under any TP/PP/VPP layout
(Megatron-Core's own initialisation depends on the pipeline layout through the order in which
stages draw random numbers). With `model.hf_checkpoint` they are read from the checkpoint
instead, each rank reading only its shards.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .config import PADDED_VOCAB_LOGIT, Fp8Config, ModelConfig, pad_vocab_size
from . import implementation
from .weights import SPLIT_DIM, SeededWeights, WeightSource, load_full_weights, neutral_weight_shapes, parameter_slots

if TYPE_CHECKING:  # megatron.core is imported only where a model is built (import time ~5 s)
    from ..parallel.groups import ParallelGroups


def transformer_config(cfg: ModelConfig, groups: ParallelGroups, *, main_grads: bool = False):
    """Megatron-Core TransformerConfig for `cfg` under the parallel layout of `groups`.

    main_grads: the model will be wrapped in Megatron's DistributedDataParallel, whose float32
    `main_grad` buffers take the weight gradients; Transformer Engine's GEMMs then accumulate into
    them directly where the fused kernel is installed (gradient_accumulation_fusion). A model
    used without those buffers (forward-only, or a bare backward) must not ask for it.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cfg.num_query_groups % groups.tp_size or cfg.num_attention_heads % groups.tp_size:
        raise ValueError(f"num_attention_heads ({cfg.num_attention_heads}) and num_query_groups "
                         f"({cfg.num_query_groups}) must be divisible by parallel.tp={groups.tp_size}")
    stages = groups.pp_size * (groups.vpp_size or 1)
    if cfg.num_layers % stages:
        raise ValueError(f"num_layers ({cfg.num_layers}) must be divisible by pp*vpp = {stages}")
    impl = implementation.check_layers_here(cfg, sequence_parallel=groups.sequence_parallel)
    recompute = cfg.recompute.transformer_config_fields() if cfg.recompute is not None else {}
    if cfg.recompute is not None and cfg.recompute.granularity == "full" and cfg.recompute.method == "block":
        per_stage = cfg.num_layers // stages
        if cfg.recompute.num_layers > per_stage:
            raise ValueError(f"model.recompute.num_layers={cfg.recompute.num_layers} with method: block exceeds the "
                             f"{per_stage} layers of a pipeline stage (num_layers / (pp * vpp))")
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.add_qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        # Weights are set by load_full_weights (seeded per name); skip Megatron's own draw.
        perform_initialization=False,
        params_dtype=cfg.torch_params_dtype,
        pipeline_dtype=cfg.torch_params_dtype,
        bf16=cfg.bf16,
        tensor_model_parallel_size=groups.tp_size,
        pipeline_model_parallel_size=groups.pp_size,
        virtual_pipeline_model_parallel_size=groups.vpp_size,
        context_parallel_size=groups.cp_size,
        sequence_parallel=groups.sequence_parallel,
        **recompute,
        **_fp8_settings(cfg.fp8),
        **_moe_settings(cfg, groups, impl),
        **implementation.implementation_fields(impl, main_grads=main_grads),
    )


def _moe_settings(cfg: ModelConfig, groups: ParallelGroups, impl: str) -> dict[str, Any]:
    """TransformerConfig's MoE fields for `cfg.moe` under the expert layout of `groups` (none for a
    dense model). The router keeps Megatron-Core's RouterReplay (routing_replay.py drives it per
    micro-batch); its logits are computed in the parameters' dtype, as Hugging Face and vLLM do."""
    moe = cfg.moe
    if moe is None:
        if groups.ep_size > 1 or groups.etp_size > 1:
            raise ValueError(f"parallel.ep={groups.ep_size} / parallel.etp={groups.etp_size} need a mixture-of-experts "
                             "model (model.moe); this model is dense: set both to 1")
        return {}
    if groups.tp_size > 1 and not groups.sequence_parallel:
        raise ValueError(f"model.moe with parallel.tp={groups.tp_size} needs parallel.sequence_parallel: true "
                         "(Megatron-Core's MoE layer trains with tensor parallelism only under sequence parallelism)")
    if moe.num_experts % groups.ep_size:
        raise ValueError(f"model.moe.num_experts ({moe.num_experts}) must be divisible by parallel.ep={groups.ep_size}")
    if moe.ffn_hidden_size % groups.etp_size:
        raise ValueError(f"model.moe.ffn_hidden_size ({moe.ffn_hidden_size}) must be divisible by "
                         f"parallel.etp={groups.etp_size}")
    if moe.dispatcher() == "alltoall" and groups.etp_size > 1 and _backend(groups.etp) == "gloo":
        raise ValueError(f"model.moe.token_dispatcher: alltoall with parallel.etp={groups.etp_size} needs NCCL: the "
                         "dispatcher all-gathers uneven token counts over the expert-tensor-parallel ranks, which gloo "
                         "(the CPU backend) cannot; set model.moe.token_dispatcher: allgather or parallel.etp: 1")
    shared = moe.shared_expert_ffn_hidden_size
    if shared is not None and shared % groups.tp_size:
        raise ValueError(f"model.moe.shared_expert_ffn_hidden_size ({shared}) must be divisible by parallel.tp="
                         f"{groups.tp_size}")
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=[int(cfg.decoder_shape.is_moe_layer(i)) for i in range(cfg.num_layers)],
        moe_router_pre_softmax=moe.pre_softmax,
        moe_router_score_function="softmax",
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_token_dispatcher_type=moe.dispatcher(),
        moe_grouped_gemm=impl == "transformer_engine",  # TEGroupedMLP on the GPU, SequentialMLP on the CPU
        moe_permute_fusion=impl == "transformer_engine" and moe.dispatcher() == "alltoall",
        moe_enable_routing_replay=True,
        expert_model_parallel_size=groups.ep_size,
        expert_tensor_parallel_size=groups.etp_size,
    )


def _backend(group) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(group))


def _fp8_settings(fp8: Fp8Config | None) -> dict[str, Any]:
    """TransformerConfig's `fp8` / `fp8_recipe` for this Megatron-Core version."""
    if fp8 is None:
        return {}
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    if "fp8_recipe" not in names:
        if fp8.recipe != "delayed":
            raise ValueError(f"fp8.recipe={fp8.recipe!r} needs a Megatron-Core with TransformerConfig.fp8_recipe; "
                             "this one only has delayed scaling")
        return {"fp8": fp8.format}
    from megatron.core.enums import Fp8Recipe

    supported = [r.value for r in Fp8Recipe]
    if fp8.recipe not in supported:
        raise ValueError(f"fp8.recipe={fp8.recipe!r} is not supported by the installed Megatron-Core "
                         f"(supported: {', '.join(supported)})")
    return {"fp8": fp8.format, "fp8_recipe": fp8.recipe}


def _layer_spec(cfg: ModelConfig, groups: ParallelGroups, config, vp_stage: int | None):
    from megatron.core.models.gpt import gpt_layer_specs

    if implementation.resolve_transformer_impl(cfg.transformer_impl) == "transformer_engine":  # checked by transformer_config
        if cfg.moe is not None:  # dense and MoE layers as moe_layer_freq says, this stage's only
            return gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                                              normalization="RMSNorm", vp_stage=vp_stage,
                                                              pp_rank=groups.pp_rank)
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)
    return _local_block_spec(cfg, groups, config, vp_stage)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built the way Megatron-Core builds a norm (config, hidden_size, eps), for the
    local layers under sequence parallelism, where Megatron-Core's torch norm wrapper refuses to
    build (WrappedTorchNorm asserts). Each tensor-parallel rank normalises its slice of the
    sequence with the same weight; the weight is tagged `sequence_parallel` (when the config is),
    so finalize_model_grads sums its gradient over the TP ranks, as it does for Transformer
    Engine's norms (untagged, a dense tp2 run of tools/check_parallel_parity.py ended 2.3e-2 away
    from the one-process weights after 3 steps; tagged, 4e-7). Query/key norms (head_dim wide) see the whole sequence and are summed by their
    names there: they take `tag=False`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, tag: bool = True, **_unused):
        super().__init__(hidden_size, eps=eps)
        if tag and config.sequence_parallel:
            setattr(self.weight, "sequence_parallel", True)


class _HeadRMSNorm(SequenceParallelRMSNorm):
    """A query/key norm under sequence parallelism: untagged (SequenceParallelRMSNorm). A class, not a
    function: Megatron-Core's build_module returns a plain function as the module itself, unbuilt."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(config, hidden_size, eps, tag=False, **kwargs)


_head_rms_norm = _HeadRMSNorm


def _local_block_spec(cfg: ModelConfig, groups: ParallelGroups, config, vp_stage: int | None):
    """The CPU path's block: local layers, our attention, torch norms (SequenceParallelRMSNorm
    under sequence parallelism).

    The block is spelled out because Megatron-Core picks the final norm of a block built from a
    layer spec by what is installed (Transformer Engine's when it is), and TE's norm needs CUDA:
    on a GPU machine with the GPUs hidden the CPU path must not use it.
    """
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from ..parallel.cp_attention import ContextParallelAttention

    def local_spec(moe_layer: bool):
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=cfg.moe.num_experts if moe_layer else None, moe_grouped_gemm=False,
            qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
        # Megatron's DotProductAttention rejects context parallelism and packed (THD) sequences; ours
        # attends over the all-gathered K/V with the causal mask on global zigzag positions, within
        # each packed sequence.
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
        if groups.sequence_parallel:
            layer = spec.submodules
            layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
            if cfg.qk_layernorm:
                layer.self_attention.submodules.q_layernorm = _head_rms_norm
                layer.self_attention.submodules.k_layernorm = _head_rms_norm
        return spec

    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=groups.pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=groups.pp_rank)
    shape = cfg.decoder_shape
    specs = {moe_layer: local_spec(moe_layer) for moe_layer in {shape.is_moe_layer(offset + j) for j in range(num_layers)}}
    final_norm = SequenceParallelRMSNorm if groups.sequence_parallel else WrappedTorchNorm
    return TransformerBlockSubmodules(layer_specs=[specs[shape.is_moe_layer(offset + j)] for j in range(num_layers)],
                                      layer_norm=final_norm)


def initial_weights(cfg: ModelConfig, seed: int) -> WeightSource:
    """Where a new model's weights come from: `cfg.hf_checkpoint` (its inventory checked against
    the architecture first) or the seeded initialisation."""
    if cfg.hf_checkpoint is None:
        return SeededWeights(cfg, seed)
    from .hf import HFCheckpoint

    checkpoint = HFCheckpoint(cfg.hf_checkpoint)
    checkpoint.check(neutral_weight_shapes(cfg), tied=cfg.tie_embeddings)
    return checkpoint


def vp_stages(groups: ParallelGroups) -> list[int | None]:
    """The virtual pipeline stages of this rank's model chunks ([None] without interleaving)."""
    return list(range(groups.vpp_size)) if groups.vpp_size else [None]


def build_model_chunks(cfg: ModelConfig, groups: ParallelGroups, *, seed: int = 1234,
                       weights: WeightSource | None = None, init_weights: bool = True,
                       main_grads: bool = False) -> list[Any]:
    """This rank's GPTModel chunks, one per virtual pipeline stage, from one weight source (none
    with init_weights=False: a checkpoint's state follows). main_grads: see transformer_config."""
    if init_weights and weights is None:
        weights = initial_weights(cfg, seed)
    return [build_gpt_model(cfg, groups, vp_stage=vp, seed=seed, weights=weights, init_weights=init_weights,
                            main_grads=main_grads)
            for vp in vp_stages(groups)]


def build_gpt_model(cfg: ModelConfig, groups: ParallelGroups, *, pre_process: bool | None = None,
                    post_process: bool | None = None, vp_stage: int | None = None, seed: int = 1234,
                    init_weights: bool = True, weights: WeightSource | None = None, main_grads: bool = False):
    """This rank's GPTModel chunk, of model.transformer_impl's layers (implementation.py).

    pre_process / post_process default to whether this is the first / last pipeline stage (for
    virtual chunk `vp_stage`). Weights come from `weights`, by default `initial_weights(cfg,
    seed)` (a Hugging Face checkpoint, or the seeded initialisation, identical for every parallel
    layout); with init_weights=False they stay uninitialised (load_full_weights or a checkpoint
    must follow). `seed` also seeds Megatron's TP RNG tracker if nobody did yet.
    The output layer is vocabulary-parallel ([b, s, V_padded / tp] per TP rank); logits of
    the rows from cfg.sampled_vocab_size on (Megatron's padding included) are PADDED_VOCAB_LOGIT.
    """
    from megatron.core.models.gpt import GPTModel

    _drop_gptmodel_deprecation()
    if pre_process is None:
        pre_process = groups.is_pipeline_first_stage(vp_stage)
    if post_process is None:
        post_process = groups.is_pipeline_last_stage(vp_stage)
    padded_vocab = pad_vocab_size(cfg.vocab_size, groups.tp_size, cfg.make_vocab_size_divisible_by)
    config = transformer_config(cfg, groups, main_grads=main_grads)
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(cfg, groups, config, vp_stage),
        vocab_size=padded_vocab,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.rotary_base,
        rope_scaling=cfg.rope_scaling,
        rope_scaling_factor=cfg.rope_scaling_factor,
        pg_collection=groups.pg_collection,
        vp_stage=vp_stage,
    )
    model.unpadded_vocab_size = cfg.vocab_size  # export strips the padding rows
    forget_router_replays(getattr(m, "router_replay", None) for m in model.modules())
    model.neutral_shapes = neutral_weight_shapes(cfg)  # full shapes, for loading and streaming export
    _mark_tensor_parallel_params(model, cfg.tie_embeddings)
    _mark_expert_params(model, cfg.tie_embeddings, config)
    # The local spec's torch norms ignore params_dtype (Megatron's Float16Module would cast them).
    for param in model.parameters():
        if param.dtype != cfg.torch_params_dtype:
            param.data = param.data.to(cfg.torch_params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if post_process and padded_vocab > cfg.sampled_vocab_size:
        mask_padding = _padded_vocab_mask_hook(cfg.sampled_vocab_size, padded_vocab, groups.tp_rank)
        model.output_layer.register_forward_hook(mask_padding)
    if post_process and cfg.fp32_lm_head:
        _output_layer_in_float32(model.output_layer)
    _seed_megatron_rng(seed, groups)
    if init_weights:
        load_full_weights([model], weights if weights is not None else initial_weights(cfg, seed), groups)
    return model


def _mark_tensor_parallel_params(model, tied: bool) -> None:
    """Set Megatron's `tensor_model_parallel` / `partition_dim` on TP-split parameters.

    With perform_initialization=False Megatron-Core's own parallel layers (embedding, output layer,
    local linears) skip the call that sets them, on the host and on the GPU alike (Transformer
    Engine's layers set them themselves); the optimizer's grad norm (and clipping) would then count
    only TP rank 0's shard of every split weight.
    """
    for slot in parameter_slots(model, tied):
        if slot.layout != "replicated" and not getattr(slot.param, "tensor_model_parallel", False):
            slot.param.tensor_model_parallel = True
            slot.param.partition_dim = SPLIT_DIM[slot.layout]
            slot.param.partition_stride = 1


def _mark_expert_params(model, tied: bool, config) -> None:
    """Mark every routed expert's weight as an expert-parallel parameter (Megatron's `allreduce =
    False`) on every expert layout, ep = 1 included. DDP then reduces their gradients over the
    expert-data-parallel group (with ep = 1 and etp = tp the same ranks as the dense layers' DP x
    CP), and Megatron's optimizer steps them in an optimizer of their own (the expert groups'),
    so a MoE model's optimizer is always the same chain of two and its checkpoints load across
    expert layouts (a chain of one at ep = 1 could not read the chain of two that ep = 2 writes).
    megatron-core 0.16.1 marks them only when expert_model_parallel_size > 1 (0.19 also when
    expert_tensor_parallel_size != tensor_model_parallel_size); with parallel.ep=1, parallel.etp=2,
    tp=1 its DDP averaged the two expert-TP halves as if they were replicas (measured with
    tools/check_parallel_parity.py --layouts etp2: weights 0.12 off the one-process run)."""
    if config.num_moe_experts is None:
        return
    for slot in parameter_slots(model, tied):
        if slot.expert:
            slot.param.allreduce = False


def _output_layer_in_float32(layer) -> None:
    """model.fp32_lm_head: the output layer (a ColumnParallelLinear) multiplies float32 copies of its
    input and of the weight it is given (the embedding's, when tied) or holds, so the logits carry no
    bf16 rounding. Everything else is Megatron's own forward: the sequence-parallel all-gather (of
    float32 hidden states), the vocabulary-parallel output, the forward hooks (the padded-vocab mask).
    Gradients flow back through the casts to the bf16 hidden states and parameter; the fused
    weight-gradient accumulation is off for this layer (it writes into the parameter's main_grad,
    which the float32 copy has not; DDP's hook adds the parameter's gradient to main_grad instead)."""
    forward = layer.forward
    layer.gradient_accumulation_fusion = False

    def float32_forward(input_, weight=None, runtime_gather_output=None):
        weight = layer.weight if weight is None else weight  # (None: Megatron's forward names the problem)
        return forward(input_.float(), weight=None if weight is None else weight.float(),
                       runtime_gather_output=runtime_gather_output)

    layer.forward = float32_forward


def _padded_vocab_mask_hook(sampled_vocab: int, padded_vocab: int, tp_rank: int) -> Callable:
    """Forward hook of the output layer: the columns from `sampled_vocab` on (Megatron's padding,
    and a checkpoint's own padding beyond its tokenizer: ModelConfig.token_vocab_size) get
    PADDED_VOCAB_LOGIT, in whichever TP rank's vocabulary shard they fall."""

    def hook(module, args, output):
        logits, bias = output
        width = logits.shape[-1]
        first_id = 0 if width == padded_vocab else tp_rank * width  # TP-gathered or vocab-parallel
        real_columns = sampled_vocab - first_id
        if real_columns >= width:
            return output
        is_padding = torch.arange(width, device=logits.device) >= real_columns
        return logits.masked_fill(is_padding, PADDED_VOCAB_LOGIT), bias

    return hook


def _seed_megatron_rng(seed: int, groups: ParallelGroups) -> None:
    """Seed Megatron's tensor-parallel RNG tracker unless the entry point already did.

    DotProductAttention forks the tracker's "model-parallel-rng" state around (zero) dropout, so a
    model cannot run before the tracker is seeded.
    """
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

    if _MODEL_PARALLEL_RNG_TRACKER_NAME not in tensor_parallel.get_cuda_rng_tracker().get_states():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=groups.tp_rank, ep_rank=0, etp_rank=0)


class _GPTModelDeprecationFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "GPTModel IS DEPRECATED" not in record.getMessage()


def forget_router_replays(replays) -> None:
    """Take RouterReplay objects out of Megatron-Core's class-wide instance list (by identity). Its
    static methods would drive every model of the process at once (the policy, the reference, eval's);
    training/routing_replay.py drives each model's routers itself, and a model dropped (a test, a
    rebuilt reference) must not stay referenced there."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    gone = {id(r) for r in replays if r is not None}
    if gone:
        instances = RouterReplay.global_router_replay_instances
        instances[:] = [r for r in instances if id(r) not in gone]


def _drop_gptmodel_deprecation() -> None:
    """Filter megatron-core 0.19's per-build "GPTModel IS DEPRECATED" warning (module docstring),
    and nothing else its logger says; once per process."""
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    if not any(isinstance(f, _GPTModelDeprecationFilter) for f in logger.filters):
        logger.addFilter(_GPTModelDeprecationFilter())
