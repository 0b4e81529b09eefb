"""HF ↔ Megatron checkpoint conversion for Qwen2, Llama and Qwen3, any TP/PP/VPP layout.

- :mod:`.mapping`: THE name/shape mapping (rules, fuse/split over TP, a model chunk's parameters).
- :mod:`.hf_import`: HF tensors -> this rank's Megatron tensors (``hf_to_megatron``,
  ``load_hf_tensors``).
- :mod:`.hf_export`: Megatron -> HF tensors (``export_hf_tensors`` — the streaming export used by
  live weight sync, gathered or as vLLM's TP shards).
- :mod:`.hf_io`: HF directories (lazy ``HFCheckpoint``, sharded writer, ``load_hf_into_megatron``,
  ``save_hf_checkpoint``).
- :mod:`.checkpoint`: the Megatron checkpoint layout (``checkpoint_meta``,
  ``save_megatron_checkpoint``, ``load_megatron_checkpoint``, ``resolve_checkpoint``,
  ``write_latest``).
- :mod:`.convert`: whole-checkpoint conversion (``convert_hf_to_megatron``,
  ``convert_megatron_to_hf``) behind ``tools/convert_*.py``.
"""
