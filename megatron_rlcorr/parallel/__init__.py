"""Parallelism: the `parallel:` settings (layout), process groups (groups), the CP data layout
(context), CP attention without Transformer Engine (cp_attention), and the CPU/gloo path for
Megatron-Core (cpu)."""
