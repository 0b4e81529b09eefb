"""The vLLM worker extension of a rollout server (``vllm serve --worker-extension-cls
megatron_ngrpo.rollout.remote.server_worker.RolloutServerExtension``, set by
:mod:`megatron_ngrpo.rollout.remote.server`).

It adds to the mixing hook's :class:`~megatron_ngrpo.rollout.vllm.hook.NeighborMixExtension` the
methods the trainer's rollout client calls through vLLM's ``POST /collective_rpc`` route
(``VLLM_SERVER_DEV_MODE=1``). That route passes string arguments only and returns JSON, so
tensors travel as base64 safetensors bytes (:func:`megatron_ngrpo.rollout.vllm.wire.pack_tensors`).
Every worker of the server's TP group runs each call.

vLLM imports this module in every worker process before it builds the worker's weight-transfer
engine, so importing it registers the project's ``gloo`` engine there: a server's workers are
spawned, not forked, and would not know an engine registered in the launcher's process.
"""

from __future__ import annotations

import base64

import torch

from megatron_ngrpo.mixing.perturbations import NoiseSpec
from megatron_ngrpo.rollout.vllm import wire
from megatron_ngrpo.rollout.vllm.hook import NeighborMixExtension, NeighborMixRunner
from megatron_ngrpo.rollout.vllm.weight_transfer import WeightSyncError, register

register()


class RolloutServerExtension(NeighborMixExtension):
    """``nbr_server_*`` methods of a rollout server's workers (string arguments, JSON results)."""

    def nbr_server_info(self) -> dict:
        """What the client checks before training: the hook, the wire protocol, the model."""
        runner = self.model_runner
        cfg = runner.vllm_config
        hf = cfg.model_config.hf_config
        state = getattr(runner, "_nm", None)
        return {"protocol": wire.PROTOCOL,
                "hook": type(runner).__name__ if isinstance(runner, NeighborMixRunner) else None,
                "num_real_tokens": None if state is None else state.num_real_tokens,
                "vocab_size": hf.vocab_size, "hidden_size": hf.hidden_size,
                "max_model_len": cfg.model_config.max_model_len,
                "tensor_parallel": cfg.parallel_config.tensor_parallel_size,
                "weight_transfer": None if cfg.weight_transfer_config is None else cfg.weight_transfer_config.backend,
                "table_version": getattr(self, "_nbr_table_version", None)}

    def nbr_server_set_table(self, data: str, version: str) -> str:
        """Install the trainer's ``[V, k]`` neighbour table (``data``: base64 of
        :func:`~megatron_ngrpo.rollout.vllm.wire.pack_tensors` bytes with one tensor ``table``) of
        weight version ``version``."""
        tensors, _ = wire.unpack_tensors(base64.b64decode(data))
        state = self.model_runner._nm
        state.table = tensors["table"].to(device=state.device, dtype=torch.long)
        self._nbr_table_version = int(version)
        return version

    def nbr_server_set_noise(self, scale: str) -> list:
        """STHT noise ``σ = scale × RMS`` of the real rows of this server's input embedding
        (vocab-parallel: one all-reduce over vLLM's TP group); ``""`` removes it. Returns
        ``[σ, d]`` or ``[]``."""
        # lazy: vLLM is an optional extra (heavy import)
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        state = self.model_runner._nm
        if not scale:
            state.noise = None
            return []
        emb = next(m for m in self.model_runner.get_model().modules()
                   if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead))
        group = get_tp_group()
        state.noise = NoiseSpec.from_embedding(
            emb.weight, state.num_real_tokens, float(scale), emb.shard_indices.org_vocab_start_index,
            group.device_group if group.world_size > 1 else None)
        return [state.noise.sigma, state.noise.dim]

    def nbr_server_receive(self, data: str, index: str, last: str) -> dict:
        """Bucket ``index`` of a weight sync: HF-named tensors (base64 ``pack_tensors`` bytes;
        with digests, each tensor is checked); the last one (``last == "1"``) loads them all into
        the model with vLLM's ``reload_weights``."""
        tensors, expected = wire.unpack_tensors(base64.b64decode(data))
        if index == "0" or not hasattr(self, "_nbr_bucket"):
            self._nbr_bucket, self._nbr_verified = [], 0
        bad = wire.first_mismatch(tensors.items(), expected)
        if bad:
            self._nbr_bucket, self._nbr_verified = [], 0
            raise WeightSyncError(bad)
        self._nbr_bucket += tensors.items()
        self._nbr_verified += len(expected)
        if last != "1":
            return {"tensors": len(self._nbr_bucket)}
        named, verified = self._nbr_bucket, self._nbr_verified
        self._nbr_bucket, self._nbr_verified = [], 0
        self.reload_weights(weights_iterator=iter(named))
        return {"tensors": len(named), "verified": verified}
