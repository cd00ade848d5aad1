"""Count the kernels a call launches, from a CPU profile: the op count behind eager GPU time.

On a GPU an eager call of a small-tensor computation is bound by kernel launches (a few
microseconds of host dispatch each), so the number of kernels is its cost. It is counted from
torch.profiler on the CPU, where every ATen op appears as an event nested in the op that called
it. The rule:

- an event counts when it is an ATen op (`aten::*`) that does work itself: not a view or
  metadata op (`VIEWS`: aten::view, as_strided, expand, slice, select, unsqueeze, squeeze,
  reshape, t, transpose, permute, detach, alias, unbind, split, ...), not an allocation
  (`ALLOCATIONS`: aten::empty, empty_like, empty_strided, new_empty, resize_; these launch no
  kernel, unlike zeros/ones/full, whose fill_ counts), and not a cast that may be a no-op
  (`CASTS`: aten::to, _to_copy, type_as, contiguous; a cast that copies shows a copy_ inside);
- and none of its ATen descendants counts: the leaves of the op tree once views, allocations and
  no-op casts are removed. (A composite such as aten::where(cond, x, 0.0) counts its inner ops:
  here the scalar's tensor, aten::scalar_tensor, and the where itself.)

The count is taken on the second of two calls (`warmup`): constants a library builds once per
device are then cached, as they are for a trainer. CPU-only ops that a GPU would not launch (a
Python number wrapped into a CPU scalar and copied) are counted as the CPU shows them.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from torch.profiler import ProfilerActivity, profile

VIEWS = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "expand", "expand_as", "slice", "select",
    "unsqueeze", "squeeze", "t", "numpy_T", "transpose", "permute", "detach", "detach_", "alias", "unbind",
    "split", "split_with_sizes", "chunk", "narrow", "view_as", "unflatten", "flatten", "lift_fresh",
    "resolve_conj", "resolve_neg", "result_type", "_conj", "diagonal", "movedim"))
ALLOCATIONS = frozenset(f"aten::{name}" for name in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_"))
CASTS = frozenset(f"aten::{name}" for name in ("to", "_to_copy", "type_as", "contiguous"))
NO_WORK = VIEWS | ALLOCATIONS | CASTS


def counted_ops(events) -> list[str]:
    """The names of the counted events of a profile's events (rule in the module docstring)."""
    counted: list[str] = []

    def visit(event) -> bool:  # True if the event or a descendant counts
        below = [visit(child) for child in event.cpu_children]
        if any(below):
            return True
        if event.name.startswith("aten::") and event.name not in NO_WORK:
            counted.append(event.name)
            return True
        return False

    for event in events:
        if event.cpu_parent is None:
            visit(event)
    return counted


def count_ops(fn: Callable[[], object], warmup: int = 1) -> Counter:
    """Counter of the kernels `fn()` launches (op name -> count), by the rule above."""
    for _ in range(warmup):
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(counted_ops(prof.events()))
