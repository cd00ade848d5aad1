"""The trainer's memory in host memory while the rollout engine generates: verl's param_offload,
grad_offload and optimizer_offload for Megatron-Core (`model.offload_params`,
`model.offload_grads`, `optim.offload_optimizer`).

Why: the engine shares the GPU with the trainer (rl/trainer.py). Without offload the trainer's
states stay on it while the engine generates: bf16 weights (2 bytes per parameter of the rank),
fp32 gradients (4) and the optimizer's fp32 master weights and Adam moments (12, divided by
DP x CP with the distributed optimizer); with all three offloaded generation has the GPU to
itself, less what the CUDA context and the allocator keep (recipe/memory.py counts it so).

What moves, per rank:
- params: the storage of every DDP parameter buffer (`param_data`: with the distributed
  optimizer every parameter is a view into it), and every parameter outside one (its own
  storage: the plain optimizer's case). Copied to host memory and back.
- grads: the storage of every DDP gradient buffer (`grad_data`: `param.main_grad` and the
  buckets are views into it). Freed and given back zeroed, not copied: every mini-batch zeroes
  it before accumulating (optimizer.zero_grads), so its contents between steps are never read.
- optimizer: the optimizer's own tensors: its parameters (the float32 master weights of a bf16
  model), their gradients, and Adam's state (exp_avg, exp_avg_sq). Copied. Storage the model
  owns is left to params / grads: with fp32 weights the distributed optimizer's master weights
  are views into the parameter buffer.
What stays: everything else the model holds (module buffers: Transformer Engine's FP8 weight
caches and amax histories, rotary tables), and the reference policy (its own
`algorithm.reference.offload`).

How: per storage, not per tensor. `untyped_storage().resize_(0)` releases a storage's memory
while every tensor viewing it (parameters, main_grad, bucket views, the optimizer's shards of
the buffers) keeps pointing at the same storage object; `reload` resizes it back and copies the
bytes in, so the same views see the same values, bit for bit, and nothing Megatron holds needs
rebuilding. Storages are found afresh at every offload (Adam creates its state at the first
step; a checkpoint load replaces it); each storage moves once however many tensors view it. The
host copies are kept from one step to the next (pinned once, on CUDA). On the CPU path the
"device" is the CPU: the host copy is then a second, unpinned CPU buffer and the device storage
is released all the same, so the mechanism is the one a GPU runs (tests/distributed/
test_offload.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .optimizer import inner_optimizers


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 host copy; None: freed, given back zeroed


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _ddp_buffers(chunk) -> list[Any]:
    # Megatron's DDP keeps its buffers in the attribute `buffers` (shadowing nn.Module.buffers).
    buffers = getattr(chunk, "buffers", None)
    return [*(buffers if isinstance(buffers, list) else []), *getattr(chunk, "expert_parallel_buffers", [])]


class _Storages:
    """Distinct storages on one device, in first-seen order."""

    def __init__(self, device: torch.device):
        self.device, self.by_ptr = device, {}

    def add(self, tensor: torch.Tensor | None) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device != self.device:
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            self.by_ptr.setdefault(storage.data_ptr(), storage)

    def add_all(self, tensors: Iterable[torch.Tensor | None]) -> None:
        for tensor in tensors:
            self.add(tensor)


class TrainerOffload:
    """Moves the chosen trainer states off the device (`offload`) and back (`reload`); a no-op
    when none is chosen. `offload` returns the device bytes it released."""

    def __init__(self, model_chunks: list[Any], optimizer, *, params: bool, grads: bool, optimizer_states: bool,
                 device: torch.device):
        self.model_chunks, self.optimizer, self.device = model_chunks, optimizer, torch.device(device)
        self.params, self.grads, self.optimizer_states = params, grads, optimizer_states
        self._moved: list[_Moved] = []
        self._host: dict[int, torch.Tensor] = {}  # host copies by storage, kept between steps

    @property
    def enabled(self) -> bool:
        return self.params or self.grads or self.optimizer_states

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    def _collect(self) -> tuple[list[torch.UntypedStorage], list[torch.UntypedStorage]]:
        """(storages to copy, storages to free) this offload."""
        params, grads, optim = (_Storages(self.device) for _ in range(3))
        for chunk in self.model_chunks:
            for buffer in _ddp_buffers(chunk):
                params.add(buffer.param_data)
                grads.add(buffer.grad_data)
            params.add_all(chunk.parameters())
            grads.add_all(getattr(p, "main_grad", None) for p in chunk.parameters())
        for inner in inner_optimizers(self.optimizer):
            torch_optimizer = getattr(inner, "optimizer", None)
            if torch_optimizer is None:  # Megatron's stub for a rank without parameters of a kind
                continue
            for group in torch_optimizer.param_groups:
                for param in group["params"]:
                    optim.add_all((param, param.grad, *torch_optimizer.state.get(param, {}).values()))
        model = {**params.by_ptr, **grads.by_ptr}
        copy = dict(params.by_ptr) if self.params else {}
        if self.optimizer_states:
            copy.update({ptr: s for ptr, s in optim.by_ptr.items() if ptr not in model})
        # A gradient buffer shared with the parameters (MXFP8) is never just freed.
        free = {ptr: s for ptr, s in grads.by_ptr.items() if ptr not in params.by_ptr} if self.grads else {}
        return list(copy.values()), [s for ptr, s in free.items() if ptr not in copy]

    def offload(self) -> int:
        """Release the chosen states' device memory (their values kept in host memory, gradients
        dropped); returns the bytes released. Idempotent."""
        if not self.enabled or self.offloaded:
            return 0
        copy, free = self._collect()
        pin = self.device.type == "cuda"
        host_by_key = {}
        for storage in copy:
            key, nbytes = storage._cdata, storage.nbytes()
            host = self._host.get(key)
            if host is None or host.numel() != nbytes:
                host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes_view(storage))  # synchronous: the device memory is released next
            host_by_key[key] = host
            self._moved.append(_Moved(storage, nbytes, host))
        self._host = host_by_key
        self._moved += [_Moved(storage, storage.nbytes(), None) for storage in free]
        for moved in self._moved:
            moved.storage.resize_(0)
        if pin:
            torch.cuda.empty_cache()  # to the engine, which allocates its own memory
        return sum(moved.nbytes for moved in self._moved)

    def reload(self) -> None:
        """Give every released storage its memory back, with the values it had (gradients zeroed)."""
        for moved in self._moved:
            moved.storage.resize_(moved.nbytes)
            view = _bytes_view(moved.storage)
            if moved.host is None:
                view.zero_()
            else:
                view.copy_(moved.host, non_blocking=moved.host.is_pinned())
        self._moved = []

    def host_bytes(self) -> int:
        """Host memory holding offloaded (or, between steps, kept) copies."""
        return sum(host.numel() for host in self._host.values())
