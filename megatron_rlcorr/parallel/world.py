"""The launch's world cut in two roles: trainer ranks and rollout ranks (rollout.placement: separate).

With `placement: separate` a torchrun launch of W ranks holds T = W - R trainer ranks (launch ranks
0..T-1) and R rollout ranks (T..W-1). Each role gets a default process group of its own: the
trainer's spans the T trainer ranks, the rollout side's the R rollout ranks. Megatron-Core sizes
its groups from the default group's world (`initialize_model_parallel` before 0.19 has no other
way to be told) and its distributed checkpointing synchronises over it, so a default group that
also held ranks which never build the model would hang or mis-size them. With its own default
group, each role runs the code it runs colocated, unchanged: the trainer is an ordinary run on T
ranks, the rollout side an ordinary all-rank generation on R ranks.

The two roles talk over two groups built from the launcher's store, outside the default group
(torch allows one default group per process; these are made directly, as vLLM's stateless groups
are for the same trainer-to-engine link):
- `bridge`: gloo, every launch rank at its launch rank. Point-to-point messages: the rollouts
  each trainer rank trains on, the commands and the validation results. Small next to the
  weights, and gloo keeps them in host memory, where they are unpacked anyway.
- `sync`: trainer rank 0 (rank 0) and every rollout rank (1..R): the weight stream, one broadcast
  per bucket. NCCL with CUDA, gloo without.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

Role = Literal["trainer", "rollout"]


@dataclass(frozen=True)
class LaunchWorld:
    """This process's place in a launch cut into roles (module docstring)."""

    role: Role
    rank: int                              # launch rank (torchrun's RANK)
    size: int                              # launch world size (torchrun's WORLD_SIZE)
    num_trainers: int                      # T: launch ranks 0..T-1 train
    bridge: dist.ProcessGroup              # every launch rank, gloo
    sync: dist.ProcessGroup | None         # trainer rank 0 + the rollout ranks; None elsewhere

    @property
    def rollout_leader(self) -> int:
        """The launch rank of the first rollout rank: it speaks for the rollout side."""
        return self.num_trainers


def split_world(num_rollout: int, *, backend: str, timeout: datetime.timedelta) -> LaunchWorld:
    """Rendezvous with torchrun (env://), initialise this role's default process group and build
    the bridge and sync groups (module docstring). Collective over the launch."""
    store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
    num_trainers = size - num_rollout
    assert 0 < num_trainers < size, (num_rollout, size)  # RolloutConfig.trainer_world checked it
    role: Role = "trainer" if rank < num_trainers else "rollout"
    role_rank, role_size = (rank, num_trainers) if role == "trainer" else (rank - num_trainers, num_rollout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"rlcorr/{role}/", store), rank=role_rank,
                            world_size=role_size, timeout=timeout)
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("rlcorr/bridge/", store), rank, size, timeout)
    sync = None
    if rank == 0 or role == "rollout":
        sync_rank = 0 if rank == 0 else rank - num_trainers + 1
        sync = _direct_group(backend, dist.PrefixStore("rlcorr/sync/", store), sync_rank, num_rollout + 1, timeout)
    return LaunchWorld(role=role, rank=rank, size=size, num_trainers=num_trainers, bridge=bridge, sync=sync)


def _direct_group(backend: str, store: dist.Store, rank: int, size: int,
                  timeout: datetime.timedelta) -> dist.ProcessGroup:
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, root: int = 0) -> None:
    """Broadcast `tensor` from the group's rank `root` on a directly made group (in place)."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()
