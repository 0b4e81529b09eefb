"""The vLLM worker extension of a rollout server (``vllm serve --worker-extension-cls
megatron_ngrpo.rollout.remote.server_worker.RolloutServerExtension``, set by
:mod:`megatron_ngrpo.rollout.remote.server`).

It adds to the mixing hook's :class:`~megatron_ngrpo.rollout.vllm.hook.NeighborMixExtension` the
methods the trainer's rollout client calls through vLLM's ``POST /collective_rpc`` route
(``VLLM_SERVER_DEV_MODE=1``). That route passes string arguments only and returns JSON, so
tensors travel as base64 safetensors bytes (:func:`megatron_ngrpo.rollout.vllm.wire.pack_tensors`).
Every worker of the server's TP group runs each call.

vLLM imports this module in every worker process before it builds the worker's weight-transfer
engine, so importing it registers the project's ``gloo`` and proven ``nccl`` engines there: a server's workers are
spawned, not forked, and would not know an engine registered in the launcher's process.
"""

from __future__ import annotations

import base64

import torch

from megatron_ngrpo.mixing.perturbations import NoiseSpec
from megatron_ngrpo.rollout.remote.auth import read_secret
from megatron_ngrpo.rollout.vllm import wire
from megatron_ngrpo.rollout.vllm.buckets import (
    WeightSyncError,
    begin_reload,
    end_reload,
    load_bucket,
)
from megatron_ngrpo.rollout.vllm.hook import NeighborMixExtension, NeighborMixRunner
from megatron_ngrpo.rollout.vllm.nccl_transfer import http_proof, worker_rank
from megatron_ngrpo.rollout.vllm.weight_transfer import register

register()


class RolloutServerExtension(NeighborMixExtension):
    """``nbr_server_*`` methods of a rollout server's workers (string arguments, JSON results)."""

    def nbr_server_info(self) -> dict:
        """What the client checks before training: the hook, the wire protocol, the model."""
        runner = self.model_runner
        cfg = runner.vllm_config
        hf = cfg.model_config.hf_config
        state = getattr(runner, "_nm", None)
        return {
            "protocol": wire.PROTOCOL,
            "hook": type(runner).__name__ if isinstance(runner, NeighborMixRunner) else None,
            "num_real_tokens": None if state is None else state.num_real_tokens,
            "vocab_size": hf.vocab_size,
            "hidden_size": hf.hidden_size,
            "max_model_len": cfg.model_config.max_model_len,
            "tensor_parallel": cfg.parallel_config.tensor_parallel_size,
            "weight_transfer": None
            if cfg.weight_transfer_config is None
            else cfg.weight_transfer_config.backend,
            "table_version": getattr(self, "_nbr_table_version", None),
            "weight_push_held_bytes": getattr(self, "_nbr_held_bytes", 0),
        }

    def nbr_server_prove(self, nonce: str) -> list:
        """``[rank, proof]``: this worker's rank in the ``nccl`` transfer group and its answer to
        the trainer's challenge ``nonce`` (hex), made with the job's secret the server was
        started with (rollout/vllm/nccl_transfer.py); the trainer sends the NCCL unique id only
        once every worker answered right."""
        rank = worker_rank(self.model_runner.vllm_config.parallel_config, 1)
        return [rank, http_proof(read_secret(), bytes.fromhex(nonce), rank).hex()]

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
        emb = next(
            m
            for m in self.model_runner.get_model().modules()
            if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
        )
        group = get_tp_group()
        state.noise = NoiseSpec.from_embedding(
            emb.weight,
            state.num_real_tokens,
            float(scale),
            emb.shard_indices.org_vocab_start_index,
            group.device_group if group.world_size > 1 else None,
        )
        return [state.noise.sigma, state.noise.dim]

    def nbr_server_receive(self, data: str, index: str, last: str) -> dict:
        """Bucket ``index`` of a weight sync: HF-named tensors (base64 ``pack_tensors`` bytes;
        with digests, each tensor is checked), loaded as it arrives inside vLLM's layerwise
        reload (opened by bucket 0, closed by the last one, ``last == "1"``): a worker holds one
        bucket of the push, never the whole model (``held_bytes``: the largest bucket so far)."""
        runner = self.model_runner
        model = runner.get_model()
        if index == "0":
            if getattr(self, "_nbr_reloading", False):  # an earlier sync stopped half-way
                end_reload(model, runner.model_config)
            begin_reload(model)
            self._nbr_reloading, self._nbr_tensors, self._nbr_verified = True, 0, 0
        elif not getattr(self, "_nbr_reloading", False):
            raise WeightSyncError(f"weight sync: bucket {index} arrived without bucket 0")
        raw = base64.b64decode(data)
        data = None  # the base64 text is dropped before the tensors are unpacked
        tensors, expected = wire.unpack_tensors(raw)
        self._nbr_held_bytes = max(getattr(self, "_nbr_held_bytes", 0), len(raw))
        raw = None
        bad = wire.first_mismatch(tensors.items(), expected)
        try:
            if bad:
                raise WeightSyncError(bad)
            load_bucket(model, list(tensors.items()))
        except BaseException:
            self._nbr_reloading = False
            end_reload(model, runner.model_config)  # untouched layers keep their weights
            raise
        self._nbr_tensors += len(tensors)
        self._nbr_verified += len(expected)
        if last != "1":
            return {"tensors": self._nbr_tensors}
        self._nbr_reloading = False
        end_reload(model, runner.model_config)
        runner.reset_encoder_cache()  # as vLLM's reload_weights does after a reload
        runner.reset_mm_cache()
        return {"tensors": self._nbr_tensors, "verified": self._nbr_verified}
