"""megatron_ngrpo: N-GRPO (semantic neighbour mixing for GRPO) on megatron-core."""

__version__ = "0.1.0"
