"""The embedded engine's batches: prompts left-padded into one token matrix (left_pad), and the
sampled tokens, log-probs and recorded routing back into a RolloutBatch (to_batch, attach_routing).

Conventions: prompts are right-aligned in a [B, L] matrix (rollout/embedded.py gives positions from
0 at each prompt's first token); a response ends at its first EOS or at max_new_tokens, and its
rows of the sampled matrices beyond that are dropped. The routing layout is embedded.py's
("Recorded routing"). The results are on the CPU.
"""
from __future__ import annotations

import torch

from .base import FinishReason, RolloutBatch


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] token matrix with each sequence right-aligned, and the pad count of every row."""
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        tokens[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
    pads = torch.tensor([width - len(s) for s in seqs], dtype=torch.long)
    return tokens.to(device), pads.to(device)


def attach_routing(batch: RolloutBatch, prefill_BWLK: torch.Tensor, decode_routing: list[torch.Tensor],
                   pads_B: torch.Tensor) -> None:
    """Fill the batch's routed_experts and prompt_routed_experts (embedded.py's docstring) from the
    prefill's routing [B, width, L, k] (left-padded) and each decode step's [B, L, k]."""
    # Row j of a response: the prefill's last column for j = 0, then decode step j - 1.
    response_BSLK = torch.cat([prefill_BWLK[:, -1:], *[r[:, None] for r in decode_routing]], dim=1).cpu()
    prefill_BWLK, width = prefill_BWLK.cpu(), prefill_BWLK.shape[1]
    pads = pads_B.tolist()
    batch.routed_experts = [response_BSLK[i, :len(r)].clone() for i, r in enumerate(batch.response_ids)]
    batch.prompt_routed_experts = [prefill_BWLK[i, pads[i]: width - 1].clone() for i in range(len(pads))]


def to_batch(prompts: list[list[int]], tokens_BN: torch.Tensor, logprobs_BN: torch.Tensor, lengths_B: torch.Tensor,
             finished_B: torch.Tensor) -> RolloutBatch:
    """Each row's first lengths_B[i] tokens and log-probs; finished rows ended with EOS, the others at the limit."""
    tokens, lengths, finished = tokens_BN.tolist(), lengths_B.tolist(), finished_B.tolist()
    logprobs_BN = logprobs_BN.float().cpu()
    reasons: list[FinishReason] = ["eos" if f else "length" for f in finished]
    return RolloutBatch(prompt_ids=[list(p) for p in prompts],
                        response_ids=[row[:n] for row, n in zip(tokens, lengths)],
                        logprobs=[logprobs_BN[i, :n].clone() for i, n in enumerate(lengths)],
                        finish_reasons=reasons)
