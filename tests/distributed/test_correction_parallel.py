"""compute_rollout_correction sharded over CP x DP (gloo) == one process on the whole batch.

The parallel contract (docs/api.md, "Parallel layouts"): each rank's weights and mask equal the
matching slice of the single-process result (weights rtol 1e-5, masks identical); metrics are
identical on every rank and equal the single-process metrics within rtol 1e-4. Only all_reduce on the CP and DP groups is used (never
WORLD), and its payload does not change when a rank holds 200 more (masked) tokens.

Layouts (cp, dp): (2, 1), (1, 2) on 2 ranks; (2, 2) on 4; (4, 2), (2, 4) on 8. Rank =
dp_rank * cp + cp_rank; every rank builds every group in the same order. DP shards rows
(unevenly: 11 sequences). CP shards each sequence by Megatron's zigzag (2*cp chunks, rank r
holds r and 2cp-1-r) or by an arbitrary random assignment of its tokens (ranks may hold none of
a sequence), in the padded [B, T] and the packed (cu_seqlens, trailing padding) layouts.
One run per world size, on the test pool's processes (tests/dist.py), runs every configuration and
returns all outputs; the compiled call's comparison runs there too (`_compiling_in_the_pool`).
"""
from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction
from tests.dist import run_distributed
from tests.reference import clean_batch, compare_metrics, cu_seqlens_of, padded_to_packed, parse_config

pytestmark = pytest.mark.distributed

ROWS, WIDTH, CP_MULTIPLE = 11, 48, 8   # WIDTH and packed spans divisible by 2 * max cp
CONFIGS = {
    "dapo": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                 rollout_rs="geometric", rollout_rs_threshold=1.01, rollout_rs_threshold_lower=0.99,
                 rollout_token_veto_threshold=1e-4),
    "token_is_token_rs": dict(rollout_is="token", rollout_is_threshold=1.1, rollout_is_batch_normalize=True,
                              rollout_rs="token", rollout_rs_threshold=1.12, rollout_token_veto_threshold=1e-4),
    "divergence": dict(rollout_is="token", rollout_rs="seq_max_k3,token_k1,seq_sum_k1,seq_mean_k2",
                       rollout_rs_threshold="0.01,0.9_1.1,0.8_1.3,0.004"),
    "seq_is_clip_seq_rs": dict(rollout_is="sequence", rollout_is_threshold=1.2, rollout_is_threshold_lower=0.9,
                               rollout_is_batch_normalize=True, rollout_rs="sequence", rollout_rs_threshold=1.3,
                               rollout_rs_threshold_lower=0.85),
}
VARIANTS = ("padded-zigzag", "padded-random", "packed-zigzag", "packed-random")
LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(2, 2)], 8: [(4, 2), (2, 4)]}


# ---- the whole batch ---------------------------------------------------------------------------

def _global_batch(name: str, variant: str):
    """(old, rollout, mask, cu_seqlens or None) of the whole batch: padded [B, T] or packed."""
    kwargs = CONFIGS[name]
    mask_dtype = torch.bool if variant == "packed-random" else torch.float32
    batch, _ = clean_batch(list(CONFIGS).index(name), kwargs, batch=ROWS, max_len=WIDTH, scale=0.05,
                           catastrophic=0.006, mask_dtype=mask_dtype)
    if variant.startswith("padded"):
        return batch.old, batch.rollout, batch.mask, None
    spans = [CP_MULTIPLE * math.ceil(n / CP_MULTIPLE) for n in batch.lengths]
    packed = [padded_to_packed(x, spans) for x in (batch.old, batch.rollout, batch.mask)]
    return (*packed, cu_seqlens_of(spans))


def _owners(n_tokens: int, cp: int, zigzag: bool, gen: torch.Generator) -> torch.Tensor:
    """CP rank holding each of a sequence's n_tokens positions."""
    if zigzag:
        chunk_owner = [k if k < cp else 2 * cp - 1 - k for k in range(2 * cp)]
        return torch.tensor(chunk_owner).repeat_interleave(n_tokens // (2 * cp))
    weights = torch.rand(cp, generator=gen) ** 3 + 0.01   # uneven; some ranks get little or nothing
    if n_tokens == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.multinomial(weights, n_tokens, replacement=True, generator=gen)


def _dp_rows(n_rows: int, dp: int, d: int) -> range:
    return range(d * n_rows // dp, (d + 1) * n_rows // dp)


def _shard(old, rollout, mask, cu, cp: int, dp: int, zigzag: bool, seed: int):
    """Per-rank inputs and, for each local position, its global flat index (-1: local padding)."""
    gen = torch.Generator().manual_seed(seed)
    packed = cu is not None
    bounds = cu.tolist() if packed else None
    n_seq = len(bounds) - 1 if packed else old.shape[0]
    flat = [x.flatten() for x in (old, rollout, mask)]
    # positions[i][c]: global flat indices of sequence i's tokens held by CP rank c
    positions = []
    for i in range(n_seq):
        span = torch.arange(bounds[i], bounds[i + 1]) if packed else i * old.shape[1] + torch.arange(old.shape[1])
        owner = _owners(span.numel(), cp, zigzag, gen)
        positions.append([span[owner == c] for c in range(cp)])
    shards = []
    for rank in range(cp * dp):
        c, d = rank % cp, rank // cp
        rows = _dp_rows(n_seq, dp, d)
        if packed:
            idx = torch.cat([positions[i][c] for i in rows] + [torch.full((rank + 1,), -1)])  # + trailing
            local_cu = cu_seqlens_of([positions[i][c].numel() for i in rows], cu.dtype)
        else:
            width = max((positions[i][c].numel() for i in rows), default=0)
            idx = torch.full((len(rows), width), -1)
            for j, i in enumerate(rows):
                idx[j, : positions[i][c].numel()] = positions[i][c]
            local_cu = None
        take = idx.clamp(min=0)
        pad = idx < 0
        local = [torch.where(pad, fill, x[take]).to(x.dtype) for x, fill in
                 zip(flat, (torch.tensor(float("nan")), torch.tensor(float("inf")), torch.tensor(0.0)))]
        shards.append(dict(old=local[0], rollout=local[1], mask=local[2], cu_seqlens=local_cu, index=idx))
    return shards


def _jobs(world_size: int):
    """Every (layout, config, variant) case for one run, with its shards and its baseline."""
    jobs = []
    for cp, dp in LAYOUTS[world_size]:
        for name in CONFIGS:
            for variant in VARIANTS:
                old, rollout, mask, cu = _global_batch(name, variant)
                shards = _shard(old, rollout, mask, cu, cp, dp, "zigzag" in variant,
                                seed=1000 * cp + 100 * dp + VARIANTS.index(variant))
                jobs.append(dict(layout=(cp, dp), name=name, variant=variant, shards=shards,
                                 whole=(old, rollout, mask, cu)))
    return jobs


# ---- the ranks ----------------------------------------------------------------------------------

def _groups(rank: int, cp: int, dp: int):
    """This rank's (cp_group, dp_group); every rank creates every group in the same order."""
    cp_groups = [dist.new_group([d * cp + c for c in range(cp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * cp + c for d in range(dp)]) for c in range(cp)]
    cp_group = cp_groups[rank // cp] if cp > 1 else None   # cp == 1: exercise the None path
    return cp_group, dp_groups[rank % cp]


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "all_to_all", "all_to_all_single",
               "reduce", "gather", "scatter", "barrier", "send", "recv", "isend", "irecv")


class _CollectiveLog:
    """Replaces torch.distributed's collectives with recording wrappers while active."""

    def __init__(self):
        self.calls = []
        self._saved = {}

    def _wrap(self, name, original):
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            if group is None and name == "all_reduce" and len(args) >= 3:
                group = args[2]
            tensor = args[0] if args and torch.is_tensor(args[0]) else kwargs.get("tensor")
            op = kwargs.get("op", args[1] if name == "all_reduce" and len(args) >= 2 else None)
            world = group is None or group is dist.group.WORLD
            ranks = None if world else tuple(dist.get_process_group_ranks(group))
            payload = None if tensor is None else (tensor.numel(), str(tensor.dtype))
            self.calls.append((name, ranks, str(op), payload))
            return original(*args, **kwargs)
        return wrapper

    def __enter__(self):
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _widen(shard, extra: int):
    """The same shard with `extra` more masked garbage tokens (padded: columns; packed: trailing)."""
    def pad(x, fill):
        shape = (*x.shape[:-1], extra)
        return torch.cat([x, torch.full(shape, fill).to(x.dtype)], dim=-1)
    return dict(shard, old=pad(shard["old"], float("nan")), rollout=pad(shard["rollout"], 1e4),
                mask=pad(shard["mask"], 0.0))


def _correct(shard, name, cp_group, dp_group):
    with _CollectiveLog() as log:
        out = compute_rollout_correction(shard["old"], shard["rollout"], shard["mask"],
                                         RolloutCorrectionConfig(**CONFIGS[name]),
                                         cu_seqlens=shard["cu_seqlens"], cp_group=cp_group, dp_group=dp_group)
    return out, log.calls


def _rank_worker(rank: int, world_size: int, jobs):
    groups = {layout: _groups(rank, *layout) for layout in LAYOUTS[world_size]}
    results = []
    for job in jobs:
        shard = job["shards"][rank]
        cp_group, dp_group = groups[job["layout"]]
        out, calls = _correct(shard, job["name"], cp_group, dp_group)
        # the traffic must not depend on how many tokens a rank holds: O(sequences), not O(tokens)
        _, calls_wide = _correct(_widen(shard, 200), job["name"], cp_group, dp_group)
        results.append(dict(weights=out.is_weights, mask=out.response_mask, calls=calls, calls_wide=calls_wide,
                            metrics={k: v.clone() for k, v in out.metrics.items()}))
    return results


# ---- the comparison -------------------------------------------------------------------------------

def _check(job, per_rank) -> list[str]:
    old, rollout, mask, cu = job["whole"]
    kwargs = CONFIGS[job["name"]]
    whole = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(**kwargs), cu_seqlens=cu)
    problems = []
    expected_metrics = {k: float(v) for k, v in whole.metrics.items()}
    for rank, (shard, got) in enumerate(zip(job["shards"], per_rank)):
        idx = shard["index"]
        valid = idx >= 0
        take = idx.clamp(min=0)
        expected_mask = torch.where(valid, whole.response_mask.flatten()[take], torch.zeros((), dtype=mask.dtype))
        if got["mask"].dtype != mask.dtype or not torch.equal(got["mask"], expected_mask.to(mask.dtype)):
            same_shape = got["mask"].shape == idx.shape
            bad = int((got["mask"].bool() != expected_mask.bool()).sum()) if same_shape else "shape"
            problems.append(f"rank {rank}: mask differs at {bad} positions")
        if whole.is_weights is None:
            if got["weights"] is not None:
                problems.append(f"rank {rank}: weights should be None")
        else:
            expected_w = torch.where(valid, whole.is_weights.flatten()[take], torch.zeros(()))
            try:
                torch.testing.assert_close(got["weights"], expected_w, rtol=1e-5, atol=0)
            except AssertionError as err:
                problems.append(f"rank {rank}: weights: {err}")
        if set(got["metrics"]) != set(expected_metrics):
            problems.append(f"rank {rank}: metric keys differ: {set(got['metrics']) ^ set(expected_metrics)}")
        for key, value in got["metrics"].items():
            if not torch.equal(value, per_rank[0]["metrics"][key]):
                problems.append(f"rank {rank}: {key} = {float(value)!r} but rank 0 has "
                                f"{float(per_rank[0]['metrics'][key])!r}")
        if rank == 0:
            problems += compare_metrics(got["metrics"], expected_metrics, parse_config(kwargs))
        problems += [f"rank {rank}: {p}" for p in _collective_problems(job["layout"], rank, got)]
    return [f"{job['layout']} {job['name']} {job['variant']}: {p}" for p in problems]


def _collective_problems(layout, rank: int, got) -> list[str]:
    """The parallel contract: all_reduce only, on the CP and DP groups (never WORLD), at most one SUM and one MAX
    per group, with a payload that does not grow with the number of tokens."""
    cp, dp = layout
    cp_ranks = tuple((rank // cp) * cp + c for c in range(cp))
    dp_ranks = tuple(d * cp + rank % cp for d in range(dp))
    problems = []
    if got["calls"] != got["calls_wide"]:
        problems.append(f"collectives change with the token count: {got['calls']} vs {got['calls_wide']}")
    per_group = {}
    for name, ranks, op, _ in got["calls"]:
        if name != "all_reduce":
            problems.append(f"{name} called (only all_reduce is expected)")
        if ranks is None:
            problems.append(f"{name} on the WORLD group")
        elif ranks not in (cp_ranks, dp_ranks):
            problems.append(f"{name} on group {ranks}, neither CP {cp_ranks} nor DP {dp_ranks}")
        per_group.setdefault(ranks, []).append(op)
    for ranks, ops in per_group.items():
        if len(ops) > 2 or len(set(ops)) != len(ops):
            problems.append(f"group {ranks}: all_reduces {ops} (expected at most one SUM and one MAX)")
    if cp > 1 and cp_ranks not in per_group:
        problems.append("no collective on the CP group was observed")
    if dp > 1 and dp_ranks not in per_group:
        problems.append("no collective on the DP group was observed")
    return problems


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_sharded_equals_single_process(world_size):
    jobs = _jobs(world_size)
    results = run_distributed(_rank_worker, world_size, jobs)
    problems = []
    for j, job in enumerate(jobs):
        problems += _check(job, [results[rank][j] for rank in range(world_size)])
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:40])


def test_shards_cover_every_token_once():
    """The sharding helper itself: every global position lands on exactly one rank per DP row set."""
    for variant in VARIANTS:
        old, rollout, mask, cu = _global_batch("dapo", variant)
        for cp, dp in [(2, 1), (4, 2), (2, 4)]:
            shards = _shard(old, rollout, mask, cu, cp, dp, "zigzag" in variant, seed=1)
            seen = torch.cat([s["index"].flatten() for s in shards])
            seen = seen[seen >= 0].sort().values
            assert torch.equal(seen, torch.arange(old.numel())), (variant, cp, dp)
            for rank, s in enumerate(shards):
                local = s["index"] >= 0
                torch.testing.assert_close(s["old"][local], old.flatten()[s["index"][local]],
                                           rtol=0, atol=0, equal_nan=True)
                if cu is not None:   # rank + 1 trailing padding tokens after cu_seqlens[-1]
                    assert int(s["cu_seqlens"][-1]) == s["old"].numel() - (rank + 1)


# ---- the compiled call (correction/compiled.py) with live groups ---------------------------------

COMPILED_JOBS = [((2, 1), "packed-random"), ((1, 2), "padded-zigzag")]  # CP live; DP live


@contextlib.contextmanager
def _compiling_in_the_pool():
    """Compile in a pool worker and leave nothing the pool's leak check watches (tests/dist_pool.py):
    - no tqdm monitor thread: torch.fx's Interpreter makes a (disabled) progress bar on each run, and
      tqdm starts its monitor thread with the first bar, disabled or not, to run until the process
      exits; `monitor_interval = 0` is tqdm's switch for it;
    - Dynamo's caches dropped (`torch._dynamo.reset()`), and with them the functions it installed in
      the traced modules (correction.core, .rows, .compiled): its compiled graphs and resume
      functions (`__compiled_fn_*`, `__resume_at_*`). Dynamo removes those when the code it
      generated is freed, but c10d's flight recorder (on for gloo) keeps the code of every frame that
      called a collective, here the generated code around each all-reduce, for its next 2000
      collectives; so Dynamo's own clean-up hooks are run here, once no cache entry can run that
      code. What stays is data Dynamo adds as in any process that compiles, which the check does not
      watch: module aliases (`__import_*`) and builtins dicts."""
    import torch._dynamo
    from torch._dynamo.utils import CleanupManager
    from torch.hub import tqdm  # what torch.fx uses: tqdm's, or torch's stand-in where tqdm is absent

    try:
        with mock.patch.object(tqdm, "monitor_interval", 0, create=True):
            yield
    finally:
        torch._dynamo.reset()
        hooks = [hook for entry in CleanupManager.instance.values.values() for hook in entry]
        CleanupManager.instance.clear()  # each hook runs once: not again when the recorder lets go
        for hook in hooks:
            hook()


def _compiled_worker(rank: int, world_size: int, jobs):
    """The compiled call (aot_eager: cheap on a CPU) against the eager one on this rank's shard:
    the collectives run between the compiled pieces, the same calls with the same payloads."""
    with _compiling_in_the_pool():
        return _compare_compiled(rank, jobs)


def _compare_compiled(rank: int, jobs) -> list[str]:
    from megatron_rlcorr.correction.compiled import RTOL, compute_rollout_correction_compiled
    from tests.unit.test_correction_compiled import TRACE_CONFIG

    groups = {layout: _groups(rank, *layout) for layout, _ in COMPILED_JOBS}
    problems = []
    for job in jobs:
        shard, (cp_group, dp_group) = job["shards"][rank], groups[job["layout"]]
        args = (shard["old"], shard["rollout"], shard["mask"], RolloutCorrectionConfig(**CONFIGS[job["name"]]))
        kwargs = dict(cu_seqlens=shard["cu_seqlens"], cp_group=cp_group, dp_group=dp_group)
        with _CollectiveLog() as eager_log:
            want = compute_rollout_correction(*args, **kwargs)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, **TRACE_CONFIG), _CollectiveLog() as log:
            got = compute_rollout_correction_compiled(*args, **kwargs, backend="aot_eager")
        where = f"{job['layout']} {job['variant']} rank {rank}"
        if log.calls != eager_log.calls:
            problems.append(f"{where}: collectives {log.calls}, eager {eager_log.calls}")
        if not torch.equal(got.response_mask, want.response_mask):
            problems.append(f"{where}: masks differ")
        try:
            torch.testing.assert_close(got.is_weights, want.is_weights, rtol=RTOL, atol=1e-7)
            for key, value in want.metrics.items():
                torch.testing.assert_close(got.metrics[key], value, rtol=RTOL, atol=1e-7, msg=key)
        except AssertionError as err:
            problems.append(f"{where}: {err}")
    return problems


def test_compiled_equals_eager_with_groups():
    """compute_rollout_correction_compiled with a live CP group, then a live DP group (DAPO's settings)."""
    jobs = [job for job in _jobs(2) if job["name"] == "dapo" and (job["layout"], job["variant"]) in COMPILED_JOBS]
    assert len(jobs) == len(COMPILED_JOBS)
    problems = sum(run_distributed(_compiled_worker, 2, jobs), [])
    assert not problems, "\n".join(problems)
