"""Run a function on N processes on this machine and collect what each rank returns.

Used by every distributed test: `run_distributed(fn, world_size, *args)` returns the list of
per-rank results (rank order). A gloo call runs in the session's pool of `world_size` processes
(tests/dist_pool.py: started once per world size, forked from a template process that imported
torch and Megatron-Core, state checked clean after every case);
`fresh=True` spawns new processes for one call (a test whose libraries keep process-wide state, or
that sets variables read only at process start), and so does a call made while the test has changed
the session's sys.path (a stand-in package put first: new processes start with the caller's
sys.path; entries appended after it do not count: importing Megatron-Core 0.19 appends setuptools'
vendored packages, which kept the whole 0.19.2 CI subset out of the pool), a "nccl" call (one GPU
each), and every call when RLCORR_TEST_POOL=0 (the harness as it was before the pool,
to tell a pool problem from a test's).
Collectives get a short timeout so a hang fails the test instead of stalling CI; an exception on
any rank is re-raised here with its traceback.
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist_pool import Pool, free_port

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


_pools: dict[int, "Pool"] = {}
# A test that changed sys.path (monkeypatch.syspath_prepend of a stand-in package) gets new processes,
# which start with its sys.path, as they did before the pool; the pool's processes keep the session's,
# recorded once collection is over (tests/conftest.py) or at the first call outside pytest.
_session_sys_path: list[str] | None = None


def record_session_sys_path() -> None:
    global _session_sys_path
    _session_sys_path = list(sys.path)


def _worker(rank, world_size, port, fn, args, out_dir, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if backend == "gloo":  # the CPU path, also on a GPU machine (before anything initialises CUDA)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", fresh: bool = False):
    """Run fn(rank, world_size, *args) on `world_size` processes; return their results.

    backend "gloo": CPU processes, the session's pool or (RLCORR_TEST_POOL=0) new ones (module docstring;
    the CPU-path tests hide the GPUs themselves); "nccl": one GPU per process, which needs
    `world_size` GPUs (see `nccl_or_skip`). `fresh`: new processes for this call even in pool mode."""
    if _session_sys_path is None:
        record_session_sys_path()
    if backend == "gloo" and not fresh and os.environ.get("RLCORR_TEST_POOL", "1") != "0" \
            and sys.path[:len(_session_sys_path)] == _session_sys_path:
        return _run_in_pool(fn, world_size, args)
    return _run_fresh(fn, world_size, args, backend)


def _run_in_pool(fn, world_size: int, args):
    pool = _pools.pop(world_size, None)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
            if not pool.worn:
                pool_stats["replaced"].append(f"{world_size} processes: a worker died between cases")
        pool = Pool(world_size, COLLECTIVE_TIMEOUT)
        pool_stats["started"] += 1
    name = os.environ.get("PYTEST_CURRENT_TEST", fn.__qualname__)
    try:
        results = pool.run(fn, args, name)
    except BaseException:  # a failure, a leak, a dead worker, pytest's timeout: the next case gets new processes
        pool.close(kill=True)
        raise
    if pool.worn:
        pool_stats["replaced"].append(f"{world_size} processes, worn by {name}: {'; '.join(pool.worn)}")
    _pools[world_size] = pool
    return results


# What the session's pools did, for pytest's summary (tests/conftest.py): pools started, and why
# the worn ones (tests/dist_pool.py `_worn`) were replaced.
pool_stats: dict = {"started": 0, "replaced": []}


def close_pools() -> None:
    """Stop every pool (the end of the pytest session)."""
    while _pools:
        _pools.popitem()[1].close()


def _run_fresh(fn, world_size: int, args, backend: str):
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, out_dir, backend),
                           nprocs=world_size, join=True, start_method="spawn")
        results = []
        for rank in range(world_size):
            rec = torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
            if not rec["ok"]:
                raise AssertionError(f"rank {rank} failed:\n{rec['error']}")
            results.append(rec["result"])
        return results


def hide_gpus() -> None:
    """For workers that test the CPU path: on a GPU machine hide the GPUs before anything
    initialises CUDA in the freshly spawned process (call it first; importing megatron.core
    initialises CUDA)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    assert not torch.cuda.is_available(), "CUDA was initialised before the GPUs could be hidden"


def nccl_or_skip(world_size: int) -> str:
    """"nccl" when this machine has `world_size` GPUs; otherwise the test is skipped (its CPU
    counterpart runs the same layout on gloo)."""
    import pytest

    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs for NCCL, found {torch.cuda.device_count()}")
    return "nccl"
