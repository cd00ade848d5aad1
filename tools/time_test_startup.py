"""How much of a distributed test is process start-up: a no-op `run_distributed` at 2, 4 and 8
processes, spawned fresh (as every distributed test did before tests/dist_pool.py) and in the
session's pool, side by side in one run.

    python tools/time_test_startup.py [--repeat 3] [--worlds 2 4 8]

Columns (seconds, median of --repeat): `fresh` spawns the processes and builds the gloo group
around a no-op; `fresh+mcore` also imports Megatron-Core and installs the CPU patches (what a
test that builds a model pays before its first line of work); `pool first` starts the pool (the
same imports, once per world size per session); `pool case` is each later no-op case in it,
tear-down and leak check included. Run from the repository root in the test environment
(`source tools/_env.sh && ensure_env`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import dist  # noqa: E402


def noop(rank, world_size):
    return rank


def noop_with_megatron(rank, world_size):
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron

    enable_cpu_megatron()
    return rank


def _time(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main(argv=None) -> int:
    os.environ["RLCORR_TEST_POOL"] = "1"  # the pool columns (fresh=True forces the others)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args(argv)
    print("| processes | fresh | fresh+mcore | pool first | pool case |")
    print("|---|---|---|---|---|")
    for world in args.worlds:
        fresh = [_time(dist.run_distributed, noop, world, fresh=True) for _ in range(args.repeat)]
        mcore = [_time(dist.run_distributed, noop_with_megatron, world, fresh=True) for _ in range(args.repeat)]
        first = _time(dist.run_distributed, noop, world)
        cases = [_time(dist.run_distributed, noop, world) for _ in range(args.repeat)]
        print(f"| {world} | {statistics.median(fresh):.2f} | {statistics.median(mcore):.2f} | {first:.2f} | "
              f"{statistics.median(cases):.3f} |", flush=True)
    dist.close_pools()
    return 0


if __name__ == "__main__":
    sys.exit(main())
