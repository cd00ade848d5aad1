"""Sampling one token per row from a decode step's logits, as vLLM's sampler does: temperature,
then top-k, then top-p on what top-k left (renormalised), and the log-prob reported for the token.

Log-probs (base.py's convention): "tempered" reports log_softmax(logits / T) of the sampled token,
"processed" its log-prob under the distribution actually sampled from (after top-k / top-p).
Temperature 0 is greedy. One row per sequence, log-probs in float32.
"""
from __future__ import annotations

import torch

from .base import LogprobsMode


def sample_tokens(logits_BV: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  generator: torch.Generator | None, mode: LogprobsMode) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled token ids and their float32 log-probs (see base.py for the convention): top-k on the
    tempered distribution, then top-p on what top-k left, renormalised (vLLM's order)."""
    if temperature == 0:  # greedy: top-k and top-p change nothing (argmax is always kept)
        token_B = logits_BV.argmax(dim=-1)
        return token_B, torch.log_softmax(logits_BV, dim=-1).gather(-1, token_B[:, None]).squeeze(-1)
    logp_BV = torch.log_softmax(logits_BV / temperature, dim=-1)
    sample_logp_BV = logp_BV
    if 0 < top_k < logp_BV.shape[-1]:  # renormalised: the nucleus is measured in the top-k distribution
        sample_logp_BV = torch.log_softmax(_top_k(logp_BV, top_k), dim=-1)
    if top_p < 1:
        sample_logp_BV = _nucleus(sample_logp_BV, top_p)
    token_B = torch.multinomial(sample_logp_BV.exp(), 1, generator=generator).squeeze(-1)  # it normalises
    reported = torch.log_softmax(sample_logp_BV, dim=-1) if mode == "processed" else logp_BV
    return token_B, reported.gather(-1, token_B[:, None]).squeeze(-1)


def _top_k(logp_BV: torch.Tensor, k: int) -> torch.Tensor:
    """logp with -inf outside the k most likely tokens: exactly k, a tie at the k-th value going to
    the lower token ids (vLLM's batched kernel's rule; top_k = 1 is then argmax). No sort: the k-th
    value, then a running count of the tokens equal to it."""
    kth_B1 = logp_BV.topk(k, dim=-1).values[:, -1:]
    above_BV, tied_BV = logp_BV > kth_B1, logp_BV == kth_B1
    room_B1 = k - above_BV.sum(dim=-1, keepdim=True)
    keep_BV = above_BV | (tied_BV & (tied_BV.cumsum(dim=-1) <= room_B1))
    return logp_BV.masked_fill(~keep_BV, float("-inf"))


def _nucleus(logp_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """logp (normalised) with -inf outside the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_logp, order = logp_BV.sort(dim=-1, descending=True)
    probs = sorted_logp.exp()
    mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always has 0 before it
    drop = torch.zeros_like(logp_BV, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
    return logp_BV.masked_fill(drop, float("-inf"))
