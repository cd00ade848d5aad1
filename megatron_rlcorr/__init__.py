"""megatron-rlcorr: RL post-training on Megatron-Core with exact rollout correction.

Importing this package (or `megatron_rlcorr.correction`) never imports megatron, Transformer
Engine or vLLM.
"""
__version__ = "0.1.0"
