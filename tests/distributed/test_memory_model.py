"""The memory model of `plan` (recipe/memory.py) against what Megatron-Core allocates on the CPU.

tests/unit/test_plan.py checks the formulas against hand-computed cases; here the real model and
optimizer (build_model_and_optimizer, gloo) are built under several layouts and each term that
a CPU run can measure is compared with its formula on every rank:

- parameters per rank (`parameter_counts(...).per_stage[pp_rank]`) = the numel of the rank's
  model chunks, exactly: TP 2, PP 2, TP 2 x PP 2 and DP 2, an untied model with q/k/v bias and
  a tied one with per-head q/k norms (PP 2 keeps a copy of the tied embedding on the last stage),
  vocabularies padded (100 -> 104 at tp1, 112 at tp2 with make_vocab_size_divisible_by 8) and
  unpadded; `.total` = the unpadded single-copy model (a DP 2 build with divisor 1, and the
  transformers model of the same shape). Weight bytes = params x params_dtype size.
- gradients: the DDP float32 main-grad buffers = params x GRAD_BYTES; exact with plain Adam,
  within the distributed optimizer's alignment padding otherwise (below).
- optimizer: after one real train_minibatch step, Adam's exp_avg + exp_avg_sq (+ the float32
  master copies of a bf16 model) held by the rank = `state_bytes_per_parameter(...)[2]` x params,
  exact with plain Adam; with the distributed optimizer each DP rank holds one shard of the
  padded buffer, so a rank is within the padding of params / dp and the DP ranks together hold
  exactly the undivided formula.
- activations with full recomputation (uniform, 1 layer a chunk): the tensors autograd saves in
  the forward of the recomputed layers (saved_tensors_hooks around Megatron's checkpointed
  forward of the block, in the real step; it moved in megatron-core 0.18, see
  `_recording_checkpointed_saves`) = the formula's chunk-input term, ceil(layers / 1) x 2h bf16
  bytes a token (x2 for float32), plus the rotary table [s, 1, 1, head_dim] float32 that every chunk
  saves and the formula leaves out (per token head_dim x 4 bytes once, next to layers x h x 2|4).
  The formula's other term, one recomputed layer live in its backward (`full_layer`, counted for
  flash attention) is not compared: the CPU path's attention (parallel/cp_attention.py) keeps the
  s x s scores and probabilities, which flash attention does not, so that term is not meaningful
  here.

Distributed-optimizer padding (megatron/core/distributed/param_and_grad_buffer.py): every
parameter starts at a multiple of 64 elements and every bucket ends at a multiple of
lcm(dp, 128); the tied embedding gets a bucket of its own. So a buffer has at most
63 x params + (lcm(dp, 128) - 1) x buckets elements of padding, which the bound below uses.
Run with `pytest -s` to see the measured and estimated numbers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import pytest
import torch

from tests.dist import hide_gpus, run_distributed

pytestmark = [
    pytest.mark.distributed,
]

SHAPE = dict(vocab_size=100, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=48, max_position_embeddings=64,
             recompute=dict(granularity="full", method="uniform", num_layers=1))
MODELS = {
    "bias": dict(SHAPE, add_qkv_bias=True),                                            # Qwen2-like, untied
    "qknorm_tied": dict(SHAPE, qk_layernorm=True, kv_channels=16, tie_embeddings=True),  # Qwen3-like, tied
}
SEED, SCENARIO, MICRO_BATCH = 7, "byp_ppo_sts", 2  # bypass: no old-log-prob pass before the step


def _case(name, tp, pp, model, divisor, *, dist_opt=True, bf16=False):
    return dict(name=name, tp=tp, pp=pp, model=model, divisor=divisor, dist_opt=dist_opt, bf16=bf16)


WORLD2 = [
    _case("tp2 bias", 2, 1, "bias", 8),
    _case("tp2 qknorm tied", 2, 1, "qknorm_tied", 8),
    _case("pp2 bias", 1, 2, "bias", 8),
    _case("pp2 qknorm tied", 1, 2, "qknorm_tied", 8),
    _case("dp2 bias dist-opt fp32", 1, 1, "bias", 1),
    _case("dp2 tied plain-adam fp32", 1, 1, "qknorm_tied", 1, dist_opt=False),
    _case("dp2 tied dist-opt bf16", 1, 1, "qknorm_tied", 1, bf16=True),
    _case("dp2 bias plain-adam bf16", 1, 1, "bias", 1, dist_opt=False, bf16=True),
]
WORLD4 = [
    _case("tp2pp2 bias", 2, 2, "bias", 8),
    _case("tp2pp2 qknorm tied plain-adam", 2, 2, "qknorm_tied", 8, dist_opt=False),
]


def _model_cfg(case):
    from megatron_rlcorr.model.config import ModelConfig

    return ModelConfig(**MODELS[case["model"]], make_vocab_size_divisible_by=case["divisor"], bf16=case["bf16"])


def _optim(case):
    from megatron_rlcorr.training.optimizer import OptimSettings
    from tests.distributed.test_step_parallel import OPTIM

    return OptimSettings(**OPTIM, use_distributed_optimizer=case["dist_opt"])


# ---- the worker: build, step, measure ------------------------------------------------------------

class _ListHandler(logging.Handler):
    """The warnings Megatron-Core's DDP logs (log_single_rank: rank 0 of the world only)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _recording_checkpointed_saves(calls):
    """While active, every full-recompute forward of a TransformerBlock appends to `calls` the bytes
    of every distinct tensor autograd saves in it. The function moved in megatron-core 0.18: a
    method, `TransformerBlock._checkpointed_forward`, before; `megatron.core.recompute.
    checkpointed_forward(block, ...)`, which transformer_block imports by name, since."""
    from megatron.core.transformer import transformer_block

    if hasattr(transformer_block.TransformerBlock, "_checkpointed_forward"):
        owner, name = transformer_block.TransformerBlock, "_checkpointed_forward"
    else:
        owner, name = transformer_block, "checkpointed_forward"
    original = getattr(owner, name)

    def wrapped(block, *args, **kwargs):
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        saved = {}

        def pack(t):
            saved[(t.data_ptr(), tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = original(block, *args, **kwargs)
        calls.append(dict(seq=hidden_states.shape[0], tokens=hidden_states.shape[0] * hidden_states.shape[1],
                          hidden_dtype_bytes=hidden_states.element_size(), saved_bytes=sum(saved.values()),
                          saved=[(shape, str(dtype)) for _, shape, dtype in saved]))
        return result

    setattr(owner, name, wrapped)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _measure(case, groups, batch):
    from megatron_rlcorr.training.optimizer import build_model_and_optimizer
    from megatron_rlcorr.training.step import StepBatch, train_minibatch
    from tests.distributed.test_step_parallel import BATCH, _step_config

    ddp_log = _ListHandler()
    ddp_logger = logging.getLogger("megatron.core.distributed")
    ddp_logger.addHandler(ddp_log)
    try:
        chunks, optimizer, _ = build_model_and_optimizer(_model_cfg(case), _optim(case), groups, seed=SEED,
                                                         total_steps=1)
    finally:
        ddp_logger.removeHandler(ddp_log)
    params = [p for chunk in chunks for p in chunk.parameters()]
    buffers = [b for chunk in chunks for b in [*chunk.buffers, *chunk.expert_parallel_buffers]]
    record = dict(
        case=case["name"], ddp_warnings=ddp_log.messages, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank,
        dp_cp=groups.dp_cp_size,
        num_params=len(params),
        params=sum(p.numel() for p in params),
        weight_bytes=sum(p.numel() * p.element_size() for p in params),
        vocab_rows={n.split(".")[-2]: p.shape[0] for chunk in chunks for n, p in chunk.named_parameters()
                    if n.endswith(("word_embeddings.weight", "output_layer.weight"))},
        main_grad_numel=sum(p.main_grad.numel() for p in params),
        main_grad_dtypes=sorted({str(p.main_grad.dtype) for p in params}),
        buffer_params=sum(len(b.params) for b in buffers),
        grad_buffer_elements=sum(b.grad_data.numel() for b in buffers),
        grad_buffer_bytes=sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
        # the distributed optimizer also moves the weights into a DDP buffer (same layout as the grads)
        param_buffer_elements=sum(b.param_data.numel() for b in buffers if b.param_data is not None),
        param_buffer_bytes=sum(b.param_data.numel() * b.param_data.element_size() for b in buffers
                               if b.param_data is not None),
        padding_bound=sum(63 * len(b.params) + (math.lcm(b.data_parallel_world_size, 128) - 1) * len(b.buckets)
                          for b in buffers) if case["dist_opt"] else 0,
    )
    calls = []
    rows = slice(groups.dp_rank * BATCH // groups.dp_size, (groups.dp_rank + 1) * BATCH // groups.dp_size)
    with _recording_checkpointed_saves(calls):
        result = train_minibatch(chunks, optimizer, StepBatch(**{k: v[rows] for k, v in batch.items()}),
                                 groups=groups, cfg=_step_config(SCENARIO, MICRO_BATCH), old_log_probs=None)
    record["update_successful"] = result.update_successful
    record["activation_calls"] = calls

    # Adam's state after the step; a main parameter that does not live in a model parameter's or
    # DDP buffer's storage is a float32 master copy (bf16 model); fp32 main params are views.
    model_storages = {p.untyped_storage().data_ptr() for p in params}
    model_storages |= {b.param_data.untyped_storage().data_ptr() for b in buffers if b.param_data is not None}
    moments = masters = main_elements = without_state = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state.get(p, {})
                without_state += "exp_avg" not in state
                moments += sum(state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq")
                               if k in state)
                main_elements += p.numel()
                if p.untyped_storage().data_ptr() not in model_storages:
                    masters += p.numel() * p.element_size()
    record.update(moment_bytes=moments, master_bytes=masters, main_elements=main_elements,
                  main_params_without_state=without_state)
    return record


def _worker(rank, world, cases, batch):
    hide_gpus()
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron
    from megatron_rlcorr.parallel.groups import build_parallel_groups, destroy_parallel_groups

    enable_cpu_megatron()
    records = []
    for case in cases:
        groups = build_parallel_groups(case["tp"], case["pp"], 1)
        try:
            records.append(_measure(case, groups, batch))
        finally:
            destroy_parallel_groups()
    return records


@pytest.fixture(scope="module")
def measured():
    """Every case's per-rank record: world 2 and world 4 launches (one process launch each)."""
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.model.weights import init_full_weights
    from tests.distributed.test_step_parallel import CFG, _make_batch

    cfg = ModelConfig(**CFG)  # the step tests' data (vocab 100, like the models here)
    batch = _make_batch(init_full_weights(cfg, SEED), cfg, SCENARIO)
    records = []
    for cases, world in ((WORLD2, 2), (WORLD4, 4)):
        per_rank = run_distributed(_worker, world, cases, batch)
        for index, case in enumerate(cases):
            records.append((case, [rank_records[index] for rank_records in per_rank]))
    return records


# ---- the comparisons ----------------------------------------------------------------------------

def _estimates(case, rank):
    from megatron_rlcorr.parallel.layout import ParallelSettings
    from megatron_rlcorr.recipe.memory import parameter_counts, state_bytes_per_parameter

    model_cfg = _model_cfg(case)
    counts = parameter_counts(model_cfg, ParallelSettings(tp=case["tp"], pp=case["pp"]))
    weight, grad, optimizer = state_bytes_per_parameter(model_cfg, _optim(case), rank["dp_cp"])
    full_optimizer = state_bytes_per_parameter(model_cfg, dataclasses.replace(_optim(case),
                                                                              use_distributed_optimizer=False), 1)[2]
    params = counts.per_stage[rank["pp_rank"]]
    return dict(counts=counts, params=params, weight_bytes=weight * params, grad_bytes=grad * params,
                optimizer_bytes=optimizer * params, optimizer_bytes_per_param=optimizer,
                full_optimizer_bytes_per_param=full_optimizer)


def _where(case, rank):
    return f"{case['name']} (pp {rank['pp_rank']}, tp {rank['tp_rank']}, dp {rank['dp_rank']})"


def test_parameters_per_rank_equal_the_formula(measured):
    print("\nparameters per rank: measured (numel of the rank's chunks) vs parameter_counts().per_stage")
    for case, ranks in measured:
        for rank in ranks:
            est = _estimates(case, rank)
            print(f"  {_where(case, rank):48s} {rank['params']:7d} vs {est['params']:7d}   weight bytes "
                  f"{rank['weight_bytes']:7d} vs {est['weight_bytes']:7d}")
            assert rank["params"] == est["params"], _where(case, rank)
            assert rank["weight_bytes"] == est["weight_bytes"], _where(case, rank)
            if case["dist_opt"]:  # the weights' DDP buffer: padded like the gradients' (test below)
                weight_bytes_per_param = est["weight_bytes"] // est["params"]
                assert rank["param_buffer_elements"] == rank["grad_buffer_elements"], _where(case, rank)
                assert rank["param_buffer_bytes"] == weight_bytes_per_param * rank["param_buffer_elements"]
            else:
                assert rank["param_buffer_elements"] == 0  # the parameters keep their own storage
            # the embedding and the output layer (a tied one's copy too) have padded_vocab / tp rows
            assert all(rows * case["tp"] == est["counts"].padded_vocab_size for rows in rank["vocab_rows"].values())
    by_name = {case["name"]: ranks for case, ranks in measured}
    # A tied embedding: once at pp1; at pp2 the last stage holds a copy as its output layer.
    assert [r["vocab_rows"] for r in by_name["tp2 qknorm tied"]] == [{"word_embeddings": 56}] * 2  # 112 / tp 2
    assert [r["vocab_rows"] for r in by_name["pp2 qknorm tied"]] == [{"word_embeddings": 104},  # 100 padded to 8
                                                                     {"output_layer": 104}]
    assert [r["vocab_rows"] for r in by_name["pp2 bias"]] == [{"word_embeddings": 104}, {"output_layer": 104}]
    assert [r["vocab_rows"] for r in by_name["dp2 bias dist-opt fp32"]] == [{"word_embeddings": 100,
                                                                             "output_layer": 100}] * 2


def _hf_parameter_count(model_cfg) -> int:
    import transformers

    from megatron_rlcorr.model.hf_config import config_for

    config = config_for(model_cfg.decoder_shape, model_cfg.max_position_embeddings, torch.float32)
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())  # a tied head once


def test_total_is_the_unpadded_single_copy_model(measured):
    """dp2 with make_vocab_size_divisible_by 1: each rank holds the whole unpadded model."""
    from megatron_rlcorr.parallel.layout import ParallelSettings
    from megatron_rlcorr.recipe.memory import parameter_counts

    print("\nparameter total: parameter_counts().total vs a whole unpadded Megatron model vs transformers")
    seen = set()
    for case, ranks in measured:
        if case["tp"] * case["pp"] != 1:
            continue
        model_cfg = _model_cfg(case)
        counts = parameter_counts(model_cfg, ParallelSettings())
        assert counts.padded_vocab_size == model_cfg.vocab_size == 100
        for rank in ranks:
            assert rank["params"] == counts.total, _where(case, rank)
        if case["model"] not in seen:
            seen.add(case["model"])
            hf = _hf_parameter_count(model_cfg)
            print(f"  {case['model']:12s} total {counts.total} vs Megatron {ranks[0]['params']} vs transformers {hf}"
                  f" (DecoderShape.parameter_count {model_cfg.decoder_shape.parameter_count})")
            assert counts.total == hf == model_cfg.decoder_shape.parameter_count
    assert seen == set(MODELS)
    # The padded layouts' totals are still the unpadded count.
    for case, _ in measured:
        counts = parameter_counts(_model_cfg(case), ParallelSettings(tp=case["tp"], pp=case["pp"]))
        assert counts.total == parameter_counts(_model_cfg(case), ParallelSettings()).total


def test_ddp_is_given_the_distributed_optimizers_layout(measured):
    """megatron-core 0.19's DDP warns and computes the distributed optimizer's parameter layout
    itself when the caller does not pass `full_param_layout`; training/optimizer.py passes it
    (0.16 has no such argument and logs nothing either). The buffers it gives are the ones the
    gradient and optimizer tests measure."""
    logged = [message for _, ranks in measured for rank in ranks for message in rank["ddp_warnings"]]
    assert not [m for m in logged if "full_param_layout" in m], logged
    assert any(case["dist_opt"] and ranks[0]["dp_cp"] == 2 for case, ranks in measured)  # rank 0 built one


def test_gradient_buffers_equal_params_times_grad_bytes(measured):
    from megatron_rlcorr.recipe.memory import GRAD_BYTES

    assert GRAD_BYTES == 4
    print("\ngradients per rank: DDP main-grad buffer bytes vs params x GRAD_BYTES (padding = distributed "
          "optimizer alignment, bound 63/param + lcm(dp,128)-1 per bucket)")
    padded_somewhere = False
    for case, ranks in measured:
        for rank in ranks:
            est = _estimates(case, rank)
            padding = rank["grad_buffer_elements"] - rank["params"]
            print(f"  {_where(case, rank):48s} {rank['grad_buffer_bytes']:7d} vs {est['grad_bytes']:7d}"
                  f"   padding {padding} elements (bound {rank['padding_bound']})")
            assert rank["main_grad_dtypes"] == ["torch.float32"], _where(case, rank)
            assert rank["main_grad_numel"] == rank["params"] == est["params"]  # every parameter has its main_grad
            assert rank["buffer_params"] == rank["num_params"]  # every parameter lives in a DDP buffer
            assert rank["grad_buffer_bytes"] == GRAD_BYTES * rank["grad_buffer_elements"]
            if case["dist_opt"]:
                # Distributed optimizer: the buffer is padded for aligned, even shards; the formula
                # counts the parameters, so it is below the buffer by at most the padding.
                assert 0 <= padding <= rank["padding_bound"], _where(case, rank)
                assert rank["grad_buffer_elements"] % rank["dp_cp"] == 0
                padded_somewhere |= padding > 0
            else:
                assert rank["grad_buffer_bytes"] == est["grad_bytes"], _where(case, rank)
    assert padded_somewhere  # the bound was exercised, not just equality


def test_optimizer_state_after_a_step_equals_the_formula(measured):
    print("\noptimizer per rank after one step: Adam exp_avg + exp_avg_sq (+ fp32 master copies) vs "
          "state_bytes_per_parameter()[2] x params")
    for case, ranks in measured:
        shard_sums: dict[tuple[int, int], float] = {}
        for rank in ranks:
            est = _estimates(case, rank)
            held = rank["moment_bytes"] + rank["master_bytes"]
            print(f"  {_where(case, rank):48s} {held:7d} vs {est['optimizer_bytes']:9.1f}   (moments "
                  f"{rank['moment_bytes']}, masters {rank['master_bytes']}, "
                  f"{est['optimizer_bytes_per_param']:g} B/param)")
            assert rank["update_successful"], _where(case, rank)
            assert rank["main_params_without_state"] == 0, _where(case, rank)
            # moments: 2 x float32 per main element; masters only for a bf16 model
            assert rank["moment_bytes"] == 8 * rank["main_elements"]
            assert rank["master_bytes"] == (4 * rank["main_elements"] if case["bf16"] else 0), _where(case, rank)
            if case["dist_opt"]:
                # This DP rank's shard of the padded buffer: within the padding of params / dp.
                shard = held / est["full_optimizer_bytes_per_param"]
                padding = rank["grad_buffer_elements"] - rank["params"]
                assert abs(shard - rank["params"] / rank["dp_cp"]) <= padding, _where(case, rank)
                assert abs(held - est["optimizer_bytes"]) <= padding * est["full_optimizer_bytes_per_param"]
                key = (rank["pp_rank"], rank["tp_rank"])
                shard_sums[key] = shard_sums.get(key, 0) + held
            else:
                assert held == est["optimizer_bytes"], _where(case, rank)
        for (pp_rank, tp_rank), total in shard_sums.items():
            # The DP ranks' shards together: exactly the undivided formula (padding holds no state).
            rank = next(r for r in ranks if (r["pp_rank"], r["tp_rank"]) == (pp_rank, tp_rank))
            est = _estimates(case, rank)
            assert total == est["full_optimizer_bytes_per_param"] * est["params"], case["name"]
    dp2_dist = [r for case, ranks in measured if case["name"].startswith("dp2") and case["dist_opt"] for r in ranks]
    assert dp2_dist and all(r["dp_cp"] == 2 for r in dp2_dist)  # the sharded case was measured


def test_recomputed_activations_forward_saves_the_chunk_inputs(measured):
    """Full recomputation (uniform, 1 layer a chunk): what the forward keeps per micro-batch is the
    formula's chunk-input term (module docstring for the rotary table and the backward term)."""
    from megatron_rlcorr.parallel.layout import ParallelSettings
    from megatron_rlcorr.recipe.memory import activation_bytes_per_token
    from tests.distributed.test_step_parallel import BATCH

    print("\nactivations per micro-batch, full recompute: saved in the forward vs formula chunk-input term "
          "(x2 for float32) + rotary table")
    for case, ranks in measured:
        model_cfg = _model_cfg(case)
        parallel = ParallelSettings(tp=case["tp"], pp=case["pp"])
        layers = model_cfg.num_layers // case["pp"]
        full_layer = activation_bytes_per_token(dataclasses.replace(model_cfg, recompute=None), parallel, 1)
        chunk_inputs = activation_bytes_per_token(model_cfg, parallel, layers) - model_cfg.recompute.num_layers * full_layer
        assert chunk_inputs == math.ceil(layers / model_cfg.recompute.num_layers) * 2 * model_cfg.hidden_size
        scale = 2 if model_cfg.params_dtype == "float32" else 1  # the formula counts bf16 values
        for rank in ranks:
            calls = rank["activation_calls"]
            assert len(calls) == BATCH // rank["dp_cp"] // MICRO_BATCH, _where(case, rank)  # one per micro-batch
            for call in calls:
                rotary = call["seq"] * model_cfg.head_dim * 4  # [s, 1, 1, head_dim] float32, shared by the chunks
                estimate = call["tokens"] * chunk_inputs * scale
                assert call["hidden_dtype_bytes"] == 2 * scale  # the chunk input is in params_dtype
                assert call["saved_bytes"] == estimate + rotary, (_where(case, rank), call)
            call = calls[0]
            print(f"  {_where(case, rank):48s} {call['saved_bytes']:6d} vs {call['tokens'] * chunk_inputs * scale:6.0f}"
                  f" + rotary {call['seq'] * model_cfg.head_dim * 4}   ({call['tokens']} tokens, {layers} layers; "
                  f"saved {call['saved']})")
