"""parallel/cpu.py's `outside_cuda_redirect`: inside it, this thread's CUDA-to-CPU torch function
mode is off (an allocation aimed at CUDA fails, as on any CPU-only torch), and it is back after;
where another mode is the innermost one, it leaves the stack alone. Run in a pool worker, whose
process has the CPU patches installed (tests/dist_pool.py)."""
import pytest
import torch
from torch.overrides import BaseTorchFunctionMode

from tests.dist import run_distributed

pytestmark = pytest.mark.distributed


def _device_or_error() -> str:
    try:
        return torch.zeros(1, device="cuda").device.type
    except (AssertionError, RuntimeError) as err:  # "Torch not compiled with CUDA enabled"
        return type(err).__name__


def _redirects(rank, world_size):
    from megatron_rlcorr.parallel.cpu import enable_cpu_megatron, outside_cuda_redirect

    assert enable_cpu_megatron()
    before = _device_or_error()
    with outside_cuda_redirect():
        inside = _device_or_error()
    after = _device_or_error()
    with BaseTorchFunctionMode(), outside_cuda_redirect():
        under_another_mode = _device_or_error()
    return before, inside, after, under_another_mode


def test_outside_cuda_redirect_turns_the_mode_off_for_the_block_only():
    (before, inside, after, under_another_mode), = run_distributed(_redirects, 1)
    assert (before, after, under_another_mode) == ("cpu", "cpu", "cpu")
    assert inside in ("AssertionError", "RuntimeError")
