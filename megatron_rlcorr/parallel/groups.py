"""The process groups of one run, built once at the entry point and passed to the library.

Megatron-Core internals (distributed optimizer, DDP, pipeline schedules) still read the groups
from `megatron.core.parallel_state`, so `build_parallel_groups` initialises those globals with
`initialize_model_parallel` and then exposes the same groups as a `ParallelGroups` object. Every
function of this library takes that object (or one of its groups) as an argument; nothing else
here reads `parallel_state`.

Rank layout is Megatron-Core's default order "tp-cp-ep-dp-pp": tensor-parallel ranks are
neighbours, then context-parallel, then data-parallel, with pipeline stages outermost. The MoE
layers regroup the tp * cp * dp ranks of a pipeline stage as expert-tensor-parallel (etp, the
innermost), expert-parallel (ep) and expert-data-parallel (edp) ranks.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from .world import LaunchWorld


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups, sizes and ranks of this process for TP, PP, CP and DP.

    `dp` is the pure data-parallel group; `dp_cp` joins data and context parallelism (the group
    over which weight gradients are reduced and over which every token of a batch is counted).
    `pg_collection` is what Megatron-Core modules (GPTModel) take as `pg_collection`.
    `vpp_size` and `sequence_parallel` complete the layout the model is built for.

    Generation has a layout of its own (rl/rollout_world.py): rollout groups of
    `rollout_group_size` consecutive ranks, and `rollout_peers`, the group of the ranks that hold
    this rank's position in every rollout group (the whole world when the size is 1).
    `dp_ranks[r]` is the data-parallel rank of world rank r.
    """

    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    pg_collection: ProcessGroupCollection
    vpp_size: int | None = None
    sequence_parallel: bool = False
    rollout_group_size: int = 1
    rollout_peers: dist.ProcessGroup | None = None
    dp_ranks: tuple[int, ...] = ()
    # Expert parallelism (parallel.ep / parallel.etp): the experts of a MoE layer are split over `ep`,
    # each expert's weights over `etp`; `edp` holds the replicas of this rank's expert shards (their
    # gradients are reduced over it). None: no expert groups (ep = etp = 1 on a dense model).
    ep: dist.ProcessGroup | None = None
    etp: dist.ProcessGroup | None = None
    edp: dist.ProcessGroup | None = None
    # rollout.placement: separate: this rank's role in the launch and the groups between the roles
    # (parallel/world.py); the groups above then span this role's ranks only. None: colocated.
    launch: LaunchWorld | None = None

    @property
    def tp_size(self) -> int:
        return dist.get_world_size(self.tp)

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp)

    @property
    def pp_size(self) -> int:
        return dist.get_world_size(self.pp)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp)

    @property
    def cp_size(self) -> int:
        return dist.get_world_size(self.cp)

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp)

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp)

    @property
    def dp_cp_size(self) -> int:
        return dist.get_world_size(self.dp_cp)

    @property
    def dp_cp_rank(self) -> int:
        return dist.get_rank(self.dp_cp)

    @property
    def ep_size(self) -> int:
        return 1 if self.ep is None else dist.get_world_size(self.ep)

    @property
    def ep_rank(self) -> int:
        return 0 if self.ep is None else dist.get_rank(self.ep)

    @property
    def etp_size(self) -> int:
        return 1 if self.etp is None else dist.get_world_size(self.etp)

    @property
    def etp_rank(self) -> int:
        return 0 if self.etp is None else dist.get_rank(self.etp)

    def is_pipeline_first_stage(self, vp_stage: int | None = None) -> bool:
        """True on the stage holding the embedding (for virtual chunk `vp_stage` if given)."""
        if vp_stage not in (None, 0):
            return False
        return self.pp_rank == 0

    def is_pipeline_last_stage(self, vp_stage: int | None = None) -> bool:
        """True on the stage holding the output layer (for virtual chunk `vp_stage` if given)."""
        if vp_stage is not None and vp_stage != (self.vpp_size or 1) - 1:
            return False
        return self.pp_rank == self.pp_size - 1


def build_parallel_groups(tp: int, pp: int, cp: int, vpp: int | None = None, *, sequence_parallel: bool = False,
                          timeout_minutes: int | None = None, rollout_tp: int = 1, ep: int = 1,
                          etp: int = 1, launch: LaunchWorld | None = None) -> ParallelGroups:
    """Create Megatron-Core's model-parallel groups for this world (expert groups of `ep` x `etp`
    too), and the rollout groups of `rollout_tp` ranks (rollout.tensor_parallel_size), and return them.

    Call once per process, after `torch.distributed.init_process_group`. The data-parallel size
    is world_size / (tp * pp * cp). `timeout_minutes`: the collective timeout of every group
    (None: Megatron-Core's default, 30 minutes). `launch`: kept on the result (runtime.process_groups
    with rollout ranks apart).
    """
    if not dist.is_initialized():
        raise RuntimeError("build_parallel_groups needs torch.distributed.init_process_group() first")
    for name, size in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp)):
        if size < 1:
            raise ValueError(f"parallel.{name} must be >= 1, got {size}")
    if sequence_parallel and tp == 1:
        raise ValueError("parallel.sequence_parallel needs parallel.tp > 1")
    if vpp is not None and (vpp < 1 or (pp == 1 and vpp > 1)):
        raise ValueError(f"parallel.vpp={vpp} needs pipeline parallelism (pp > 1) and vpp >= 1, or vpp: null")
    world_size = dist.get_world_size()
    if rollout_tp < 1 or world_size % rollout_tp:
        raise ValueError(f"rollout.tensor_parallel_size={rollout_tp} must divide the world size {world_size} (every "
                         "rank belongs to one rollout engine); launch a multiple of it or change it")
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = "
                         f"{model_parallel}; launch a multiple of {model_parallel} processes or change "
                         "parallel.tp/pp/cp")
    stage_ranks = world_size // pp
    if stage_ranks % (ep * etp):
        raise ValueError(f"parallel.ep*etp = {ep}*{etp} must divide the {stage_ranks} ranks of a pipeline stage "
                         "(tp*cp*dp); launch more processes or lower parallel.ep / parallel.etp")
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("model-parallel groups already exist; call destroy_parallel_groups() first")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        **({} if timeout_minutes is None else {"distributed_timeout_minutes": timeout_minutes}),
    )
    dp = parallel_state.get_data_parallel_group()
    dp_ranks: list[int] = [0] * world_size
    dist.all_gather_object(dp_ranks, dist.get_rank(dp))
    return ParallelGroups(
        tp=parallel_state.get_tensor_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        cp=parallel_state.get_context_parallel_group(),
        dp=dp,
        dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        vpp_size=vpp,
        sequence_parallel=sequence_parallel,
        rollout_group_size=rollout_tp,
        rollout_peers=_rollout_peers(rollout_tp, timeout_minutes),
        dp_ranks=tuple(dp_ranks),
        ep=parallel_state.get_expert_model_parallel_group(),
        etp=parallel_state.get_expert_tensor_parallel_group(),
        edp=parallel_state.get_expert_data_parallel_group(),
        launch=launch,
    )


def _rollout_peers(group_size: int, timeout_minutes: int | None) -> dist.ProcessGroup:
    """This rank's peers in the other rollout groups: ranks with the same index in theirs."""
    world_size = dist.get_world_size()
    if group_size == 1:
        return dist.group.WORLD
    timeout = {} if timeout_minutes is None else {"timeout": datetime.timedelta(minutes=timeout_minutes)}
    mine = None
    for member in range(group_size):  # every rank takes part in creating every group
        group = dist.new_group(list(range(member, world_size, group_size)), **timeout)
        if dist.get_rank() % group_size == member:
            mine = group
    return mine


def destroy_parallel_groups() -> None:
    """Forget the model-parallel groups (Megatron-Core's globals); the default group stays."""
    parallel_state.destroy_model_parallel()
