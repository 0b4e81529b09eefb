"""Compatibility layers (CPU redirection of megatron-core's CUDA calls)."""
