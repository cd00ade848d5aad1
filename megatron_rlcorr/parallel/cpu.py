"""Run Megatron-Core on a machine without CUDA (development, CI, gloo multi-process tests).

Megatron-Core assumes a GPU in a handful of places that are not about GPU kernels at all. On a
CPU-only torch build each of them raises ("Torch not compiled with CUDA enabled", or an
assertion). Measured on megatron-core 0.16.1 (and 0.19.2 with CUDA hidden) with GPTModel (local
layer spec), TP 1/2, PP 2 through `get_forward_backward_func`, CP 2 (with our
ContextParallelAttention), DDP, and `get_megatron_optimizer` with Adam in fp32, bf16 and as the
distributed optimizer (and, for 12. and 13., MoE layers under EP 1/2), every patch below is hit,
and the run fails without it:

1. `torch.cuda.current_device()` is the device of new tensors (rotary frequencies, TP
   all-gather buffers, pipeline shape buffers, DDP grad buffers): it returns "cpu".
2. Literal `device="cuda"` allocations: DotProductAttention's default causal mask
   (transformer/utils.py), the token counter of every pipeline schedule, the optimizer's
   found_inf / overflow / grad-norm buffers. A torch function mode sends them to the CPU.
3. `pin_memory=True` and `.cuda()`: the rotary table slice of a CP rank
   (`get_pos_emb_on_this_cp_rank`), and the tied-embedding copy on the last pipeline stage
   (`weight.data.cuda()`). The same mode drops the pinning and keeps `.cuda()` on the CPU.
4. Optimizer and grad-clipping type checks compare `param.type()` with
   "torch.cuda.FloatTensor" / "torch.cuda.BFloat16Tensor": the mode reports CPU tensors under
   those names (the dtype part stays truthful).
5. Pipeline p2p calls `torch.cuda.synchronize()` after batched send/recv: a no-op (gloo
   operations are complete once waited on).
6. megatron-core 0.19 only: DDP's `start_grad_sync` takes `torch.cuda.current_stream()` (to
   wait on CUDA-graph events): it returns a stream stand-in whose waits are no-ops.
7. The tensor-parallel RNG tracker (`model_parallel_cuda_manual_seed`; DotProductAttention
   forks it around dropout even at p=0) stores CUDA generator states: a subclass with the same
   interface on the CPU generator replaces it.
8. On a GPU machine with the GPUs hidden (the CPU-path tests there), Megatron-Core's optimizer
   modules picked Transformer Engine's fused Adam and multi-tensor kernels at import, which
   need CUDA: torch's Adam and Megatron's own multi-tensor functions replace them (a no-op where
   Transformer Engine is absent, as on the CPU machines). The model side avoids TE's norm in
   model/build.py.
9. Activation recomputation (`tensor_parallel.checkpoint`, `CheckpointWithoutOutput`) saves and
   restores the CPU generator, the CUDA generator and the tracker's states around the recomputed
   forward; there is no CUDA generator here, so its get/set become an empty state / a no-op (the
   CPU generator and our tracker, whose states are CPU generator states, are still restored, so
   dropout masks repeat exactly). The recomputed forward runs inside the autograd engine, where
   the thread-local torch function mode of 2. is not active: it is re-entered there.
10. Selective recomputation of "layernorm" without Transformer Engine: megatron-core 0.16.1's
   `CheckpointWithoutOutput(fp8=False)` sets `self.fp8 = fp8 is not None` (True) and then calls
   TE's FP8 state manager, a NameError without TE; without TE there is no FP8 context to save.
11. Loading the distributed optimizer's `fully_reshardable` checkpoint state into torch's Adam
   (8.): torch's Adam keeps a per-parameter "step" tensor that this format does not carry per
   parameter (the optimizer's load_state_dict restores it from the common state first), and
   `_set_main_param_and_optimizer_states` fails with KeyError 'step'. It copies the tensors the
   checkpoint has and leaves "step" as restored. And that restore gives every parameter the
   same step tensor object, which torch's Adam then increments once per parameter per update
   (measured: 17 parameters, step 2 -> 19 after one update, and the resumed weights drifted
   2e-3 from the uninterrupted run): each parameter gets its own copy after the load.
12. MoE routers: the router's gating GEMM (`RouterGatingLinearFunction`, moe/moe_utils.py) calls
   Transformer Engine's `te_general_gemm` when it is not None, a CUDA kernel; without TE,
   megatron-core 0.16.1 never defines the name (NameError). It is set to None, so the router
   multiplies with torch's mm in the router dtype (what the function does without TE).
13. The alltoall token dispatcher (model.moe.token_dispatcher: alltoall): it creates a CUDA stream
   for its device-to-host copies of the split sizes (`torch.cuda.Stream()` at construction) and
   records an event on it; the dispatcher's stream becomes the stand-in of 6. (the same object
   as the "current" stream, so nothing waits), whose events are complete when recorded. Its
   `maybe_move_tensor_to_cpu` leaves CPU tensors as they are, and gloo's all_to_all then rejects
   the split-size tensors (TypeError: incompatible function arguments): CPU split sizes become
   the int64 numpy arrays the GPU path makes. What gloo itself cannot do (the uneven all-gather
   of alltoall with expert tensor parallelism) is refused when the model is built (model/build.py).

Everything here is process-global and only ever installed when `torch.cuda.is_available()` is
False, so GPU runs execute Megatron-Core unmodified. The torch function mode is thread-local:
call `enable_cpu_megatron()` in the thread that runs the model (the main thread). Under the mode
every torch call goes through a Python function, which for a tiny model's small ops costs about as
much as a third of the op (a 10-layer MLP of width 64, one thread: 7.4 ms -> 9.9 ms per forward and
backward on the 2-core development machine, 2026-11-28). Code of ours that never asks for CUDA runs
outside it (`outside_cuda_redirect`: the embedded engine's decoding, most of a tiny run's
generation).
Not covered (not needed on CPU): CUDA graphs, Transformer Engine and apex fused kernels (TEGroupedMLP
and the alltoall dispatcher's permute fusion among them). Sequence parallelism needs nothing here:
model/build.py gives the local layers a norm that accepts it (SequenceParallelRMSNorm).
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_enabled = False


def enable_cpu_megatron() -> bool:
    """Make Megatron-Core runnable on the CPU; a no-op when CUDA is available.

    Idempotent. Returns True when the CPU patches are active in this process.
    """
    global _enabled
    if torch.cuda.is_available():
        return False
    if not _enabled:
        torch.cuda.current_device = _cpu_current_device
        torch.cuda.synchronize = _no_synchronize
        torch.cuda.current_stream = _null_stream
        _CudaToCpuMode().__enter__()  # stays on the mode stack for the life of the thread
        _install_cpu_rng_tracker()
        _use_torch_optimizer_kernels()
        _recompute_on_cpu()
        _router_gemm_in_torch()
        _alltoall_dispatcher_on_cpu()
        _enabled = True
    return True


def _router_gemm_in_torch() -> None:
    """12. in the module docstring."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def _alltoall_dispatcher_on_cpu() -> None:
    """13. in the module docstring."""
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NULL_STREAM

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor):
            return np.asarray(tensor.tolist(), dtype=np.int64)
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _cpu_current_device() -> str:
    return "cpu"


def _no_synchronize(device=None) -> None:
    return None


class _NullEvent:
    """A CUDA event stand-in: recorded CPU work is already complete."""

    def synchronize(self) -> None:
        return None


class _NullStream:
    """A CUDA stream stand-in: CPU work is already ordered, so waiting is a no-op."""

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> _NullEvent:
        return _NullEvent()


_NULL_STREAM = _NullStream()  # one "current stream", so a stream compared with it is the same stream


def _null_stream(device=None) -> _NullStream:
    return _NULL_STREAM


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # A bare integer is a CUDA device index.
    return isinstance(device, int) and not isinstance(device, bool)


@contextlib.contextmanager
def outside_cuda_redirect():
    """Run the block without this thread's torch function mode of 2.-4. when that mode is the
    innermost one (a no-op otherwise, and on GPU machines, where it is never installed): for code of
    ours that never asks for CUDA, so that its torch calls skip the mode's Python call (module
    docstring)."""
    if not isinstance(torch.overrides._get_current_function_mode(), _CudaToCpuMode):
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


class _CudaToCpuMode(TorchFunctionMode):
    """Sends tensor creation and transfers aimed at CUDA to the CPU; reports CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(args[0])
            return name if args[0].is_cuda else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")) or kwargs.get("pin_memory"):
            kwargs = dict(kwargs)
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
        """Megatron's named RNG states, kept as states of torch's CPU generator."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise ValueError(f"RNG seed {seed} is already tracked")
            if name in self.states_:
                raise ValueError(f"RNG state {name!r} is already tracked")
            self._is_initialized = True
            self.seeds_.add(seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.states_[name] = torch.get_rng_state()

        @contextlib.contextmanager
        def fork(self, name=megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise KeyError(f"RNG state {name!r} was never added (call model_parallel_cuda_manual_seed)")
            outer_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)

    # Megatron creates its tracker lazily unless one is marked initialised; seeding
    # (model_parallel_cuda_manual_seed) then resets and fills ours.
    megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _use_torch_optimizer_kernels() -> None:
    from megatron.core import optimizer
    from megatron.core import utils as megatron_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as megatron_optimizer

    optimizer.USING_PYTORCH_OPTIMIZER = True  # build torch.optim.Adam / AdamW
    optimizer.Adam, optimizer.SGD = torch.optim.AdamW, torch.optim.SGD
    # The distributed optimizer's state (de)serialisation follows the optimizer's kind.
    distrib_optimizer.Adam = torch.optim.Adam
    distrib_optimizer.HAVE_APEX_OR_TE = False
    distrib_optimizer.USING_TE_OPTIMIZER = distrib_optimizer.USING_APEX_OPTIMIZER = False
    applier, scale = megatron_utils.local_multi_tensor_applier, megatron_utils.local_multi_tensor_scale
    megatron_optimizer.multi_tensor_applier, megatron_optimizer.multi_tensor_scale_impl = applier, scale
    clip_grads.multi_tensor_applier, clip_grads.multi_tensor_scale_impl = applier, scale
    clip_grads.l2_norm_impl = megatron_utils.local_multi_tensor_l2_norm

    set_states = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # The step is the one load_state_dict just set from the checkpoint's param_groups: the
        # fully_reshardable format carries no per-parameter step, and dp_reshardable's is the
        # loading optimizer's own (a non-persistent 0 from before the load), which would undo it.
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main_param].get("step")
        if step is not None:
            tensors = {**tensors, "step": step}  # copied onto itself
        return set_states(self, model_param, tensors)

    distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    load_state_dict = distrib_optimizer.DistributedOptimizer.load_state_dict

    def _load_state_dict(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    distrib_optimizer.DistributedOptimizer.load_state_dict = _load_state_dict


def _recompute_on_cpu() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    # Module globals: _get_all_rng_states / _set_all_rng_states look them up at call time.
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None

    checkpoint_backward = megatron_random.CheckpointFunction.backward

    def backward(ctx, *grads):
        with _CudaToCpuMode():
            return checkpoint_backward(ctx, *grads)

    # autograd looks the backward up on the Function class when it runs it.
    megatron_random.CheckpointFunction.backward = staticmethod(backward)

    without_output = megatron_random.CheckpointWithoutOutput
    recompute, init = without_output._recompute, without_output.__init__

    def _recompute(self, *args):
        with _CudaToCpuMode():
            return recompute(self, *args)

    def __init__(self, fp8=False):
        init(self, fp8)
        self.fp8 = self.fp8 and hasattr(megatron_random, "FP8GlobalStateManager")

    without_output._recompute, without_output.__init__ = _recompute, __init__
