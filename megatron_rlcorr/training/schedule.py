"""Megatron-Core's pipeline schedule over a LocalBatch's micro-batches (run_schedule), and the
log-probs (and entropy) of a micro-batch's targets from its vocabulary-parallel logits
(token_log_probs).

The schedule runs forward (and backward unless forward_only) over the micro-batches, p2p over the
PP group; packed micro-batches go in as THD with PackedSeqParams. `loss_fn(mb, logits)` sees the
last stage's logits of micro-batch `mb`; with routing replay each forward routes the engine's
recorded experts (routing_replay.forward_context).
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from .local_batch import LocalBatch
from .logprobs import token_logprobs_and_entropy
from .routing_replay import forward_context

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups


def run_schedule(model_chunks: list[Any], local: LocalBatch, loss_fn, *, groups: ParallelGroups,
                 forward_only: bool, routing=None) -> None:
    """Megatron-Core's forward(/backward) schedule; `loss_fn(mb, logits)` -> (loss, {}); `routing`: the
    pass's routing replay (routing_replay.ReplayPass; None for a dense model or nothing to do)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    plan = local.plan

    def forward_step(micro_batch_ids, model):
        mb = next(micro_batch_ids)
        micro = plan.micro_batches[mb]
        tokens, positions = local.tokens[mb], micro.positions
        if plan.is_packed:  # Megatron's THD micro-batch is one row of packed tokens
            tokens, positions = tokens[None], positions[None]
        with forward_context(routing, model, mb):
            output = model(tokens, positions, None, packed_seq_params=micro.packed_seq_params)
        return output, partial(loss_fn, mb)

    num_microbatches = plan.num_microbatches
    if groups.vpp_size and num_microbatches < groups.pp_size:
        raise ValueError(f"virtual pipelining (vpp={groups.vpp_size}) needs at least pp={groups.pp_size} micro-batches "
                         f"per DP rank, got {num_microbatches}: lower micro_batch_size={plan.micro_batch_size}")
    config = model_chunks[0].config
    iterators = [iter(range(num_microbatches)) for _ in model_chunks]
    forward_backward = get_forward_backward_func(pp_size=groups.pp_size, vp_size=groups.vpp_size)
    forward_backward(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=model_chunks,
        num_microbatches=num_microbatches,
        seq_length=plan.seq_length,
        micro_batch_size=plan.micro_batch_size,
        forward_only=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=config),
        pg_collection=groups.pg_collection,
    )


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, groups: ParallelGroups, temperature: float, *,
                    entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of a micro-batch's targets, shaped like the targets."""
    log_prob, ent = token_logprobs_and_entropy(logits, targets.view(logits.shape[:-1]), tp_group=groups.tp,
                                               temperature=temperature, compute_entropy=entropy)
    return log_prob.view(targets.shape), None if ent is None else ent.view(targets.shape)
