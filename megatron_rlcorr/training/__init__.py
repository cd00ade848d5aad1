"""One optimizer step of the policy on Megatron-Core: log-probs from vocabulary-parallel logits
(logprobs), policy losses with global normalisers (losses), the step over the pipeline schedule
with the rollout correction (step; its types step_types, the micro-batch cut local_batch, the
schedule schedule, the forward-only pi_old pass old_pass, the update's metrics update_metrics),
Megatron's DDP/optimizer/scheduler (optimizer), and checkpoints (checkpoint; resuming a run:
resume)."""
