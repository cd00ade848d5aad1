"""Parameters and memory per GPU of a recipe's layout: the model behind `megatron-rlcorr plan`.

Why: a 32B layout is chosen before queueing for 128 GPUs, on a laptop. Every term is a formula of
the recipe (model shape, parallel layout, batch and sequence sizes, optimizer, rollout engine), so
it can be checked by hand; the sources are Megatron-LM's theoretical_memory_usage.py and
Korthikanti et al. 2022 (arXiv 2205.05198). They are estimates until compared with
torch.cuda.max_memory_allocated on a GPU; the state terms (weights, gradients, optimizer) are
exact counts of what Megatron-Core allocates, and the tests compare them with a CPU model's.

Conventions: bytes everywhere (GiB = 2**30 only in `MemoryEstimate.gib`); a "rank" is one GPU.
- Parameters per rank: a decoder layer's matrices and q/k/v biases are split over TP, its norms
  are replicated; the first pipeline stage adds the embedding, the last the final norm and the
  output layer (Megatron keeps a copy of a tied embedding there when pp > 1), both over the
  vocabulary padded to `make_vocab_size_divisible_by * tp`. Layer i is on stage (i // chunk) % pp,
  chunk = num_layers / (pp * vpp) (the interleaved schedule's order).
- a mixture-of-experts layer (model.moe) has, besides attention and norms, a router (E x h) and a
  shared expert's gate (h), both replicated over TP, the shared expert's SwiGLU split over TP, and
  E / ep routed experts, each split over etp: 3 h f_e / etp each (`experts_per_stage`).
- weights: params_dtype (2 bytes bf16, 4 fp32). gradients: 4 (fp32 main grads,
  grad_reduce_in_fp32). optimizer (Adam): fp32 master copy (bf16 params only) + m + v, divided by
  DP x CP with the distributed optimizer; a routed expert's by the expert-data-parallel size
  tp * cp * dp / (ep * etp) instead. So EP lowers weights and gradients per GPU, while the
  experts' optimizer states per GPU stay all the stage's experts over its ranks whatever ep is.
- activations, per token of a micro-batch per layer, bf16, flash attention, no dropout: the four
  inputs of the two norms and the two input projections (8h bytes, split over TP only with
  sequence parallelism), q, k and v and the attention output (4q + 4kv), the MLP's gate/up output
  and the SwiGLU output (6f), split over TP. A MoE layer replaces the MLP's 6f / tp with
  k (4h + 6 f_e / etp) + 8E (the token's k routed copies: each expert's input and its weighted
  output, its gate/up and SwiGLU outputs; the router's float32 logits and probabilities), split
  over TP with sequence parallelism, and the shared expert's 6 f_s / tp: with balanced routing
  every rank processes k expert slots per token of its own, whatever ep is. Selective
  recomputation drops the dense MLP's part (`mlp`; Megatron-Core leaves a MoE layer's experts
  alone) or the norm outputs (`layernorm`); `core_attn` saves nothing more, flash attention
  already recomputes the scores. Full recomputation keeps each chunk's input (2h) and one chunk
  live in its backward. The first stage holds `pp` micro-batches in flight under 1F1B, times
  1 + (pp - 1) / (pp * vpp) when interleaved.
- logits: the last stage's log-prob computation per token and vocabulary entry of its TP shard:
  the logits and their gradient (2 bytes each in bf16; 4 with `model.fp32_lm_head` or a float32
  model) plus the chunked log-prob's two float32 chunks of 1/16 of the tokens (0.5 bytes;
  training/logprobs.py); `fp32_lm_head` adds a float32 copy of the output weight and its
  gradient (8 bytes per output-layer parameter).
- rollout: vLLM's `gpu_memory_utilization` share while it generates, nothing while it sleeps
  (levels 1 and 2) or the same share when it stays resident (level 0); the embedded engine keeps
  a full copy of the model (every expert) in its weight dtype all the time, K + 1 copies under
  rollout.policy_lag K. With rollout.placement separate the trainer ranks hold no engine (these
  terms are 0; `world_size` is then the trainer ranks, the launch less rollout.num_ranks), and
  each rollout rank holds the engine alone (`rollout_rank_bytes`): vLLM's share (its weights and
  KV cache), or the embedded engine's one copy. rollout.max_staleness adds no copy: the engine
  holds the latest weights it was sent; the staleness is in the batches generated ahead
  (tokens and log-probs, sent to the trainer over gloo).
- total: the larger of the two phases: training (the states + activations + logits + the
  engine's resident memory) and generation (the states the trainer keeps on the GPU + the
  engine's share; the trainer's activations are freed and its cache emptied before the engine
  wakes). Trainer offload (training/offload.py) takes states off the GPU while the engine
  generates: `model.offload_params` the weights, `model.offload_grads` the gradients,
  `optim.offload_optimizer` the optimizer state; with all three the generation phase holds the
  engine's share and nothing of training. A layout fits when the total leaves HEADROOM of the
  GPU free.
FP8 training is estimated as BF16: Transformer Engine's FP8 weight copies add about a byte per
parameter, and its FP8 copies of GEMM inputs save some activation memory.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from ..model.config import ModelConfig, pad_vocab_size
from ..parallel.layout import ParallelSettings

if TYPE_CHECKING:
    from ..training.optimizer import OptimSettings
    from .recipe import Recipe

GiB = 2**30
# Kept free of the estimate: the CUDA context, NCCL's buffers, the allocator's fragmentation, and
# the estimate's own error. A layout fits when its total is at most the rest.
HEADROOM = 0.10
GRAD_BYTES = 4                 # fp32 main gradients
CHUNK_BYTES_PER_ENTRY = 0.5   # two float32 chunks of 1/16 of the tokens (training/logprobs.py)


@dataclass(frozen=True)
class ParameterCounts:
    total: int                     # as in the Hugging Face checkpoint (unpadded vocabulary)
    per_stage: tuple[int, ...]     # one rank of each pipeline stage (all its virtual chunks), its experts included
    padded_vocab_size: int
    # Of per_stage: the routed experts' parameters, which the distributed optimizer shards over the
    # expert-data-parallel group instead of DP x CP (zeros for a dense model)
    experts_per_stage: tuple[int, ...]
    active: int                    # what one token computes with (DecoderShape.active_parameter_count)

    @property
    def per_gpu_max(self) -> int:
        return max(self.per_stage)


def layer_stage(layer: int, num_layers: int, parallel: ParallelSettings) -> int:
    """The pipeline stage holding decoder layer `layer`: the layers are cut into pp * vpp chunks in
    order, and chunk c runs on stage c % pp (Megatron-Core's interleaved schedule)."""
    chunk = num_layers // (parallel.pp * (parallel.vpp or 1))
    return layer // chunk % parallel.pp


def layer_parameters_per_rank(model: ModelConfig, parallel: ParallelSettings, layer: int) -> tuple[int, int]:
    """(parameters, of which routed experts) of decoder layer `layer` on one rank (module docstring)."""
    shape, tp = model.decoder_shape, parallel.tp
    h, d = shape.hidden_size, shape.head_dim
    replicated = 2 * h + (2 * d if shape.qk_layernorm else 0)
    attention = replicated + (shape.attention_parameters - replicated) // tp
    if not shape.is_moe_layer(layer):
        return attention + 3 * h * shape.ffn_hidden_size // tp, 0
    moe = shape.moe
    shared = 0 if moe.shared_expert_ffn_hidden_size is None else 3 * h * moe.shared_expert_ffn_hidden_size // tp + h
    experts = moe.num_experts // parallel.ep * moe.expert_parameters(h) // parallel.etp
    return attention + moe.num_experts * h + shared + experts, experts


def parameter_counts(model: ModelConfig, parallel: ParallelSettings) -> ParameterCounts:
    """Parameters in total and on one rank of each pipeline stage (module docstring)."""
    shape, tp, pp = model.decoder_shape, parallel.tp, parallel.pp
    h = shape.hidden_size
    vocab = pad_vocab_size(shape.vocab_size, tp, model.make_vocab_size_divisible_by)
    embedding = vocab * h // tp
    head = embedding if (not shape.tie_embeddings or pp > 1) else 0
    stages, experts = [0] * pp, [0] * pp
    for layer in range(shape.num_layers):
        params, expert_params = layer_parameters_per_rank(model, parallel, layer)
        stage = layer_stage(layer, shape.num_layers, parallel)
        stages[stage] += params
        experts[stage] += expert_params
    stages[0] += embedding
    stages[-1] += h + head
    return ParameterCounts(total=shape.parameter_count, per_stage=tuple(stages), padded_vocab_size=vocab,
                           experts_per_stage=tuple(experts), active=shape.active_parameter_count)


def expert_optimizer_group_size(parallel: ParallelSettings, world_size: int) -> int:
    """The ranks the gradients of one routed-expert shard are reduced over, and the distributed
    optimizer shards its states over: the expert-data-parallel group, tp * cp * dp / (ep * etp)
    (model/build.py marks the experts expert-parallel on every layout, ep 1 included)."""
    return world_size // parallel.pp // (parallel.ep * parallel.etp)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the most-loaded pipeline stage (module docstring for each term)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    rollout: float            # the engine's share while it generates
    rollout_resident: float   # what the engine keeps while the trainer trains
    total: float
    stage: int = 0            # the pipeline stage these are of
    offloaded: float = 0.0    # of weights + gradients + optimizer: what trainer offload moves off during generation

    @property
    def training_phase(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.rollout_resident

    @property
    def generation_phase(self) -> float:
        return self.weights + self.gradients + self.optimizer - self.offloaded + self.rollout

    def gib(self) -> dict[str, float]:
        fields = asdict(self)
        fields.pop("rollout_resident"), fields.pop("stage"), fields.pop("offloaded")
        return {name: round(value / GiB, 2) for name, value in fields.items()}

    def phases_gib(self) -> dict[str, float]:
        """The two phases' totals and what offload moves off the GPU for generation."""
        return {name: round(value / GiB, 2) for name, value in (
            ("training", self.training_phase), ("generation", self.generation_phase), ("offloaded", self.offloaded))}


def usable_bytes(gpu_memory_gib: float) -> float:
    """What a layout's estimate may use of a GPU with `gpu_memory_gib` GiB (HEADROOM kept free)."""
    return (1 - HEADROOM) * gpu_memory_gib * GiB


def sequence_tokens(recipe: Recipe) -> int:
    """The longest sequence of the run: prompt limit (or the model's context) + response limit."""
    prompt = recipe.data.max_prompt_length
    if prompt is None:
        return recipe.model.max_position_embeddings
    return prompt + recipe.rollout.max_new_tokens


def micro_batch_tokens(recipe: Recipe) -> int:
    """Tokens of one micro-batch on one rank: the packing budget (per context-parallel rank), or
    micro_batch_size sequences of the longest length split over CP."""
    budget = recipe.trainer.max_tokens_per_micro_batch
    if budget:
        return budget
    return recipe.trainer.micro_batch_size * math.ceil(sequence_tokens(recipe) / recipe.parallel.cp)


def activation_bytes_per_token(model: ModelConfig, parallel: ParallelSettings, layers: int,
                               moe_layers: int = 0) -> float:
    """Activation bytes one token of a micro-batch keeps over `layers` layers of one stage, `moe_layers`
    of them mixture-of-experts layers (module docstring)."""
    shape, tp = model.decoder_shape, parallel.tp
    h, f = shape.hidden_size, shape.ffn_hidden_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_query_groups * shape.head_dim
    split_h = tp if parallel.sequence_parallel else 1
    norm_inputs, norm_outputs = 4 * h / split_h, 4 * h / split_h
    attention, mlp = (4 * q + 4 * kv) / tp, 6 * f / tp
    full_layer = norm_inputs + norm_outputs + attention + mlp
    moe_mlp = mlp if moe_layers == 0 else moe_block_activation_bytes(model, parallel)
    moe_layer = full_layer - mlp + moe_mlp
    recompute = model.recompute
    dense_layers = layers - moe_layers
    if recompute is None:
        return dense_layers * full_layer + moe_layers * moe_layer
    if recompute.granularity == "selective":
        # `mlp` recomputes the dense MLPs only (Megatron-Core leaves a MoE layer's experts alone)
        dropped = norm_outputs if "layernorm" in recompute.modules else 0
        return dense_layers * (full_layer - dropped - (mlp if "mlp" in recompute.modules else 0)) + moe_layers * (
            moe_layer - dropped)
    chunk_input = 2 * h / split_h
    live = moe_layer if moe_layers else full_layer  # the larger layer, recomputed in its backward
    n = min(recompute.num_layers, layers)
    if recompute.method == "uniform":
        return math.ceil(layers / n) * chunk_input + n * live
    # block: the first n layers recomputed, the others kept (with MoE layers: in the stage's proportion)
    kept = (layers - n) * full_layer if moe_layers == 0 else (
        (dense_layers * full_layer + moe_layers * moe_layer) * (layers - n) / layers)
    return n * chunk_input + kept + live


def moe_block_activation_bytes(model: ModelConfig, parallel: ParallelSettings) -> float:
    """A MoE block's activation bytes per token (what replaces the dense MLP's 6f / tp; module
    docstring): the token's k routed copies (each expert's input and weighted output, 4h, and its
    gate/up and SwiGLU outputs, 6 f_e / etp) and the router's float32 logits and probabilities (8E),
    split over TP with sequence parallelism; the shared expert as a dense MLP, 6 f_s / tp."""
    moe, h, tp = model.decoder_shape.moe, model.hidden_size, parallel.tp
    split_h = tp if parallel.sequence_parallel else 1
    routed = (moe.router_topk * (4 * h + 6 * moe.ffn_hidden_size / parallel.etp) + 8 * moe.num_experts) / split_h
    shared = 0.0 if moe.shared_expert_ffn_hidden_size is None else 6 * moe.shared_expert_ffn_hidden_size / tp
    return routed + shared


def in_flight_micro_batches(parallel: ParallelSettings) -> float:
    """Micro-batches whose activations the first stage holds at once under 1F1B."""
    pp, vpp = parallel.pp, parallel.vpp or 1
    if pp == 1:
        return 1.0
    return pp * (1 + (pp - 1) / (pp * vpp)) if vpp > 1 else float(pp)


def state_bytes_per_parameter(model: ModelConfig, optim: OptimSettings, dp_cp: int) -> tuple[int, int, float]:
    """(weight, gradient, optimizer) bytes per parameter of a rank; `dp_cp` = DP x CP, the group the
    distributed optimizer shards over."""
    param_bytes = 2 if model.params_dtype == "bfloat16" else 4
    optimizer_bytes = (12 if param_bytes == 2 else 8) / (dp_cp if optim.use_distributed_optimizer else 1)
    return param_bytes, GRAD_BYTES, optimizer_bytes


def estimate_memory(recipe: Recipe, world_size: int, gpu_memory_bytes: float) -> MemoryEstimate:
    """The memory of the most-loaded stage's GPUs (module docstring)."""
    return max(stage_estimates(recipe, world_size, gpu_memory_bytes), key=lambda m: m.total)


def stage_estimates(recipe: Recipe, world_size: int, gpu_memory_bytes: float) -> list[MemoryEstimate]:
    """The memory of each pipeline stage's GPUs (module docstring)."""
    model, parallel = recipe.model, recipe.parallel
    counts = parameter_counts(model, parallel)
    dp_cp = parallel.data_parallel_size(world_size) * parallel.cp
    param_bytes, _, optimizer_bytes = state_bytes_per_parameter(model, recipe.optim, dp_cp)
    expert_optimizer_bytes = state_bytes_per_parameter(model, recipe.optim,
                                                       expert_optimizer_group_size(parallel, world_size))[2]
    tokens = micro_batch_tokens(recipe)
    layers = model.num_layers // parallel.pp
    moe_layers = [0] * parallel.pp
    for layer in model.decoder_shape.moe_layers:
        moe_layers[layer_stage(layer, model.num_layers, parallel)] += 1
    logits = logit_bytes(model, tokens, counts.padded_vocab_size / parallel.tp)
    generating, resident = _rollout_bytes(recipe, counts.total, gpu_memory_bytes)
    in_flight = in_flight_micro_batches(parallel)
    candidates = []
    for index, params in enumerate(counts.per_stage):  # the first stage has the activations, the last the logits
        activations = tokens * activation_bytes_per_token(model, parallel, layers, moe_layers[index])
        act = activations * in_flight if index == 0 else activations * max(1.0, in_flight - index)
        lgt = logits if index == parallel.pp - 1 else 0.0
        experts = counts.experts_per_stage[index]
        weights, gradients = params * param_bytes, params * GRAD_BYTES
        optimizer = (params - experts) * optimizer_bytes + experts * expert_optimizer_bytes
        estimate = MemoryEstimate(weights=weights, gradients=gradients, optimizer=optimizer, activations=act,
                                  logits=lgt, rollout=generating, rollout_resident=resident, total=0.0, stage=index,
                                  offloaded=offloaded_bytes(recipe, weights, gradients, optimizer))
        candidates.append(replace(estimate, total=max(estimate.training_phase, estimate.generation_phase)))
    return candidates


def logit_bytes(model: ModelConfig, tokens: int, vocab_per_rank: float) -> float:
    """The last stage's log-prob computation: logits, their gradient, the float32 chunks, and with
    fp32_lm_head the output weight's float32 copy and its gradient (module docstring)."""
    float32_logits = model.fp32_lm_head or not model.bf16
    per_entry = 2 * (4 if float32_logits else 2) + CHUNK_BYTES_PER_ENTRY
    weight_copy = 8 * vocab_per_rank * model.hidden_size if model.fp32_lm_head else 0.0
    return per_entry * tokens * vocab_per_rank + weight_copy


def offloaded_bytes(recipe: Recipe, weights: float, gradients: float, optimizer: float) -> float:
    """Of a rank's weight, gradient and optimizer bytes: what trainer offload moves off the GPU while
    the engine generates."""
    model, optim = recipe.model, recipe.optim
    return ((weights if model.offload_params else 0.0) + (gradients if model.offload_grads else 0.0)
            + (optimizer if optim.offload_optimizer else 0.0))


def rollout_rank_bytes(recipe: Recipe, gpu_memory_bytes: float) -> float:
    """What one rollout rank of rollout.placement separate holds: the engine while it generates
    (the colocated engine's share, on a GPU of its own; module docstring)."""
    return _engine_bytes(recipe, parameter_counts(recipe.model, recipe.parallel).total, gpu_memory_bytes)[0]


def _rollout_bytes(recipe: Recipe, total_params: int, gpu_memory_bytes: float) -> tuple[float, float]:
    """(while generating, while training) bytes of the colocated engine on one GPU; nothing on a
    trainer rank of rollout.placement separate."""
    if recipe.rollout.separate:
        return 0.0, 0.0
    return _engine_bytes(recipe, total_params, gpu_memory_bytes)


def _engine_bytes(recipe: Recipe, total_params: int, gpu_memory_bytes: float) -> tuple[float, float]:
    """(while generating, while the trainer trains) bytes of the engine on one GPU."""
    rollout = recipe.rollout
    if rollout.engine == "vllm":
        share = rollout.gpu_memory_utilization * gpu_memory_bytes
        return share, (share if rollout.sleep_level == 0 else 0.0)
    # rollout.policy_lag K keeps the K + 1 latest weight sets (rollout/embedded.py).
    copies = total_params * rollout.weight_dtype.itemsize * (rollout.policy_lag + 1)
    return copies, copies
