"""The policy model. Its modules import one way: the architecture (architecture), config.json <->
architecture (hf_config) and the published architectures (presets), the recipe's settings
(config), the neutral weight names and their Megatron shards (weights), Hugging Face tensor names,
reading and writing (hf), then Megatron-Core model building (build) and the plain-torch reference
forward (reference). Importing this package does not import Megatron-Core."""
