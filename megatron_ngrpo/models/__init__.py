"""Megatron GPTModel providers for the supported Hugging Face architectures."""
