"""The Megatron side of parallelism: process groups, the CP data layout, CPU support."""
