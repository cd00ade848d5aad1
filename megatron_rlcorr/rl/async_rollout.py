"""Asynchronous RL: rollout ranks that generate the next batches while the trainer trains.

With `rollout.placement: separate` the last `rollout.num_ranks` ranks of the launch run a
`RolloutWorker` and never train; the trainer ranks run the Trainer (rl/trainer.py) with a
`RolloutClient` in place of an engine (parallel/world.py cuts the launch in the two roles).

Schedule (S = rollout.max_staleness, N = trainer.steps). The batch of step t is generated with
the weights after step v(t) = max(0, t - 1 - S), so step t trains on rollouts S steps stale
(fewer in the first S steps): exactly what `rollout.policy_lag: S` emulates on colocated ranks,
and the same rollouts (the engine's samples depend on (seed, step, prompt) and the weights only).
The trainer drives it. Before step 1 it sends the initial weights and asks for batches 1..S+1.
After step s it sends the new weights and asks for batch s+S+1 (when s + S + 1 <= N). The
rollout ranks take each command in turn: load the weights, validate when asked, generate the
batches asked for and send each to the trainer ranks as soon as it is done. So while the
trainer trains step s, the rollout ranks generate batch s+S. The weight broadcast is a
synchronisation point, as in verl's one-step-off-policy recipe: after step s the trainer waits
until the rollout ranks have finished the batch they were generating. With S = 1 that is the
batch it needs next anyway. With S > 1 the bound is looser, but the overlap is no larger.

Messages:
- Commands (trainer rank 0 -> every rollout rank, broadcast over `sync`): a small dict, then the
  weight stream bucket by bucket (model/weight_stream.py's buckets; each one's names and shapes,
  then one flat tensor), ended by an empty bucket list.
- Rollouts (the rollout leader -> every trainer rank, point to point over `bridge`): a
  `StepRollouts` per step, the DP replica's share of the step's batch with every sample's tokens,
  log-probs (and routed experts), the step's rollout statistics and the policy version that
  generated it. The rollout ranks first gather their samples on the leader, so the leader sends
  O(tokens / DP) to each trainer rank.
- Validation results (the rollout leader -> trainer rank 0, over `bridge`).

Checkpoints (exact resume): the trainer saves after step s, before it sends W_s. At that point it
has asked for batches up to s + S, all generated with weights older than W_s, which only the
rollout ranks hold. So it first receives those batches, then writes each replica's share of them
beside the checkpoint (`rollouts/dp<d>.pt`), with the dataset position after them. A resumed run
trains on them, then asks for batch s+S+1 with the checkpoint's weights, as the uninterrupted run
did. A resume on another data-parallel size cannot use the saved shares: it regenerates those
batches with the checkpoint's weights and says so.
"""
from __future__ import annotations

import io
import pickle
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..model.weight_stream import MiB, drain, weight_buckets
from ..parallel.world import LaunchWorld, broadcast
from .sampling import RolloutGroups
from .step_sampling import build_generation, rollout_stats
from .validation import validate

if TYPE_CHECKING:
    from ..parallel.groups import ParallelGroups
    from .settings import RunSettings

TAG_ROLLOUTS, TAG_VALIDATION = 1, 2


@dataclass
class StepRollouts:
    """One step's rollouts as a trainer rank receives them (module docstring)."""

    step: int
    policy_version: int                  # the trainer step whose weights generated them (0: the initial ones)
    share: RolloutGroups                 # this rank's DP replica's groups, with every sample's tokens
    sums: dict[str, torch.Tensor]        # step_sampling.rollout_stats of the step's whole batch
    data_metrics: dict[str, torch.Tensor]
    data_position: int                   # the dataset's read position after this step's prompts
    gen_s: float                         # seconds the rollout ranks spent generating them
    policy_versions_B: torch.Tensor = field(default=None)  # [samples] int64: every sample's version

    def __post_init__(self) -> None:
        if self.policy_versions_B is None:
            self.policy_versions_B = torch.full((len(self.share) * self.share.n,), self.policy_version,
                                                dtype=torch.int64)

    def staleness(self, trainer_version: int) -> torch.Tensor:
        """float [samples]: how many optimizer steps each sample's policy lags `trainer_version`."""
        return (trainer_version - self.policy_versions_B).double()


# ---- messages on directly made groups ---------------------------------------------------------

def _pack(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def _unpack(payload: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


def send_object(group: dist.ProcessGroup, obj: Any, dst: int, tag: int, *, wait: bool = True) -> list:
    """Send a picklable object (tensors inside travel too) to rank `dst` of `group` (gloo).
    wait=False: return (work, tensor) pairs to keep until the receiver has taken them."""
    payload = _pack(obj)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    pending = [(group.send([size], dst, tag), size), (group.send([payload], dst, tag), payload)]
    if wait:
        for work, _ in pending:
            work.wait()
        return []
    return pending


def recv_object(group: dist.ProcessGroup, src: int, tag: int) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], src, tag).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.recv([payload], src, tag).wait()
    return _unpack(payload)


def broadcast_object(group: dist.ProcessGroup, obj: Any, device: torch.device) -> Any:
    """`obj` from the group's rank 0 to every rank (`device`: where the group's backend wants tensors)."""
    payload = _pack(obj).to(device) if group.rank() == 0 else None
    size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64, device=device)
    broadcast(group, size)
    if payload is None:
        payload = torch.empty(int(size), dtype=torch.uint8, device=device)
    broadcast(group, payload)
    return obj if group.rank() == 0 else _unpack(payload.cpu())


def _sync_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ---- trainer side -----------------------------------------------------------------------------

class RolloutClient:
    """The trainer ranks' end (module docstring): commands and weights out, rollouts in."""

    def __init__(self, recipe: RunSettings, groups: ParallelGroups) -> None:
        assert groups.launch is not None and groups.launch.role == "trainer"
        self.recipe, self.groups, self.launch = recipe, groups, groups.launch
        self.staleness = recipe.rollout.staleness
        self.device = _sync_device()
        self.inflight: deque[StepRollouts] = deque()  # received ahead of their step (checkpoints, resume)
        self.requested = 0                            # the last step whose batch was asked for
        self.received = 0                             # the last step whose batch arrived (or was loaded)
        self.data_position = 0                        # the dataset position after the latest step trained on

    @property
    def next_position(self) -> int:
        """Where the rollout ranks read on: after the batches held, else after the latest step's."""
        return self.inflight[-1].data_position if self.inflight else self.data_position

    def start(self, step: int) -> None:
        """The run starts after step `step` (0, or the checkpoint's): batches up to it are done."""
        self.requested = self.received = max(step, self.inflight[-1].step if self.inflight else 0)

    def first_requests(self, step: int, steps: int) -> list[int]:
        """The batches to ask for with the weights after step `step` when the run (re)starts there:
        those not yet held, up to step + S + 1 (module docstring)."""
        return list(range(self.received + 1, min(step + self.staleness + 1, steps) + 1))

    def requests_after(self, step: int, steps: int, *, last: bool) -> list[int]:
        """The batch to ask for with the weights after step `step`: step + S + 1, if the run gets
        there (`last`: the run stops after this step)."""
        wanted = step + self.staleness + 1
        return [] if last or wanted > steps else [wanted]

    def push(self, model_chunks, *, version: int, generate: list[int], validate_step: int | None,
             first: dict | None = None) -> None:
        """Send the weights after step `version`, then ask for `generate`'s batches (and a
        validation of these weights at `validate_step`). Collective over the trainer ranks (the
        weight stream); `first`: what the rollout side needs once (data position, DP ranks)."""
        rollout = self.recipe.rollout
        buckets = weight_buckets(model_chunks, self.groups, dtype=rollout.weight_dtype,
                                 bucket_bytes=rollout.weight_sync_bucket_mb * MiB, hf_names=rollout.engine == "vllm")
        if generate:
            self.requested = generate[-1]
        sync = self.launch.sync
        if sync is None:  # trainer ranks other than 0 take part in the gathers only
            drain(buckets)
            return
        command = {"op": "weights", "version": version, "generate": generate, "validate": validate_step,
                   **(first or {})}
        broadcast_object(sync, command, self.device)
        for bucket in buckets:
            broadcast_object(sync, [(name, tuple(t.shape), t.dtype) for name, t in bucket], self.device)
            broadcast(sync, torch.cat([t.reshape(-1) for _, t in bucket]).to(self.device))
        broadcast_object(sync, [], self.device)

    def stop(self) -> None:
        """Tell the rollout ranks to exit (trainer rank 0; the others do nothing)."""
        if self.launch.sync is not None:
            broadcast_object(self.launch.sync, {"op": "stop"}, self.device)

    def receive(self) -> StepRollouts:
        """The next step's rollouts: one received ahead (or loaded from a checkpoint) first."""
        if self.inflight:
            message = self.inflight.popleft()
        else:
            message = recv_object(self.launch.bridge, self.launch.rollout_leader, TAG_ROLLOUTS)
            self.received = message.step
        self.data_position = message.data_position
        return message

    def receive_ahead(self) -> None:
        """Receive every batch asked for so far (checkpoints: module docstring)."""
        while self.received < self.requested:
            message = recv_object(self.launch.bridge, self.launch.rollout_leader, TAG_ROLLOUTS)
            self.inflight.append(message)
            self.received = message.step

    def receive_validation(self) -> tuple[dict[str, float], list[dict]]:
        """The validation metrics and records the rollout ranks computed (trainer rank 0)."""
        return recv_object(self.launch.bridge, self.launch.rollout_leader, TAG_VALIDATION)

    # checkpoints
    def save_inflight(self, directory: Path) -> None:
        """Each DP replica's share of the batches received ahead, beside the checkpoint (the
        replica's first rank writes it; CheckpointWriter.save's `extra`)."""
        g = self.groups
        if g.tp_rank == 0 and g.pp_rank == 0 and g.cp_rank == 0:
            (directory / "rollouts").mkdir(parents=True, exist_ok=True)
            torch.save({"dp_size": g.dp_size, "batches": list(self.inflight)},
                       directory / "rollouts" / f"dp{g.dp_rank}.pt")

    def load_inflight(self, directory: Path) -> bool:
        """The batches saved with the checkpoint in `directory` (False: none usable, printed why)."""
        path = directory / "rollouts" / f"dp{self.groups.dp_rank}.pt"
        if not path.exists():
            return False
        saved = torch.load(path, weights_only=False)
        if saved["dp_size"] != self.groups.dp_size:
            if dist.get_rank() == 0:
                print(f"rollout.placement separate: the rollouts in flight at {directory} were saved for "
                      f"{saved['dp_size']} data-parallel replicas and this run has {self.groups.dp_size}: they are "
                      "generated again with the checkpoint's weights (fresher than the uninterrupted run's)",
                      flush=True)
            return False
        self.inflight.extend(saved["batches"])
        return True


# ---- rollout side -----------------------------------------------------------------------------

class RolloutWorker:
    """A rollout rank's loop (module docstring): no model, no optimizer, an engine and the task."""

    def __init__(self, recipe: RunSettings, groups: ParallelGroups) -> None:
        launch = groups.launch
        assert launch is not None and launch.role == "rollout"
        self.recipe, self.groups, self.launch = recipe, groups, launch
        self.device = _sync_device()
        self.leader = launch.rank == launch.rollout_leader
        self.engine, self.sampler, self.val_task, self.val_prompts = build_generation(recipe, groups, self.device)
        self.dp_ranks: tuple[int, ...] = ()
        # Rollouts sent ahead: the trainer takes them when it reaches their step, so the leader never
        # waits for that (it would wait while the trainer waits to send it weights).
        self.sending: list = []

    def run(self) -> None:
        while True:
            command = broadcast_object(self.launch.sync, None, self.device)
            self.sending = [(work, t) for work, t in self.sending if not work.is_completed()]
            if command["op"] == "stop":
                for work, _ in self.sending:
                    work.wait()
                return
            if "data_position" in command:
                self.sampler.data_position = command["data_position"]
            if "dp_ranks" in command:
                self.dp_ranks = tuple(command["dp_ranks"])
            self.engine.wake_up(["weights"])
            self.engine.load_weights(self._weights())
            self.engine.wake_up(["kv_cache"])
            if command["validate"] is not None:
                self._validate(command["validate"])
            for step in command["generate"]:
                self._generate(step, command["version"])

    def _weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight stream of one command, as (name, tensor) pairs."""
        while True:
            meta = broadcast_object(self.launch.sync, None, self.device)
            if not meta:
                return
            numel = [int(torch.Size(shape).numel()) for _, shape, _ in meta]
            flat = torch.empty(sum(numel), dtype=meta[0][2], device=self.device)
            broadcast(self.launch.sync, flat)
            for (name, shape, _), part in zip(meta, flat.split(numel)):
                yield name, part.view(shape)

    def _validate(self, step: int) -> None:
        trainer, rollout = self.recipe.trainer, self.recipe.rollout
        t0 = time.perf_counter()
        result = validate(self.engine, self.val_task, self.val_prompts, rollout.val_kwargs,
                          max_new_tokens=rollout.max_new_tokens, groups=self.groups, seed=trainer.seed, step=step,
                          device=self.device, max_records=trainer.log_val_generations)
        if self.leader:
            metrics = {**{k: float(v) for k, v in result.metrics.items()}, "timing/val_s": time.perf_counter() - t0}
            send_object(self.launch.bridge, (metrics, list(result.records)), 0, TAG_VALIDATION)

    def _generate(self, step: int, version: int) -> None:
        t0 = time.perf_counter()
        prompts, data_metrics = self.sampler.step_prompts()
        batch, first, stats, dropped, generated = self.sampler.sample_step(step, prompts)
        sums = rollout_stats(batch, first, stats, dropped, generated)
        batch = self._gather(batch)
        gen_s = time.perf_counter() - t0
        if not self.leader:
            return
        num_trainers, dp_size = self.launch.num_trainers, max(self.dp_ranks) + 1
        per_replica = len(batch) // dp_size
        for dp_rank in range(dp_size):
            share = batch.select(list(range(dp_rank * per_replica, (dp_rank + 1) * per_replica)))
            message = StepRollouts(step=step, policy_version=version, share=share, sums=sums,
                                   data_metrics=data_metrics, data_position=self.sampler.data_position, gen_s=gen_s)
            for rank in range(num_trainers):
                if self.dp_ranks[rank] == dp_rank:
                    self.sending += send_object(self.launch.bridge, message, rank, TAG_ROLLOUTS, wait=False)

    def _gather(self, batch: RolloutGroups) -> RolloutGroups:
        """The batch with every sample's tokens on the leader (collective over the rollout ranks)."""
        if dist.get_world_size() == 1:
            return batch
        fields = ["response_ids", "logprobs"] + (["routed_experts"] if batch.routing is not None else []) + \
            (["prompt_routed_experts"] if batch.routing is not None and batch.routing.prompt else [])
        mine = {row: [getattr(batch, f)[row] for f in fields] for row, ids in enumerate(batch.response_ids)
                if ids is not None}
        gathered: list[Any] = [None] * dist.get_world_size() if self.leader else None
        dist.gather_object(mine, gathered, dst=0)
        if self.leader:
            for part in gathered:
                for row, values in part.items():
                    for f, value in zip(fields, values):
                        getattr(batch, f)[row] = value
            assert all(ids is not None for ids in batch.response_ids), "a sample of the step never reached the leader"
        return batch


def run_rollout_worker(recipe: RunSettings, groups: ParallelGroups) -> None:
    """A rollout rank's whole run (train.py calls it on the rollout ranks)."""
    RolloutWorker(recipe, groups).run()


__all__ = ["LaunchWorld", "RolloutClient", "RolloutWorker", "StepRollouts", "run_rollout_worker"]
