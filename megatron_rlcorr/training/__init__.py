"""One optimizer step of the policy on Megatron-Core: log-probs from vocabulary-parallel logits
(logprobs), policy losses with global normalisers (losses), the step over the pipeline schedule
with the rollout correction (step), Megatron's DDP/optimizer/scheduler (optimizer), and
checkpoints (checkpoint)."""
