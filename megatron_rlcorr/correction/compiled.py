"""The correction under `torch.compile`: an option (`algorithm.correction_compile: torch`); the
eager call (`core.compute_rollout_correction`) is the default and the reference.

Why: on a GPU an eager call is bound by kernel launches, not memory (docs/correction.md, "Speed"):
a few dozen small kernels, each a few microseconds of host dispatch. Inductor can fuse the token
phase's elementwise slot writes and the row and metric chains' elementwise ops into a few
generated kernels around the matmuls and the segment reductions. Whether that beats the eager
path on a given GPU is measured (`tools/bench_correction.py --compile`), not assumed.

What is compiled: `core.run_plan`, the same function the eager call runs, on inputs already
checked by the eager code (`core.checked_plan`, which also makes the one host sync of
`check_inputs=True`). Only the local tensor math is compiled: each all-reduce over `cp_group` /
`dp_group` runs eagerly through torch.distributed (excluded from tracing: `_compiled`), so
Dynamo splits the call into the pieces between the collectives, and the collectives, their order
and their payloads are those of the eager call. Without a live group (None, or a group of one
rank) the call is one graph.

Cost: the first call of each variant compiles: Dynamo traces the plan's code, Inductor generates
and compiles kernels (Triton on a GPU; C++ with the system compiler on a CPU, about a minute of
CPU time per variant on the 2-core development machine; not measured on a GPU yet). A variant is
one configuration x layout (padded or packed) x mask dtype x device x grad mode x which groups are
live. Other batch sizes and sequence lengths reuse it (Dynamo specialises sizes 0 and 1, which
make variants of their own). All variants are compiled versions of one function, so Dynamo's
recompile limit (`torch._dynamo.config.recompile_limit`, 8 by default) bounds them; past it Dynamo
warns and runs the eager code, the reference. A training run makes a few: one per call
site of its mode (training/step.py), one more where a batch dimension is 1.

Dynamic shapes: only the data's dimensions are dynamic (marked on views of the inputs each call,
`_dynamic`), with automatic dynamic off, so the plan's numbers (slot offsets, thresholds) and its
constant matrices stay static, also when another configuration's plan is compiled next.
`torch.compile(dynamic=True)` would make them symbolic too (a threshold formatted into a slot name
broke the graph), and the kernels would not be specialised to the configuration.

Results: the same ops on the same values, but Inductor may reorder the float64 sums inside a
fused kernel, so the outputs equal the eager call's within a tolerance, not bit for bit: the
masks exactly, the weights and metrics within `RTOL` relative (float32), as
tests/unit/test_correction_compiled.py (CPU) and tests/gpu/test_correction_cuda.py (GPU) check
on token IS, sequence IS and DAPO's settings, padded and packed.

Host syncs: none with `check_inputs=False` (Dynamo's guards read tensor metadata only).
Memory: the token phase takes the whole batch in one block, as the eager call does on a GPU (the
eager CPU path blocks rows, `core.CPU_BLOCK_TOKENS`); the buffers are Inductor's.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Literal

import torch
import torch.distributed as dist

from ..config import RolloutCorrectionConfig
from ..settings import check_choice
from .core import CorrectionResult, _all_reduce, as_result, checked_plan, compute_rollout_correction, run_plan

CompileMode = Literal["eager", "torch"]
COMPILE_MODES: tuple[str, ...] = ("eager", "torch")
DEFAULT_BACKEND = "inductor"
RTOL = 1e-5  # compiled vs eager, weights and metrics (float32); masks are equal


def correction_function(mode: str) -> Callable[..., CorrectionResult]:
    """The correction call of a compile mode: "eager", the reference, or "torch" (compiled)."""
    check_choice("correction_compile", mode, COMPILE_MODES)
    return compute_rollout_correction if mode == "eager" else compute_rollout_correction_compiled


def compute_rollout_correction_compiled(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    cu_seqlens: torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    dp_group: dist.ProcessGroup | None = None,
    check_inputs: bool = True,
    *,
    backend: str = DEFAULT_BACKEND,
) -> CorrectionResult:
    """`compute_rollout_correction` (same arguments, same contract) with its tensor math compiled
    by `torch.compile(backend=backend)`; equal to the eager call within `RTOL`."""
    plan = checked_plan(old_log_prob, rollout_log_prob, response_mask, config, cu_seqlens, check_inputs)
    run, collective = _compiled(backend)
    old, rollout, mask, cu = (None if t is None else _dynamic(t) for t in (old_log_prob, rollout_log_prob,
                                                                         response_mask, cu_seqlens))
    weights, keep, metrics = run(plan, old, rollout, mask, cu, _live(cp_group), _live(dp_group), collective, True)
    return as_result(response_mask, weights, keep, metrics)


@lru_cache(maxsize=None)
def _compiled(backend: str) -> tuple[Callable, Callable]:
    """(`run_plan` compiled for `backend`, the collective it calls), built on first use: importing
    Dynamo takes seconds, which an eager run never pays."""
    eager_all_reduce = torch.compiler.disable(_all_reduce)  # a graph break: runs through torch.distributed

    def collective(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
        if group is not None:  # traced: no call, no graph break, without a live group
            eager_all_reduce(tensor, op, group)

    # Only the data's dimensions are dynamic (`_dynamic`); the plan's numbers and constants stay
    # static, also when another configuration's plan is compiled (no automatic dynamic).
    compiled = torch.compile(run_plan, backend=backend, fullgraph=False)
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False)(compiled), collective


def _dynamic(tensor: torch.Tensor) -> torch.Tensor:
    """A view of `tensor` whose every dimension Dynamo treats as dynamic (the caller's tensor is
    left unmarked)."""
    view = tensor.view(tensor.shape)
    torch._dynamo.maybe_mark_dynamic(view, list(range(view.dim())))
    return view


def _live(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """None for a group that needs no collective (None, or one rank), decided outside the graph."""
    return None if group is None or dist.get_world_size(group) == 1 else group
