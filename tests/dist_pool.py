"""A pool of gloo worker processes per world size, kept for the whole pytest session.

Why: a distributed test's own work is often a fraction of a second, while spawning its processes
costs seconds each (Python, torch and Megatron-Core imported, the default process group built) on
the 2-core CI machine, and the suite has hundreds of such cases (docs/testing.md measures both).
So each world size gets `world_size` processes once, with torch and Megatron-Core imported, the
CPU patches installed (parallel/cpu.py: every gloo test runs Megatron-Core through them) and the
default gloo group created once, and every case runs its function in them. The processes are
forked from one template process per session that imported torch, Megatron-Core and the package
(tests/pool_template.py, multiprocessing's forkserver): a pool of 8 starts in about 2 s instead of
the 30-50 s of 8 spawned processes importing all of it, which makes replacing a pool cheap.

What a case may leave behind, and what it may not (checked after every case, on every rank):
- Torn down by the pool, as a process exit would: Megatron-Core's parallel state
  (`destroy_model_parallel`), every process group other than the pool's default one (gloo keeps
  sockets and threads per group; they would pile up over hundreds of cases), Megatron-Core's
  tensor-parallel RNG tracker and RouterReplay's class-wide instance list, and a default group the
  case destroyed (made again; `tests/distributed/test_groups.py` makes its own, as the entry points do).
- Anything else is a leak, and fails the case that left it (not the next one) with what changed:
  environment variables, the working directory, sys.path, torch's default dtype, grad mode,
  deterministic algorithms, thread count, the torch function-mode stack, Python threads left
  running, logging's root handlers and level, and functions or classes replaced in a loaded module of
  megatron_rlcorr, megatron.core or torch's top-level modules (a monkeypatch not undone). The pool
  with the leak is then discarded, so no later case runs on that state.
- The torch RNG is reseeded from the OS before each case, as a new process's is.
- The parent's environment as it is at the call (a test's `monkeypatch.setenv`) is applied in the
  workers for the case and undone after it, as spawned processes inherited it. Variables that a
  process reads only when it starts (malloc's `MALLOC_*`) need new processes: `fresh=True`, or the
  setting made in the case (mallopt) and the workers retired after it (`retire_after_case`).

Failures: an exception on any rank is re-raised in pytest with that rank's traceback; a hang fails
within the collective timeout (tests/dist.py COLLECTIVE_TIMEOUT) on the hung rank, or at pytest's
own timeout; a worker that dies (a crash, os._exit, a signal) is named with its exit code and the
test that was running. In each of these cases the whole pool is discarded and the next case of that
world size gets fresh processes. A worker whose native threads or resident memory grew past what a clean
tear-down leaves (`_worn`: state a case left that the tear-down does not know) exits after its reply:
the case passes, and the next one gets fresh processes; so does a worker whose case asked for it
(`retire_after_case`: process state the case changed on purpose and no tear-down can undo).

Wire format: the function (by reference: a module-level function of the test module), its
arguments and the results travel as torch.save bytes over a pipe, as they did through files
before the pool (tensors, dataclasses and tuples alike).
"""
from __future__ import annotations

import atexit
import collections
import gc
import io
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import traceback
import warnings
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

_PATCH_WATCHED_PREFIXES = ("megatron_rlcorr", "megatron.core")
_PATCH_WATCHED_MODULES = ("torch", "torch.cuda", "torch.distributed", "torch.nn.functional", "torch.random")
# Set by the pool in each worker: never taken from the parent.
_WORKER_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
_IGNORED_ENV = ("MASTER_PORT",)  # set per case (a case that makes its own default group uses it)
# Megatron-Core's TransformerConfig sets these for its attention-backend choice in every process that
# builds a model: restored after each case, as a new process would start without them.
_RESTORED_ENV_PREFIXES = ("NVTE_",)
_DDP_HOOK = "DistributedDataParallel._make_backward_post_hook"
# A worker is replaced past these (`_worn`): a few threads come and go (torch's, the store's), while a
# leaked group set holds about 50; the 2-core CI machine has 24 GiB for up to 8 workers.
_SPARE_THREADS = 32
_MAX_RSS_GIB = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


# ---- the worker side ------------------------------------------------------------------------------

def _init_default_group(rank: int, world_size: int, port: int, timeout) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timeout)


def _watched_modules() -> dict[str, object]:
    return {name: module for name, module in list(sys.modules.items())
            if module is not None and (name in _PATCH_WATCHED_MODULES or name.startswith(_PATCH_WATCHED_PREFIXES))}


def _module_callables(module) -> dict[str, int]:
    """id() of every function and class a module holds: a monkeypatch replaces one of them."""
    out = {}
    for name, value in list(vars(module).items()):
        if isinstance(value, type) or callable(value) and hasattr(value, "__code__"):
            out[name] = id(value)
    return out


def _class_methods(cls) -> dict[str, int]:
    return {name: id(value) for name, value in vars(cls).items() if callable(value) or isinstance(value, staticmethod)}


class _Fingerprint:
    """What a case must leave as it found it (module docstring), recorded once the pool is ready."""

    def __init__(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._record()

    def _record(self) -> None:
        self.env = dict(os.environ)
        self.callables = {name: _module_callables(m) for name, m in _watched_modules().items()}
        self.methods = self._watched_methods()
        self.state = self._state()

    def restore_env(self) -> None:
        """Megatron-Core's own variables (_RESTORED_ENV_PREFIXES) back as they were."""
        for key in [k for k in os.environ if k.startswith(_RESTORED_ENV_PREFIXES)]:
            if key not in self.env:
                del os.environ[key]
        for key, value in self.env.items():
            if key.startswith(_RESTORED_ENV_PREFIXES):
                os.environ[key] = value

    @staticmethod
    def _watched_methods() -> dict[str, dict[str, int]]:
        """Methods of the classes of watched modules (patched in place on a class, e.g. a Megatron-Core
        optimizer method), by qualified class name."""
        out = {}
        for name, module in _watched_modules().items():
            for attr, value in list(vars(module).items()):
                if isinstance(value, type) and value.__module__ == name:
                    out[f"{name}.{attr}"] = _class_methods(value)
        return out

    @staticmethod
    def _state() -> dict[str, object]:
        return dict(
            env={k: v for k, v in os.environ.items() if k not in _IGNORED_ENV},
            cwd=os.getcwd(),
            sys_path=list(sys.path),
            default_dtype=torch.get_default_dtype(),
            grad_enabled=torch.is_grad_enabled(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            num_threads=torch.get_num_threads(),
            function_modes=len(torch.overrides._get_current_function_mode_stack()),
            threads=sorted(t.name for t in threading.enumerate()),
            logging=(logging.root.level, [type(h).__name__ for h in logging.root.handlers]),
        )

    def leaks(self) -> list[str]:
        """What differs from the recording; modules first loaded by a case join the recording."""
        with warnings.catch_warnings():  # reading deprecated module attributes (torch.distributed.reduce_op)
            warnings.simplefilter("ignore")
            return self._leaks()

    def _leaks(self) -> list[str]:
        found = []
        now = self._state()
        for key, was in self.state.items():
            if now[key] != was:
                found.append(f"{key}: {_diff(was, now[key])}")
        for name, module in _watched_modules().items():
            was = self.callables.get(name)
            current = _module_callables(module)
            if was is None:
                self.callables[name] = current
                continue
            changed = sorted(k for k in was.keys() | current.keys() if was.get(k) != current.get(k))
            if changed:
                found.append(f"module {name}: {', '.join(changed)} replaced or added (a monkeypatch not undone?)")
        methods = self._watched_methods()
        for cls, current in methods.items():
            was = self.methods.setdefault(cls, current)
            changed = sorted(k for k in was.keys() | current.keys() if was.get(k) != current.get(k))
            if changed:
                found.append(f"class {cls}: {', '.join(changed)} replaced or added (a monkeypatch not undone?)")
        return found


def _diff(was, now) -> str:
    if isinstance(was, dict) and isinstance(now, dict):
        keys = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
        return "; ".join(f"{k}: {was.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}" for k in keys)
    return f"{was!r} -> {now!r}"


def _tear_down(rank: int, world_size: int, default_group, reinit_port: int, timeout) -> list[str]:
    """Undo what a process exit would (module docstring); return what must not have changed but did."""
    problems = []
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    world = dist.distributed_c10d._world
    default_now = world.default_pg
    for group in list(world.pg_map):
        if group is not default_now:
            dist.destroy_process_group(group)
    if default_now is None:  # the case destroyed the pool's group (to make its own, and tore that down)
        _init_default_group(rank, world_size, reinit_port, timeout)
        default_group = world.default_pg
    elif default_now is not default_group:
        problems.append("the default process group is not the pool's: a case made its own and left it")
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = megatron_random.get_cuda_rng_tracker()
    tracker.reset()
    if torch.cuda.is_available() is False and hasattr(tracker, "_is_initialized"):
        tracker._is_initialized = True  # parallel/cpu.py installs it marked initialised (no lazy CUDA tracker)
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.global_router_replay_instances.clear()
    _break_ddp_hook_cycles()
    gc.collect()
    return problems


def _break_ddp_hook_cycles() -> None:
    """Let the case's Megatron-Core DDP models be collected. Each registers a backward hook on its
    parameters' gradient accumulators (C++ autograd nodes) whose closure holds the model: a cycle
    through C++ that Python's collector cannot see, so the model, its optimizer and its process groups
    (two gloo threads and a transport thread per group) outlived the case, about 50 threads per
    training run (found 2026-11-27: a pool worker had 1153 threads). Emptying the hooks' dicts
    (held only by those nodes) breaks the cycle."""
    for obj in gc.get_objects():
        if type(obj) is collections.OrderedDict and obj and all(
                getattr(hook, "__qualname__", "").startswith(_DDP_HOOK) for hook in obj.values()):
            obj.clear()


def native_threads() -> int:
    """This process's threads, as the kernel counts them (gloo's and torch's included)."""
    return len(os.listdir("/proc/self/task"))


def _worn(baseline_threads: int) -> str | None:
    """Why this worker should be replaced (the pool then starts new processes for the next case), or
    None: native threads or resident memory grown past what a clean tear-down leaves, from state
    a case left that the tear-down does not know (a cycle like `_break_ddp_hook_cycles`'s)."""
    threads = native_threads()
    if threads > baseline_threads + _SPARE_THREADS:
        return f"{threads} threads (started with {baseline_threads})"
    rss_gib = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    if rss_gib > _MAX_RSS_GIB:
        return f"{rss_gib:.1f} GiB resident"
    return None


_retirement: list[str] = []  # why the running case asked for its worker to be replaced (`retire_after_case`)


def retire_after_case(reason: str) -> None:
    """For a case that changes process state the tear-down cannot undo (malloc's tunables set with
    mallopt): this worker exits after replying, as a worn one does (`_worn`), and the next case of
    the pool's world size gets new processes. The case itself passes or fails on its own."""
    _retirement.append(reason)


def _apply_env(changes: dict[str, str | None]) -> dict[str, str | None]:
    """Set (None: unset) these variables; return what undoes it."""
    undo = {key: os.environ.get(key) for key in changes}
    for key, value in changes.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return undo


def _start_env(parent_env: dict[str, str]) -> None:
    """The parent's environment at the pool's start (not the template's at its own), plus what the
    template's imports set, as those imports would have set it in a spawned worker."""
    before = getattr(sys.modules.get(_TEMPLATE), "ENV_BEFORE_IMPORTS", dict(os.environ))
    made = {key: value for key, value in os.environ.items() if before.get(key) != value}
    os.environ.clear()
    os.environ.update({**parent_env, **made})


def import_the_package() -> None:
    """Every module of megatron_rlcorr (about 1.5 s once), so each is in the leak check's recording
    before any case: a module first imported by a case and patched in the same case would be recorded
    patched."""
    import importlib
    import pkgutil

    import megatron.core.transformer.moe.router_replay  # noqa: F401 - torn down after each case
    import megatron_rlcorr

    for module in pkgutil.walk_packages(megatron_rlcorr.__path__, "megatron_rlcorr."):
        importlib.import_module(module.name)


def worker_main(rank: int, world_size: int, port: int, conn, timeout, env: dict[str, str]) -> None:
    """One pool process: set up once (module docstring), then run cases until told to stop."""
    preloaded = "megatron_rlcorr.training.step" in sys.modules  # forked from the template (_context)
    _start_env(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    _init_default_group(rank, world_size, port, timeout)
    default_group = dist.distributed_c10d._world.default_pg
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron

    enable_cpu_megatron()
    import_the_package()  # already imported where the pool's template was preloaded (_context)
    fingerprint = _Fingerprint()
    gc.collect()
    baseline_threads = native_threads()
    gc.freeze()  # what the set-up made stays: each case's collection then scans only the case's objects
    conn.send_bytes(_dumps({"ready": True, "preloaded": preloaded}))
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            return
        if payload == b"stop":
            return
        fn, args, case_port, reinit_port, env_changes = _loads(payload)
        os.environ["MASTER_PORT"] = str(case_port)
        saved_env = _apply_env(env_changes)
        torch.seed()
        try:
            result = fn(rank, world_size, *args)
            reply = {"ok": True, "result": result}
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            conn.send_bytes(_dumps({"ok": False, "error": traceback.format_exc()}))
            return  # the pool is discarded: other ranks may be stuck in a collective
        _apply_env(saved_env)
        try:
            problems = _tear_down(rank, world_size, default_group, reinit_port, timeout)
            fingerprint.restore_env()
            default_group = dist.distributed_c10d._world.default_pg
            problems += fingerprint.leaks()
        except BaseException:  # noqa: BLE001
            problems = [f"tear-down failed:\n{traceback.format_exc()}"]
        reply["leaks"] = problems
        reply["worn"] = None if problems else (_worn(baseline_threads) or "; ".join(_retirement) or None)
        conn.send_bytes(_dumps(reply))
        if problems or reply["worn"]:
            return


# ---- the parent side ----------------------------------------------------------------------------

_TEMPLATE = "tests.pool_template"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _context():
    """multiprocessing's forkserver, started once per session with tests/pool_template.py preloaded:
    workers are forked from it. Its server process is launched with `python -c`, which does not get
    the session's sys.path; PYTHONPATH names the repository while it starts so the template imports
    (a worker then gets the session's sys.path and working directory, as a spawned one did)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([_TEMPLATE])
    saved = _apply_env({"PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))})
    try:
        from multiprocessing import forkserver

        forkserver.ensure_running()
    finally:
        _apply_env(saved)
    return ctx


class WorkerFailure(AssertionError):
    """A case failed on a rank, a worker died, or a case leaked state (module docstring)."""


class Pool:
    """`world_size` processes that run one case at a time (module docstring). Not daemonic: a case
    may start processes of its own (Megatron-Core's asynchronous checkpoint save starts a
    multiprocessing manager); `close` ends them, and so does the parent's exit (atexit below)."""

    def __init__(self, world_size: int, timeout):
        ctx = _context()
        self.world_size = world_size
        self.env = dict(os.environ)
        self.conns, self.procs = [], []
        self.worn: list[str] = []  # why the last case's workers asked to be replaced (`_worn`)
        port = free_port()
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, world_size, port, child_end, timeout, self.env),
                               name=f"dist-pool-{world_size}-rank{rank}")
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)
        _live_pools.append(self)
        try:
            started = [_loads(data) for data in self._gather(lambda rank, data: None, stop_on_error=False)]
            # False where the template failed to import in the forkserver (multiprocessing ignores
            # that): the workers then import everything themselves, correct but slow.
            self.preloaded = all(reply["preloaded"] for reply in started)
        except BaseException:
            self.close(kill=True)
            raise

    def _env_changes(self) -> dict[str, str | None]:
        """The parent's environment as it differs from the pool's start (a test's monkeypatch.setenv
        reaches the workers, as it reached processes spawned at the call); None: removed."""
        now = {k: v for k, v in os.environ.items() if k not in _WORKER_ENV}
        was = {k: v for k, v in self.env.items() if k not in _WORKER_ENV}
        changes: dict[str, str | None] = {k: v for k, v in now.items() if was.get(k) != v}
        changes.update({k: None for k in was if k not in now})
        return changes

    def run(self, fn, args, name: str):
        """fn(rank, world_size, *args) on every process; the results in rank order."""
        payload = _dumps((fn, args, free_port(), free_port(), self._env_changes()))
        for conn in self.conns:
            conn.send_bytes(payload)
        replies = [_loads(data) for data in self._gather(self._check_reply, stop_on_error=True, name=name)]
        self.worn = [f"rank {rank}: {reply['worn']}" for rank, reply in enumerate(replies) if reply["worn"]]
        return [reply["result"] for reply in replies]

    @staticmethod
    def _check_reply(rank: int, data: bytes):
        reply = _loads(data)
        if not reply["ok"]:
            raise WorkerFailure(f"rank {rank} failed:\n{reply['error']}")
        if reply["leaks"]:
            raise WorkerFailure(f"rank {rank}: the case left state behind (tests/dist_pool.py):\n  - "
                                + "\n  - ".join(reply["leaks"]))

    def _gather(self, check, *, stop_on_error: bool, name: str = "starting the pool") -> list[bytes]:
        out: list[bytes | None] = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            by_obj = {self.conns[r]: r for r in pending}
            sentinels = {self.procs[r].sentinel: r for r in pending}
            for ready in wait(list(by_obj) + list(sentinels)):
                if ready in by_obj:
                    rank = by_obj[ready]
                    try:
                        data = ready.recv_bytes()
                    except EOFError:  # the process is gone without a reply
                        raise self._died(rank, name) from None
                    try:
                        check(rank, data)
                    except WorkerFailure as failure:
                        # A rank's death makes its peers' collectives fail at once: report the cause.
                        dead = self._dead_without_reply(pending - {rank}, wait_s=3.0)
                        if dead is not None:
                            raise self._died(dead, name) from failure
                        raise
                    out[rank] = data
                    pending.discard(rank)
                elif sentinels[ready] in pending and self.procs[sentinels[ready]].exitcode != 0:
                    raise self._died(sentinels[ready], name)
                # An exit code 0 follows a reply (worker_main): its pipe is read above.
        return out

    def _dead_without_reply(self, ranks: set[int], wait_s: float) -> int | None:
        wait([self.procs[r].sentinel for r in ranks], timeout=wait_s)
        for rank in sorted(ranks):
            if not self.procs[rank].is_alive() and self.procs[rank].exitcode != 0:
                return rank  # worker_main exits 0 only after its reply
        return None

    def _died(self, rank: int, name: str) -> WorkerFailure:
        self.procs[rank].join(1)
        return WorkerFailure(f"pool worker rank {rank} of {self.world_size} died (exit code "
                             f"{self.procs[rank].exitcode}) while running {name}")

    def alive(self) -> bool:
        """Every worker runs and none is worn (`_worn`: those exit after their reply)."""
        return not self.worn and all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for conn in self.conns:
                try:
                    conn.send_bytes(b"stop")
                except OSError:
                    pass
            for proc in self.procs:
                proc.join(10)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        if self in _live_pools:
            _live_pools.remove(self)


_live_pools: list[Pool] = []


@atexit.register
def _kill_live_pools() -> None:
    """Runs before multiprocessing's own exit handler, which would wait for the workers forever."""
    for pool in _live_pools:
        pool.close(kill=True)
