"""The distributed harness itself (tests/dist_pool.py): a case that leaks state fails its own
check, a crash or a hang fails the running case and the pool is replaced, Megatron-Core's parallel
state and groups do not outlive a case, and the parent's environment reaches the workers.

Each test uses a pool of its own (not the session's), so the failures it provokes cost no other
test its pool; a short collective timeout keeps the hang test short."""
import datetime
import os

import pytest

from tests.dist_pool import Pool, WorkerFailure

pytestmark = pytest.mark.distributed

TIMEOUT = datetime.timedelta(seconds=5)


@pytest.fixture
def pool2():
    pools = []

    def make():
        pools.append(Pool(2, TIMEOUT))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close(kill=True)


def _build_groups_and_leave_them(rank, world, tp):
    import torch.distributed as dist

    from megatron_rlcorr.parallel.groups import build_parallel_groups

    groups = build_parallel_groups(tp, 1, 1)  # never destroyed: a process exit used to do it
    return dict(tp=groups.tp_size, dp=groups.dp_size, groups=len(dist.distributed_c10d._world.pg_map))


def _count_groups(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state

    return dict(groups=len(dist.distributed_c10d._world.pg_map),
                initialized=parallel_state.model_parallel_is_initialized())


def _leak_env(rank, world):
    os.environ["RLCORR_HARNESS_LEAK"] = "1"


def _leak_patch(rank, world):
    from megatron_rlcorr.training import losses

    losses.aggregate_loss = lambda *a, **k: None


def _raise_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("the case's own error")
    return rank


def _exit_on_rank1(rank, world):
    if rank == 1:
        os._exit(3)
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits for the dead rank


def _hang_on_rank0(rank, world):
    import torch
    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return rank


def _native_threads(rank, world):
    from tests.dist_pool import native_threads

    return native_threads()


def _build_ddp_model(rank, world):
    """A tiny GPT model wrapped in Megatron-Core's DDP with its optimizer, over tp=2, left to the
    tear-down: the model's backward hooks hold it in a cycle through C++ autograd nodes."""
    from megatron_rlcorr.model.config import ModelConfig
    from megatron_rlcorr.parallel.groups import build_parallel_groups
    from megatron_rlcorr.training.optimizer import OptimSettings, build_model_and_optimizer

    groups = build_parallel_groups(2, 1, 1)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64)
    build_model_and_optimizer(cfg, OptimSettings(), groups, seed=1, total_steps=1)
    return _native_threads(rank, world)


_KEPT = []  # groups that a case keeps alive past the tear-down


def _keep_groups_alive(rank, world, count):
    import torch.distributed as dist

    _KEPT.extend(dist.new_group([0, 1]) for _ in range(count))


def _retire_rank0(rank, world):
    from tests.dist_pool import retire_after_case

    if rank == 0:
        retire_after_case("a setting no tear-down undoes")
    return os.getpid()


def _read_env(rank, world, key):
    return os.environ.get(key)


def _destroy_default_group(rank, world):
    import torch.distributed as dist

    dist.destroy_process_group()
    return rank


def test_parallel_state_and_groups_do_not_outlive_a_case(pool2):
    pool = pool2()
    before = pool.run(_count_groups, (), "count")
    assert before == [dict(groups=1, initialized=False)] * 2
    first = pool.run(_build_groups_and_leave_them, (2,), "tp2")
    assert [r["tp"] for r in first] == [2, 2] and all(r["groups"] > 1 for r in first)
    second = pool.run(_build_groups_and_leave_them, (1,), "dp2")  # a second build: no "already exist"
    assert [(r["tp"], r["dp"]) for r in second] == [(1, 2)] * 2
    assert pool.run(_count_groups, (), "count") == before


def test_a_destroyed_default_group_is_made_again(pool2):
    pool = pool2()
    assert pool.run(_destroy_default_group, (), "destroy") == [0, 1]
    assert pool.run(_count_groups, (), "count") == [dict(groups=1, initialized=False)] * 2


@pytest.mark.parametrize("case, expected", [(_leak_env, "env: RLCORR_HARNESS_LEAK: '<unset>' -> '1'"),
                                            (_leak_patch, "module megatron_rlcorr.training.losses: aggregate_loss")])
def test_a_case_that_leaks_state_fails_its_own_check(pool2, case, expected):
    pool = pool2()
    with pytest.raises(WorkerFailure, match="left state behind") as failure:
        pool.run(case, (), "leaky")
    assert expected in str(failure.value)


def test_an_exception_is_reraised_with_its_rank_and_traceback(pool2):
    with pytest.raises(WorkerFailure, match="rank 1 failed") as failure:
        pool2().run(_raise_on_rank1, (), "raises")
    assert "ValueError: the case's own error" in str(failure.value)


def test_a_dead_worker_names_the_test_and_a_new_pool_works(pool2):
    with pytest.raises(WorkerFailure, match=r"rank 1 of 2 died \(exit code 3\) while running the dying test"):
        pool2().run(_exit_on_rank1, (), "the dying test")
    assert pool2().run(_count_groups, (), "after") == [dict(groups=1, initialized=False)] * 2


def test_a_hang_fails_within_the_collective_timeout(pool2):
    import time

    pool = pool2()  # started before the clock: a pool's start-up is not the hang's timeout
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="rank 0 failed"):
        pool.run(_hang_on_rank0, (), "hangs")
    assert time.monotonic() - start < TIMEOUT.total_seconds() + 30


def test_the_parents_environment_reaches_the_case_and_only_it(pool2, monkeypatch):
    pool = pool2()
    monkeypatch.setenv("RLCORR_HARNESS_PARENT", "set by the test")
    assert pool.run(_read_env, ("RLCORR_HARNESS_PARENT",), "env") == ["set by the test"] * 2
    monkeypatch.delenv("RLCORR_HARNESS_PARENT")
    assert pool.run(_read_env, ("RLCORR_HARNESS_PARENT",), "env") == [None, None]


def test_a_ddp_models_groups_and_threads_do_not_outlive_the_case(pool2):
    """Megatron-Core's DDP hooks hold the model in a cycle Python's collector cannot see; the tear-down
    breaks it, so the model's gloo groups and their threads end with the case: the threads left after
    one model (the first one leaves a few for good, once) are those left after two."""
    pool = pool2()
    during = pool.run(_build_ddp_model, (), "ddp")
    after_one = pool.run(_native_threads, (), "after one")
    pool.run(_build_ddp_model, (), "ddp again")
    after_two = pool.run(_native_threads, (), "after two")
    assert after_two == after_one, (after_one, after_two)
    assert all(d > a + 20 for d, a in zip(during, after_one))  # the model's groups had their threads
    assert not pool.worn and pool.alive()


def test_a_worker_worn_by_kept_threads_is_replaced_not_failed(pool2):
    """State the tear-down cannot free (here gloo groups a module keeps) makes the workers ask to be
    replaced once past the spare threads; the case itself passes, the next gets new processes."""
    from tests.dist_pool import _SPARE_THREADS

    pool = pool2()
    pool.run(_keep_groups_alive, (_SPARE_THREADS // 3 + 2,), "keeps groups")  # 3 threads a gloo group
    assert len(pool.worn) == 2 and all("threads" in why for why in pool.worn), pool.worn
    assert not pool.alive()


def test_a_case_may_retire_its_workers(pool2):
    """`retire_after_case`: the case passes, the rank that asked exits after its reply, and the pool
    is not reused (the next case of its world size gets new processes)."""
    pool = pool2()
    pids = pool.run(_retire_rank0, (), "retires")
    assert pool.worn == ["rank 0: a setting no tear-down undoes"]
    assert not pool.alive()
    assert pool2().run(_retire_rank0, (), "new processes")[0] not in pids


def test_workers_are_forked_from_the_preloaded_template(pool2):
    """A new pool costs a fork, not an import of torch and Megatron-Core per process
    (tests/pool_template.py): its workers found the package imported when they started."""
    pool = pool2()
    assert pool.preloaded
    assert pool.run(_count_groups, (), "count") == [dict(groups=1, initialized=False)] * 2  # the default group only
