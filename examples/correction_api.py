"""Runnable example of the public API (README): one call on a padded batch, then on a packed one."""
import torch

from megatron_rlcorr.config import RolloutCorrectionConfig
from megatron_rlcorr.correction import compute_rollout_correction

torch.manual_seed(0)
B, T = 4, 16
rollout_log_prob = -torch.rand(B, T) * 3                    # what the rollout engine reported
old_log_prob = rollout_log_prob + 0.05 * torch.randn(B, T)  # the trainer's recomputation
response_mask = (torch.arange(T) < torch.tensor([[16], [9], [12], [3]])).float()

cfg = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0,
                              rollout_is_batch_normalize=True,
                              rollout_rs="geometric", rollout_rs_threshold=1.01,
                              rollout_rs_threshold_lower=0.99,
                              rollout_token_veto_threshold=1e-4)
out = compute_rollout_correction(old_log_prob, rollout_log_prob, response_mask, cfg)
print("IS weight per sequence:", out.is_weights[:, 0])
print("tokens kept per sequence:", out.response_mask.sum(-1))
for name in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction", "rollout_corr/kl"):
    print(f"{name} = {out.metrics[name]:.5f}")

# The same sequences packed into one row, with cu_seqlens giving each span.
lengths = response_mask.sum(-1).long()
valid = response_mask.bool()
cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
packed = compute_rollout_correction(old_log_prob[valid], rollout_log_prob[valid],
                                    torch.ones(int(lengths.sum())), cfg, cu_seqlens=cu_seqlens)
assert torch.allclose(packed.is_weights, out.is_weights[valid])
print("packed layout agrees with padded")
