"""The RL loop users launch: rollouts -> advantages -> (old log-probs) -> PPO epochs -> new weights to the engine.

One step:
1. Rollouts, on every rank (rollout_world.py). The step's prompts (a dataset's next prompts in its
   epoch order, or a built-in task's draw) are spread over the rollout engines, each samples
   `rollout.n` responses per prompt and scores them with the overlong penalty; DAPO dynamic
   sampling (sampling.py) then picks the step's batch from every engine's statistics, and each
   data-parallel (DP) replica receives the samples of its share, computes GRPO/RLOO advantages
   and builds its padded batch (batch.py). The engines then sleep (vLLM frees its memory). With
   trainer offload (training/offload.py) the trainer's states leave the GPU before generation and
   come back once the engines sleep.
2. Decoupled mode: pi_old log-probs by a forward pass before any update (bypass mode skips it).
   MoE: with rollout.routing_replay every trainer forward of the rollouts (pi_old, the reference,
   the updates) routes the recorded tokens to the experts the engine used (training/routing_replay.py);
   the step logs moe/routing_mismatch_fraction, moe/expert_load_max_over_mean (and moe/aux_loss).
3. `ppo_epochs` passes over the batch in mini-batches, one optimizer step each.
4. The updated weights are streamed (model/weight_stream.py) into every rank's engine.
5. Validation on data.val_files (rl/validation.py) with those weights, every trainer.test_freq
   steps and at the last step, logged with the step's metrics; also before training, logged at
   step 0 (trainer.val_before_train, a fresh run only), or only that (trainer.val_only: at the step
   the run starts from, no training). Its samples are seeded by (seed, step, prompt index), so a
   resumed run validates like the uninterrupted one.

Asynchronous RL (rollout.placement: separate, rl/async_rollout.py): the last rollout.num_ranks ranks
of the launch run the rollouts of step 1 instead, for the step S = rollout.max_staleness ahead,
with weights S steps old; this trainer runs on the other ranks with a RolloutClient in place of
an engine: it receives each step's share, sends its weights after each step (after the
checkpoint's save, which keeps the batches in flight), and receives the validation results. The
step logs rollout/staleness_mean and _max (also with rollout.policy_lag) and
timing/wait_for_rollout_s.

Metrics are 0-d tensors until the once-per-step log (rl/step_metrics.py combines a step's). The
settings the trainer reads are `RunSettings` (rl/settings.py). Checkpoints are Megatron-Core
distributed checkpoints (training/checkpoint.py): model, optimizer, scheduler, RNG states, the step
and a dataset's read position, resumable on any parallel layout (training/resume.py; optionally
written in the background: `trainer.async_save`). Prompts are drawn from (seed, step, round) and a prompt's samples from
(seed, step, round, prompt index), so a resumed run repeats the uninterrupted one exactly, and
runs on different layouts sample the same rollouts from the same weights. With `trainer.save_hf` the model is also written as a Hugging Face
checkpoint at the end (model/hf.py).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ..data.tasks import Prompt
from ..parallel.groups import ParallelGroups
from ..rollout import load_model_weights
from ..training import checkpoint
from ..training.offload import TrainerOffload
from ..training.optimizer import build_model_and_optimizer, sync_params
from ..training.reference import ReferencePolicy
from ..training.resume import load_state, resume_step
from ..training.routing_replay import routing_metrics
from ..training.step import (StepBatch, StepConfig, StepCorrection, StepResult, broadcast_from_last_stage,
                             compute_old_log_probs, compute_old_log_probs_and_entropy, old_pass_entropy,
                             step_correction, train_minibatch)
from .advantages import group_advantages
from .async_rollout import RolloutClient, StepRollouts
from .batch import batch_to, build_step_batch, slice_batch
from .dumps import dump_records, gather_and_write
from .kl_reward import KLController, kl_penalised_rewards
from .progress import MetricsLogger
from .rollout_world import share_of_replica
from .sampling import RolloutGroups
from .settings import RunSettings
from .step_metrics import combine_over_updates, rollout_metrics, train_metrics
from .step_sampling import build_generation, rollout_stats
from .validation import validate, write_generations

# RunSettings (rl/settings.py) and combine_over_updates (rl/step_metrics.py) are still importable from here
__all__ = ["RunSettings", "Trainer", "combine_over_updates", "train"]


class Trainer:
    """Builds the model, optimizer, engine and task for `recipe` on the given groups; `run()` trains."""

    def __init__(self, recipe: RunSettings, groups: ParallelGroups) -> None:
        self.recipe, self.groups = recipe, groups
        self.dp_size = recipe.check_layout(dist.get_world_size())
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.run_dir = recipe.run_dir
        self.rank0 = dist.get_rank() == 0
        # rollout.placement separate: the rollout ranks hold the engine and the task (rl/async_rollout.py)
        self.separate = groups.launch is not None
        trainer = recipe.trainer
        self.model, self.optimizer, self.scheduler = build_model_and_optimizer(
            recipe.model, recipe.optim, groups, seed=trainer.seed, total_steps=trainer.steps)
        # model.offload_params / offload_grads, optim.offload_optimizer: the trainer's states leave the GPU
        # while the colocated engine generates (training/offload.py).
        self.offload = TrainerOffload(self.model, self.optimizer, params=recipe.model.offload_params,
                                      grads=recipe.model.offload_grads,
                                      optimizer_states=recipe.optim.offload_optimizer, device=self.device)
        algo = recipe.algorithm
        self.step_cfg = StepConfig(loss=algo.loss, correction=algo.rollout_correction,
                                   micro_batch_size=trainer.micro_batch_size,
                                   max_tokens_per_micro_batch=trainer.max_tokens_per_micro_batch,
                                   temperature=recipe.rollout.temperature or 1.0, kl_loss=algo.kl_loss,
                                   response_limit=recipe.rollout.max_new_tokens,
                                   routing_replay=recipe.rollout.routing_replay,
                                   correction_compile=algo.correction_compile)
        self.reference = (ReferencePolicy(recipe.model, groups, seed=trainer.seed, settings=algo.reference)
                          if algo.uses_reference else None)
        self.kl_controller = KLController(algo.kl_in_reward) if algo.kl_in_reward.enabled else None
        self.writer = checkpoint.CheckpointWriter(async_save=trainer.async_save,
                                                  optimizer_format=trainer.optimizer_checkpoint_format)
        if self.separate:
            self.engine, self.sampler, self.client = None, None, RolloutClient(recipe, groups)
            self.val_task, self.val_prompts = None, list(recipe.data.val_files or [])  # validated over there
            return
        self.client = None
        if groups.rollout_group_size != recipe.rollout.tensor_parallel_size:
            raise ValueError(f"the process groups were built for rollout groups of {groups.rollout_group_size} ranks "
                             f"but rollout.tensor_parallel_size={recipe.rollout.tensor_parallel_size}: build them with "
                             "build_parallel_groups(..., rollout_tp=rollout.tensor_parallel_size)")
        self.engine, self.sampler, self.val_task, self.val_prompts = build_generation(recipe, groups, self.device)

    # ---- the loop -------------------------------------------------------------------------------

    @property
    def data_position(self) -> int:
        """The dataset's read position after the step's prompts (checkpointed); 0 for built-in tasks."""
        return self.client.data_position if self.separate else self.sampler.data_position

    @data_position.setter
    def data_position(self, value: int) -> None:
        if self.separate:
            self.client.data_position = value
        else:
            self.sampler.data_position = value

    def run(self) -> Path:
        trainer = self.recipe.trainer
        start = self._restore_or_start()
        validate_first = trainer.val_only or (start == 0 and trainer.val_before_train and bool(self.val_prompts))
        if self.separate:  # the first weights, and the first batches asked for (rl/async_rollout.py)
            self.client.start(start)
            generate = [] if trainer.val_only else self.client.first_requests(start, trainer.steps)
            self.client.push(self.model, version=start, generate=generate,
                             validate_step=start if validate_first else None,
                             first={"data_position": self.client.next_position, "dp_ranks": self.groups.dp_ranks})
        else:
            self._push_weights()
        logger = MetricsLogger(self.run_dir, trainer.steps, enabled=self.rank0, trackers=trainer.logger,
                               project=trainer.project_name, experiment=trainer.experiment_name or self.recipe.name,
                               config=self.recipe.raw, resume_step=start)
        try:
            if validate_first:
                logger.log(start, self.validate(start))  # before training, on its own record (verl's step 0)
            if trainer.val_only:
                if self.rank0:
                    print(f"trainer.val_only: validated the weights of step {start}; no training", flush=True)
                self._stop_rollouts()
                return self.run_dir
            for step in range(start + 1, trainer.steps + 1):
                metrics = self.train_step(step)
                validating = self.validates_at(step)
                exiting = bool(trainer.exit_interval) and step % trainer.exit_interval == 0
                saving = step == trainer.steps or exiting or (trainer.save_every and step % trainer.save_every == 0)
                if self.separate:  # saved before the new weights go out: rl/async_rollout.py's docstring
                    if saving:  # `latest` moves at writer.poll(), once the step is logged
                        self.save(step, defer_latest=True)
                    metrics.update(self._push_remote(step, validating=validating,
                                                     last=exiting or step == trainer.steps))
                if validating:
                    metrics.update(self.validate(step))
                if step % trainer.log_every == 0 or step == trainer.steps or validating:
                    logger.log(step, metrics)
                if saving and not self.separate:
                    self.save(step)
                self.writer.poll()
                if exiting and step < trainer.steps:
                    if self.rank0:
                        print(f"exit_interval={trainer.exit_interval}: stopping after step {step}; run again "
                              f"to resume from {checkpoint.checkpoint_dir(self.run_dir, step)}", flush=True)
                    break
            self._stop_rollouts()
        except BaseException:
            self.writer.drop_pending()  # a step saved but not logged: resume from the checkpoint before it
            raise
        finally:
            self.writer.close()
            logger.close()
        if trainer.save_hf and start < trainer.steps:
            self.save_hf()
        if self.rank0:
            print(f"metrics: {logger.path}", flush=True)
        return self.run_dir

    # ---- validation -----------------------------------------------------------------------------

    def validates_at(self, step: int) -> bool:
        """In the loop: every trainer.test_freq steps and at the last step (test_freq 0: never)."""
        freq = self.recipe.trainer.test_freq
        return bool(self.val_prompts) and freq > 0 and (step % freq == 0 or step == self.recipe.trainer.steps)

    def validate(self, step: int) -> dict[str, float]:
        """The validation metrics of the engine's current weights (rl/validation.py; collective
        over the world); trainer.log_val_generations records go to val_generations/step_<step>.jsonl.
        The engine and the trainer's states are left as found: with trainer offload the states
        leave the GPU while the engine generates, as for rollouts. With the rollout ranks apart,
        they validated the weights sent after step `step`, and this receives what they found."""
        trainer, rollout = self.recipe.trainer, self.recipe.rollout
        if self.separate:
            found = [self.client.receive_validation() if self.rank0 else None]
            dist.broadcast_object_list(found, src=0)
            metrics, records = found[0]
            if self.rank0 and trainer.log_val_generations:
                write_generations(records, self.run_dir / "val_generations" / f"step_{step}.jsonl")
            return metrics
        t0 = time.perf_counter()
        if self.offload.enabled:
            self.offload.offload()
            self.engine.wake_up(["kv_cache"])
        result = validate(self.engine, self.val_task, self.val_prompts, rollout.val_kwargs,
                          max_new_tokens=rollout.max_new_tokens, groups=self.groups, seed=trainer.seed, step=step,
                          device=self.device, max_records=trainer.log_val_generations)
        if self.offload.enabled:
            self.engine.sleep()
            self.offload.reload()
            self._wake_weights()
        if self.rank0 and trainer.log_val_generations:
            write_generations(result.records, self.run_dir / "val_generations" / f"step_{step}.jsonl")
        return {**result.metrics, "timing/val_s": time.perf_counter() - t0}

    def _wake_weights(self) -> None:
        """After a sleep, the weights as _push_weights left them (the KV cache stays asleep): vLLM's
        sleep level 2 dropped them, so they are streamed again; level 1 kept them in host memory.
        (The embedded engine never sleeps: a second load would also shift its policy-lag history.)"""
        rollout = self.recipe.rollout
        if rollout.engine == "vllm" and rollout.sleep_level == 2:
            self._push_weights()
        else:
            self.engine.wake_up(["weights"])

    def train_step(self, step: int) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        if self.separate:
            batch, rewards_B, sums, share, data_metrics, remote_metrics = self._remote_rollouts(step)
        else:
            step_prompts, data_metrics = self.sampler.step_prompts()
            age = getattr(self.engine, "weights_age", 0)  # rollout.policy_lag: the emulated staleness
            batch, rewards_B, sums, share = self.rollouts(step, step_prompts)
            remote_metrics = ({"rollout/staleness_mean": torch.tensor(float(age)),
                               "rollout/staleness_max": torch.tensor(float(age))} if self.recipe.rollout.policy_lag
                              else {})
        t_gen = time.perf_counter()
        old_log_probs, ref_log_probs, correction, step_metrics = self._before_updates(batch)
        dump_every = self.recipe.trainer.dump_every
        if dump_every and step % dump_every == 0:
            self._dump(step, share, batch, old_log_probs, rewards_B)
        if self.kl_controller is not None and ref_log_probs is not None:  # the last pipeline stage
            batch, kl_metrics = self._kl_in_reward(batch, rewards_B, old_log_probs, ref_log_probs)
            step_metrics.update(kl_metrics)
        step_metrics = broadcast_from_last_stage(step_metrics, self.groups, self.device)
        results = self._update(batch, old_log_probs, ref_log_probs, correction)
        # MoE: routing mismatch, expert load, aux loss of the step's passes (one collective; dense: none)
        moe_metrics = routing_metrics(self.model, self.groups, self.device)
        self.scheduler.step(increment=1)  # once per RL step: every update of the step had its lr
        t_train = time.perf_counter()
        if not self.separate:  # separate: run() sends them, after a checkpoint's save
            self._push_weights()
        t_end = time.perf_counter()
        metrics = {**rollout_metrics(sums), **train_metrics(results), **step_metrics, **moe_metrics, **data_metrics}
        gen_s = remote_metrics.pop("timing/gen_s", t_gen - t0)
        metrics.update({"timing/gen_s": gen_s, "timing/train_s": t_train - t_gen,
                        "timing/weight_sync_s": t_end - t_train, "timing/step_s": t_end - t0,
                        "throughput/tokens_per_s": sums["all_tokens"] / (t_end - t0),
                        "throughput/gen_tokens_per_s": sums["generated_tokens"] / max(gen_s, 1e-9),
                        **remote_metrics})
        return metrics

    def _remote_rollouts(self, step: int):
        """rollouts() with the rollout ranks apart: the step's batch as they sent it, its data
        metrics, and the staleness and waiting time of the step."""
        t0 = time.perf_counter()
        remote: StepRollouts = self.client.receive()
        waited = time.perf_counter() - t0
        assert remote.step == step, f"received the rollouts of step {remote.step} for step {step}"
        staleness_B = remote.staleness(step - 1)  # the trainer's policy is the one after step - 1
        assert float(staleness_B.max()) <= self.recipe.rollout.staleness, (step, remote.policy_version)
        batch, rewards_B, sums, share = self._replica_batch(step, remote.share, dict(remote.sums))
        metrics = {"rollout/staleness_mean": staleness_B.mean(), "rollout/staleness_max": staleness_B.max(),
                   "timing/wait_for_rollout_s": torch.tensor(waited), "timing/gen_s": remote.gen_s}
        return batch, rewards_B, sums, share, remote.data_metrics, metrics

    def _push_remote(self, step: int, *, validating: bool, last: bool) -> dict[str, torch.Tensor]:
        """After step `step`, with the rollout ranks apart: the new weights out, the batch of step
        + S + 1 asked for (none after the run's last step), a validation asked for when due."""
        t0 = time.perf_counter()
        generate = self.client.requests_after(step, self.recipe.trainer.steps, last=last)
        if generate or validating:
            self.client.push(self.model, version=step, generate=generate, validate_step=step if validating else None)
        return {"timing/weight_sync_s": torch.tensor(time.perf_counter() - t0)}

    def _stop_rollouts(self) -> None:
        if self.separate:
            self.client.stop()

    def _before_updates(self, batch: StepBatch):
        """pi_old and the reference's log-probs (forward-only passes), and the decoupled rollout
        correction over the whole step batch; on the last pipeline stage (None elsewhere)."""
        cfg = self.step_cfg
        old = ref = correction = entropy = None
        metrics: dict[str, torch.Tensor] = {}
        if cfg.correction.needs_old_log_prob_pass:  # (bypass mode: actor/entropy from the update, with entropy_coeff)
            old, entropy = compute_old_log_probs_and_entropy(
                self.model, batch, groups=self.groups, micro_batch_size=cfg.micro_batch_size,
                temperature=cfg.temperature, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                routing_replay=cfg.routing_replay, routing_metrics=True)
        if self.reference is not None:  # replays too (training/step.py's docstring says why)
            ref = self.reference.log_probs(batch, micro_batch_size=cfg.micro_batch_size, temperature=cfg.temperature,
                                           max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                                           routing_replay=cfg.routing_replay)
        if old is not None:
            correction, metrics = step_correction(old, batch, cfg.correction, self.groups,
                                                  correction_compile=cfg.correction_compile)
            metrics = {**metrics, "actor/entropy": old_pass_entropy(entropy, batch, cfg, self.groups)}
        return old, ref, correction, dict(metrics)

    def _dump(self, step: int, share: RolloutGroups, batch: StepBatch, old_log_probs: torch.Tensor | None,
              rewards_B: torch.Tensor) -> None:
        """The step's rollouts with the trainer's log-probs to <run_dir>/dumps (rl/dumps.py);
        collective over the world (bypass mode runs the pi_old pass here, for the dump only)."""
        cfg, groups = self.step_cfg, self.groups
        if not cfg.correction.needs_old_log_prob_pass:  # (None on the other pipeline stages either way)
            old_log_probs = compute_old_log_probs(self.model, batch, groups=groups,
                                                  micro_batch_size=cfg.micro_batch_size, temperature=cfg.temperature,
                                                  max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                                                  routing_replay=cfg.routing_replay)
        holder = groups.is_pipeline_last_stage() and groups.tp_rank == 0 and groups.cp_rank == 0
        limit = -(-self.recipe.trainer.dump_max_samples // groups.dp_size)
        records = dump_records(share, old_log_probs, rewards_B, step=step, limit=limit) if holder else None
        gather_and_write(records, self.run_dir, step)

    def _kl_in_reward(self, batch: StepBatch, rewards_B: torch.Tensor, old_log_probs: torch.Tensor | None,
                      ref_log_probs: torch.Tensor) -> tuple[StepBatch, dict[str, torch.Tensor]]:
        """The batch with advantages from KL-penalised rewards (the last pipeline stage's view; the
        loss is computed there only)."""
        algo = self.recipe.algorithm
        device = ref_log_probs.device
        log_probs = old_log_probs if old_log_probs is not None else batch.rollout_log_probs_BT.to(device)
        mask_BT = batch.response_mask_BT.to(device)
        penalised_B, metrics = kl_penalised_rewards(rewards_B.to(device), log_probs, ref_log_probs, mask_BT,
                                                    self.kl_controller, self.groups.dp)
        advantages_B = group_advantages(penalised_B.float().reshape(-1, self.recipe.rollout.n),
                                        algo.advantage_estimator, algo.norm_adv_by_std).reshape(-1)
        advantages_BT = advantages_B[:, None] * mask_BT
        return dataclasses.replace(batch, advantages_BT=advantages_BT.to(batch.advantages_BT.device)), metrics

    def rollouts(self, step: int, step_prompts: list[Prompt] | None = None
                 ) -> tuple[StepBatch, torch.Tensor, dict[str, torch.Tensor], RolloutGroups]:
        """This DP replica's StepBatch and per-sequence rewards (identical on its TP/CP/PP ranks),
        the rollout statistics of the step's whole batch, and the replica's share of the rollouts."""
        if self.offload.enabled:  # the trainer's states leave before the engine's KV cache comes back
            self.offload.offload()
            self.engine.wake_up(["kv_cache"])
        batch, first, stats, dropped, generated_tokens = self.sampler.sample_step(step, step_prompts)
        self.engine.sleep()  # the trainer needs the memory now
        self.offload.reload()
        share = share_of_replica(batch, self.groups, device=self.device)
        return self._replica_batch(step, share, rollout_stats(batch, first, stats, dropped, generated_tokens))

    def _replica_batch(self, step: int, share: RolloutGroups, sums: dict[str, torch.Tensor]
                       ) -> tuple[StepBatch, torch.Tensor, dict[str, torch.Tensor], RolloutGroups]:
        """The replica's StepBatch from its share of the step's rollouts, with advantages; the
        step's rollout statistics `sums` completed with the invalid tokens of every replica."""
        algo = self.recipe.algorithm
        advantages_B = group_advantages(share.rewards_GN, algo.advantage_estimator, algo.norm_adv_by_std).reshape(-1)
        step_batch, invalid = build_step_batch(share, advantages_B)
        invalid = invalid.to(self.device, torch.float64)
        dist.all_reduce(invalid, group=self.groups.dp)
        sums["invalid_tokens"] = invalid.cpu()
        sampling = algo.dynamic_sampling
        if sampling.on_exhausted == "error" and bool(sums["exhausted"]):  # the same decision on every rank
            raise RuntimeError(f"step {step}: dynamic sampling reached max_num_gen_batches="
                               f"{sampling.max_num_gen_batches} before finding data.prompts_per_step informative "
                               "groups (algorithm.dynamic_sampling.on_exhausted: error, verl's behaviour). The data "
                               "may be too hard or too easy for the policy: raise max_num_gen_batches (0 = no "
                               "limit), or set on_exhausted: fill to complete the batch with inert groups")
        return batch_to(step_batch, self.device), share.rewards_GN.reshape(-1).double(), sums, share

    def _update(self, batch: StepBatch, old_log_probs: torch.Tensor | None, ref_log_probs: torch.Tensor | None,
                correction: StepCorrection | None) -> list[StepResult]:
        trainer, n = self.recipe.trainer, self.recipe.rollout.n
        per_rank = batch.tokens_BT.shape[0]
        mini = trainer.mini_batch_prompts * n // self.dp_size if trainer.mini_batch_prompts else per_rank

        def rows(x, start):
            return None if x is None else (x.rows(start, start + mini) if isinstance(x, StepCorrection)
                                           else x[start:start + mini])

        results = []
        for _ in range(trainer.ppo_epochs):
            for start in range(0, per_rank, mini):
                results.append(train_minibatch(self.model, self.optimizer, slice_batch(batch, start, start + mini),
                                               groups=self.groups, cfg=self.step_cfg,
                                               old_log_probs=rows(old_log_probs, start),
                                               ref_log_probs=rows(ref_log_probs, start),
                                               correction=rows(correction, start)))
        return results

    def _push_weights(self) -> None:
        """Stream the weights into every rank's engine (model/weight_stream.py: collective over
        TP and PP, every rank with expert parallelism), waking its memory first: the weights' before loading, the KV cache's after (with
        trainer offload: at the next generation, once the trainer's states have left)."""
        sync_params(self.model)
        load_model_weights(self.engine, self.recipe.rollout, self.model, self.groups)
        if not self.offload.enabled:
            self.engine.wake_up(["kv_cache"])

    # ---- checkpoints ----------------------------------------------------------------------------

    def save(self, step: int, defer_latest: bool = False) -> Path:
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "recipe.yaml").write_text(yaml.safe_dump(self.recipe.raw, sort_keys=False))
        sync_params(self.model)
        if self.separate:  # the batches asked for, generated with older weights than these: saved beside them
            self.client.receive_ahead()
        common = {"step": step, "data_position": self.data_position,
                  "kl_controller": None if self.kl_controller is None else self.kl_controller.state_dict(),
                  "recipe": self.recipe.raw}
        return self.writer.save(self.run_dir, step, model_chunks=self.model, optimizer=self.optimizer,
                                scheduler=self.scheduler, groups=self.groups, common=common, layout=self._layout(),
                                extra=self.client.save_inflight if self.separate else None,
                                defer_latest=defer_latest)

    def _layout(self) -> dict:
        return self.recipe.parallel.layout(dist.get_world_size())

    def save_hf(self) -> Path:
        """The trained model as a Hugging Face checkpoint in <run_dir>/hf (collective)."""
        from ..model.hf import export_hf

        out = self.run_dir / "hf"
        sync_params(self.model)
        dtype = torch.bfloat16 if self.recipe.trainer.save_hf_dtype == "bfloat16" else torch.float32
        export_hf(self.model, self.groups, out, self.recipe.model, dtype=dtype, tokenizer_dir=self.recipe.data.tokenizer)
        if self.rank0:
            print(f"hugging face checkpoint: {out}", flush=True)
        return out

    def _restore_or_start(self) -> int:
        """The step to continue from: the latest checkpoint's with trainer.resume, else 0 (training/resume.py)."""
        latest = resume_step(self.run_dir, self.recipe.trainer.resume)
        if latest is None:
            return 0
        state = load_state(self.run_dir, latest, model_chunks=self.model, optimizer=self.optimizer,
                           scheduler=self.scheduler, groups=self.groups, layout=self._layout(),
                           distributed_optimizer=self.recipe.optim.use_distributed_optimizer)
        directory = checkpoint.checkpoint_dir(self.run_dir, latest)
        self.data_position = state.get("data_position", 0)  # checkpoints before datasets start over
        if self.separate:
            self.client.load_inflight(directory)
        if self.kl_controller is not None and state.get("kl_controller") is not None:
            self.kl_controller.load_state_dict(state["kl_controller"])
        if self.rank0:
            print(f"resumed from {directory} (step {latest})", flush=True)
        return latest


def train(recipe: RunSettings, groups: ParallelGroups) -> Path:
    """Train `recipe` on the given groups (process group and Megatron groups already built)."""
    return Trainer(recipe, groups).run()
