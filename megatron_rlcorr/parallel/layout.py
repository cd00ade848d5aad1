"""The recipe's `parallel:` section: tensor, pipeline, context, virtual pipeline and expert sizes.

Pure Python (no Megatron-Core import): the entry points validate a layout against the launch
before any process group exists, and build the groups from it (groups.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelSettings:
    """The recipe's `parallel:` section: how Megatron-Core splits the model over the ranks.

    The data-parallel size is derived, world size / (tp * pp * cp); docs/parallel.md describes
    each dimension.
    """

    tp: int = 1                      # tensor-parallel size: attention heads and MLP split over tp ranks; >= 1
    pp: int = 1                      # pipeline stages (1F1B); num_layers divisible by pp * vpp; >= 1
    cp: int = 1                      # context-parallel size: each sequence in 2*cp zigzag chunks over cp ranks; >= 1
    vpp: int | None = None           # virtual pipeline stages per rank (interleaved 1F1B); needs pp > 1; None: off
    sequence_parallel: bool = False  # activations outside attention/MLP split over TP; needs tp > 1 (MoE with tp > 1: required)
    # Expert parallelism (MoE models, model.moe): each MoE layer's experts split over ep ranks, each expert's
    # weights over etp ranks (expert tensor parallelism). The ranks of one pipeline stage (tp * cp * dp) are
    # regrouped as etp x ep x expert-data-parallel, so tp * cp * dp must be divisible by ep * etp.
    ep: int = 1                      # expert-parallel size; divides model.moe.num_experts; >= 1
    etp: int = 1                     # expert tensor-parallel size; divides model.moe.ffn_hidden_size; >= 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vpp is not None and (self.vpp < 1 or self.pp == 1):
            raise ValueError(f"vpp (virtual pipeline stages) needs pp > 1 and vpp >= 1, got pp={self.pp}, vpp={self.vpp}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def layout(self, world_size: int) -> dict[str, int | None]:
        """What a per-rank checkpoint depends on: which rank holds which shard."""
        layout = {"world_size": world_size, "tp": self.tp, "pp": self.pp, "cp": self.cp, "vpp": self.vpp}
        # Only with expert parallelism: a dense layout reads as it did before ep/etp existed.
        return layout if (self.ep, self.etp) == (1, 1) else {**layout, "ep": self.ep, "etp": self.etp}

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise ValueError(f"parallel: world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*"
                             f"{self.cp} = {self.model_parallel_size}; launch a multiple of {self.model_parallel_size} "
                             f"processes or change parallel.tp/pp/cp")
        return world_size // self.model_parallel_size
