"""The policy model: settings (config), Megatron-Core model building (build), weights in the
neutral naming and their Megatron shards (weights), and the plain-torch reference forward
(reference). Importing this package does not import Megatron-Core."""
