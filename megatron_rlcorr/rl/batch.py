"""The training batch of one data-parallel replica: built from its share of the step's rollouts
(every rank of the replica builds the same one) and sliced into mini-batches.

Layout (right padding with PAD = 0): row i holds prompt_i + response_i; position t predicts
tokens[t + 1] (`targets_BT`), so the response occupies positions [len(prompt) - 1, len(seq) - 2].
Rollout log-probs that are non-finite or positive (a rollout engine's bug or overflow) are taken
out of the response mask before anything else sees them (docs/api.md); their count is
returned so the trainer can report `rollout_corr/invalid_rollout_token_fraction`.

Multi-turn samples (RolloutGroups.response_masks) keep the tokens inserted between turns in the
sequence (the model reads them) but out of the response mask: no rollout log-prob, IS weight,
rejection, advantage or gradient, and they are not counted as invalid. Every downstream consumer
(the correction, the loss, the metrics) reads only the mask, so it sees exactly the model's tokens.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .sampling import RolloutGroups
from ..training.step import StepBatch

_FIELDS = tuple(f.name for f in dataclasses.fields(StepBatch))


def build_step_batch(groups: RolloutGroups, advantages_B: torch.Tensor, *,
                     pad_multiple: int = 1) -> tuple[StepBatch, torch.Tensor]:
    """(StepBatch, number of response tokens masked as invalid) for the rollout groups.

    advantages_B: one advantage per sequence (flat g * n + j order), spread over its response
    tokens. The width T is the longest sequence rounded up to `pad_multiple`. Filler groups
    (dynamic sampling's) get an empty response mask: no advantage, and no place in any
    normaliser, mean or metric downstream; their invalid tokens are not counted either.
    """
    tokens_BT, targets_BT, response_BT, rollout_lp_BT = padded_sequences(
        groups.prompt_ids(), groups.response_ids, groups.logprobs, pad_multiple=pad_multiple,
        response_masks=groups.response_masks)
    filler_B = groups.filler_G.repeat_interleave(groups.n)
    response_BT &= ~filler_B[:, None]
    invalid_BT = response_BT & (~torch.isfinite(rollout_lp_BT) | (rollout_lp_BT > 0))
    mask_BT = response_BT & ~invalid_BT
    batch = StepBatch(
        tokens_BT=tokens_BT,
        targets_BT=targets_BT,
        response_mask_BT=mask_BT.float(),
        rollout_log_probs_BT=torch.where(mask_BT, rollout_lp_BT, torch.zeros_like(rollout_lp_BT)),
        advantages_BT=advantages_B.float()[:, None] * mask_BT.float(),
        routed_experts_BTLK=routed_experts(groups, tokens_BT.shape[1]),
    )
    return batch, invalid_BT.sum()


def routed_experts(groups: RolloutGroups, width: int) -> torch.Tensor | None:
    """int16 [B, width, MoE layers, k]: the experts the engine routed each input position to, -1
    where it recorded none (padding, prompt positions without `prompt_routed_experts`, the last
    token of each sequence, a sample without routing); None when no sample has any.

    Row j of a sample's `routed_experts` is the forward at input position len(prompt) - 1 + j (whose
    output gives response token j, the log-prob at that position); `prompt_routed_experts` covers
    positions 0 .. len(prompt) - 2."""
    response, prompt = groups.routed_experts, groups.prompt_routed_experts
    present = [x for x in (*(response or ()), *(prompt or ())) if x is not None]
    if not present:
        return None
    layers_k = tuple(present[0].shape[1:])
    out = torch.full((len(groups.response_ids), width, *layers_k), -1, dtype=torch.int16)
    for i, (ids, answer) in enumerate(zip(groups.prompt_ids(), groups.response_ids)):
        parts = (("prompt_routed_experts", None if prompt is None else prompt[i], 0, len(ids) - 1),
                 ("routed_experts", None if response is None else response[i], len(ids) - 1, len(answer)))
        for name, rows, start, count in parts:
            if rows is None:
                continue
            if tuple(rows.shape) != (count, *layers_k):
                raise ValueError(f"sample {i}: {name} has shape {tuple(rows.shape)}, expected "
                                 f"{(count, *layers_k)} (one row per input position: len(prompt) - 1 rows for "
                                 "the prompt, len(response) for the response); the rollout engine reported them")
            out[i, start:start + count] = rows.to(torch.int16)
    return out

def padded_sequences(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                     logprobs: Sequence[torch.Tensor | Sequence[float]] | None = None, *, pad_multiple: int = 1,
                     response_masks: Sequence[Sequence[int] | None] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens_BT, targets_BT, response_BT bool, log-probs_BT float32) of prompt + response rows,
    right-padded with PAD = 0 to the longest row rounded up to `pad_multiple` (module docstring);
    `logprobs` gives one value per response token (zeros when None); `response_masks` (per row, None:
    all ones) takes a multi-turn row's inserted tokens out of response_BT."""
    num_seqs = len(prompt_ids)
    longest = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
    width = -(-longest // pad_multiple) * pad_multiple
    tokens_BT = torch.zeros(num_seqs, width, dtype=torch.int64)
    logprobs_BT = torch.zeros(num_seqs, width, dtype=torch.float32)
    response_BT = torch.zeros(num_seqs, width, dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        if not prompt:
            raise ValueError(f"sequence {i} has an empty prompt; prompts need at least one token (BOS)")
        start, length = len(prompt) - 1, len(response)
        tokens_BT[i, : len(prompt) + length] = torch.tensor(list(prompt) + list(response), dtype=torch.int64)
        if logprobs is not None:
            logprobs_BT[i, start:start + length] = torch.as_tensor(logprobs[i], dtype=torch.float32)
        mask = None if response_masks is None else response_masks[i]
        if mask is None:
            response_BT[i, start:start + length] = True
        else:
            assert len(mask) == length, f"sequence {i}: a response mask of {len(mask)} for {length} response tokens"
            response_BT[i, start:start + length] = torch.tensor(list(mask), dtype=torch.bool)
    targets_BT = torch.zeros_like(tokens_BT)
    targets_BT[:, :-1] = tokens_BT[:, 1:]
    return tokens_BT, targets_BT, response_BT, logprobs_BT


def slice_batch(batch: StepBatch, start: int, end: int) -> StepBatch:
    """Rows [start, end) of every field (an absent optional field stays None)."""
    return StepBatch(**{name: _apply(getattr(batch, name), lambda t: t[start:end]) for name in _FIELDS})


def batch_to(batch: StepBatch, device: torch.device | str) -> StepBatch:
    """Every field on `device`."""
    return StepBatch(**{name: _apply(getattr(batch, name), lambda t: t.to(device)) for name in _FIELDS})


def _apply(tensor: torch.Tensor | None, fn):
    return None if tensor is None else fn(tensor)
