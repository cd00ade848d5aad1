"""The correction compiled for one configuration: the families' declarations turned into the
token phase, the row chain and the metric chain, with their constants.

Built once per configuration (and its constants once per device), so that a call only launches
the programs' ops: no constant is built from Python numbers during the call.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..config import RolloutCorrectionConfig
from .builder import Builder
from .metrics import MetricProgram
from .offpolicy import declare as declare_offpolicy
from .rejection import REJECTED, declare_rejection, declare_veto
from .rows import RowProgram
from .tokens import TokenPhase
from .weights import FACTOR, INVERSE, ImportanceWeights


@dataclass
class Plan:
    tokens: TokenPhase
    rows: RowProgram
    metrics: MetricProgram
    weights: ImportanceWeights | None
    rejects: bool       # some rule or the veto can reject tokens
    token_rules: bool   # the kept-token slot holds the token rules' decisions
    sequence_rejects: bool  # the `rej` row exists

    def prepare(self, device: torch.device, mask_dtype: torch.dtype | None = None) -> None:
        self.tokens.prepare(device, mask_dtype)
        self.rows.prepare(device)
        self.metrics.prepare(device)
        if self.weights is not None:
            self.weights.prepare(device)

    def factor_index(self) -> int | None:
        return self.metrics.index(FACTOR) if self.weights is not None and self.weights.batch_normalize else None

    def inverse_index(self) -> int | None:
        if self.weights is None or not self.weights.batch_normalize or self.weights.level == "token":
            return None
        return self.metrics.index(INVERSE)


@lru_cache(maxsize=64)
def plan_for(config: RolloutCorrectionConfig) -> Plan:
    rules = config.rejection_rules
    token_rules = any(not r.is_sequence_level for r in rules)
    b = Builder(token_rules)
    declare_offpolicy(b)
    veto = declare_veto(config.rollout_token_veto_threshold, b)
    weights = ImportanceWeights.declare(config, b) if config.rollout_is is not None else None
    if rules:
        declare_rejection(config, b)
    tags = tuple(t for t, present in (("rs", any(r.is_sequence_level for r in rules)), ("veto", veto)) if present)
    if tags:
        b.rows.any_of(REJECTED, tags)
    tokens = TokenPhase(b.tok)
    b.rows.compile(tokens.stat_names)
    b.program.compile(b.rows)
    return Plan(tokens, b.rows, b.program, weights, bool(rules) or veto, token_rules, bool(tags))
