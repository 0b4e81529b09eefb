"""Rollout engine on vLLM 0.32 (V1 model runner) with semantic-neighbour mixing.

:class:`VLLMEngine` implements :class:`~megatron_ngrpo.rollout.types.RolloutEngine` on one
``vllm.LLM`` that carries the mixing hook of :mod:`megatron_ngrpo.rollout.vllm.hook`:

* ``generate`` sends one request per prompt (``n`` children each) opted in with
  ``SamplingParams(extra_args={"nbr_mix": ...})``, ``logprobs=0`` and the hook's log-prob
  conversion (``logprobs_mode="raw_logits"`` → ``log_softmax(logits / T)`` of the full
  distribution, T = 1 for greedy; see the hook's docstring), then pops the hook's records by RPC
  and returns one :class:`~megatron_ngrpo.mixing.records.MixRecord` for the batch (sequence index
  = response index, prompt-major; children by ``CompletionOutput.index``; positions relative to
  the response). Gate keys: ``rollout.types.response_key``, as in the Megatron engine.
* The neighbour table (``mixing.neighbors.build_neighbor_table``) is computed here, on the full
  HF matrix (input embedding or output layer per ``neighbor_source``, padded rows
  ``>= num_real_tokens`` and special ids excluded), from the checkpoint at start-up and from the
  synced tensors after every ``sync_weights``, then sent to the workers; or, when ``resolve_mode``
  (mixing/neighbor_mode.py) says "on_demand", each worker searches the rows of the anchors it
  mixes in its own vocab shard of vLLM's weights (``NeighborLookup`` over vLLM's TP group, cached until
  the next weight load; equal to the table of those weights).
* ``sync_weights(model_chunks)`` gathers the Megatron shards with HF names
  (``conversion.hf_export.export_hf_tensors``, one parameter at a time) and loads them into the
  live engine by ``cfg.weight_transfer``: ``gloo`` / ``ipc`` / ``nccl`` through vLLM's
  weight-transfer API in buckets of ``sync_bucket_mb``
  (:mod:`~megatron_ngrpo.rollout.vllm.weight_transfer`; ``verify_weights``: SHA-256 per tensor on the
  gloo route); ``reload`` (the fallback): when the worker lives in this process (``in_process``
  and TP = 1, or colocated), ``collective_rpc("reload_weights", weights_iterator=...)`` (tensors
  passed by reference); with worker processes, a safetensors directory (``weights_path``; RPC
  arguments must be msgspec-serialisable, tensors are not). Seconds, parameters, bytes (and
  buckets) are in :attr:`VLLMEngine.last_sync`.
* Strategies: ``neighbor`` (N-GRPO) and the baselines ``soft_thinking`` / ``stht`` / ``gumbel``
  (``mixing.perturbations``); the STHT noise scale is computed here from the input embedding.
* The hook never samples ids ``>= num_real_tokens`` and normalises log-probs over the real ids,
  like the Megatron engine: the trainer replays them with ``vocab_limit=num_real_tokens``
  (``grpo.logprobs.batch_logprobs``). ``mixing.stop_after`` is matched on its token ids (the
  Megatron engine matches decoded text; they agree when the text is one token, e.g.
  ``"</think>"`` in R1-Distill-Qwen).

Engine settings (prefix caching, async scheduling, the model runner, worker processes):
:mod:`~megatron_ngrpo.rollout.vllm.llm`, which builds the ``vllm.LLM``. Per-request vLLM seeds
are not passed: on CPU a seeded request whose prefill is chunked crashes vLLM 0.32 ("CPU
Generator does not use offset"); ``SamplingParams.seed`` seeds the mixing gate only.

GPU weight sync (not run here): ``ipc`` (colocated) and ``nccl`` are vLLM's own engines on the
same sender as ``gloo``; ``reload`` passes CUDA tensors straight into ``reload_weights``
in-process, and goes through the file system (``/dev/shm`` when present) across processes.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_ngrpo import config_loader
from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.atomic import atomic_file
from megatron_ngrpo.conversion.hf_export import export_hf_tensors
from megatron_ngrpo.conversion.hf_io import HFCheckpoint
from megatron_ngrpo.data.tokenizer import engine_tokenizer, special_token_ids
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.neighbor_mode import resolve_mode
from megatron_ngrpo.mixing.neighbors import build_neighbor_table, exclusion_mask
from megatron_ngrpo.mixing.perturbations import NoiseSpec
from megatron_ngrpo.models.config import real_token_count
from megatron_ngrpo.rollout.config import VLLMConfig, vllm_max_model_len
from megatron_ngrpo.rollout.types import (
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    active_mixing,
    validate_request,
)
from megatron_ngrpo.rollout.vllm.llm import build_llm, tp_shards_for
from megatron_ngrpo.rollout.vllm.protocol import (
    hook_mix_record,
    request_options,
    sampling_options,
)
from megatron_ngrpo.rollout.vllm.replicas import generate_on_replicas

logger = logging.getLogger(__name__)

EMBED_NAME = "model.embed_tokens.weight"
OUTPUT_NAME = "lm_head.weight"
# MixingConfig fields the table / noise spec depend on.
_TABLE_FIELDS = (
    "strategy",
    "k",
    "metric",
    "neighbor_source",
    "exclude_special",
    "exclude_padded",
    "exclude_ids",
    "noise_scale",
    "chunk_size",
)


class VLLMEngine(RolloutEngine):
    """A live vLLM engine on the HF checkpoint ``hf_path``.

    Args:
        hf_path: directory with config.json and safetensors weights (and tokenizer files, if any).
        cfg: construction options (:class:`~megatron_ngrpo.rollout.config.VLLMConfig`).
        num_real_tokens: ids ``>=`` this are never sampled, anchors or neighbours (default: the
            tokenizer's id count, or the HF vocab size without a tokenizer).
        tokenizer: tokenizer directory (default ``hf_path`` when it has tokenizer files; without
            one, no texts, stop strings or ``stop_after``).
        seed: vLLM's engine seed (sampling draws; the mixing gate uses ``SamplingParams.seed``).
    """

    neighbors_on_demand = True

    def __init__(
        self,
        hf_path: str | Path,
        cfg: VLLMConfig | None = None,
        *,
        num_real_tokens: int | None = None,
        tokenizer: str | Path | None = None,
        seed: int = 0,
    ):

        self.cfg = cfg or VLLMConfig()
        config_loader.validate(self.cfg)
        self.hf_path = str(hf_path)
        self.spec = ArchSpec.from_hf(self.hf_path)
        self.tokenizer = engine_tokenizer(tokenizer, self.hf_path)
        self.num_real_tokens = real_token_count(
            num_real_tokens, self.spec.vocab_size, self.tokenizer
        )
        self.special_ids = special_token_ids(self.tokenizer)
        self.max_model_len = vllm_max_model_len(
            self.cfg, self.spec.max_position_embeddings, "max_model_len"
        )
        self.last_sync: dict = {}
        self._sources: dict[str, torch.Tensor] = {}  # HF name → current matrix for the table
        self._table_key = None
        self._table_mixing: MixingConfig | None = None
        self._table_lookup = "table"  # the neighbour rows' lookup_mode of _table_mixing
        self._sync_dir: tempfile.TemporaryDirectory | None = None
        self._trainer_table: torch.Tensor | None = None
        self._sender = None  # rollout.weight_transfer.WeightSender, built on the first push
        # Colocated in a multi-rank job: one vLLM worker per rank (external_launcher), vLLM TP over
        # consecutive blocks of ranks; every rank builds its engine at the same point.
        self.colocated = dist.is_initialized() and dist.get_world_size() > 1
        self.llm = build_llm(
            self.cfg,
            self.hf_path,
            self.tokenizer,
            self.max_model_len,
            self.num_real_tokens,
            self.colocated,
            seed,
        )
        self.tp_shards = tp_shards_for(self.llm, self.spec, self.cfg, self.colocated)

    @classmethod
    def from_config(cls, rollout_cfg, model_cfg, **kwargs) -> VLLMEngine:
        """The engine of ``rollout_cfg.vllm`` for the policy of ``model_cfg`` (its HF directory
        and ``num_real_tokens``); kwargs as in the constructor."""
        return cls(
            model_cfg.hf_path, rollout_cfg.vllm, num_real_tokens=model_cfg.num_real_tokens, **kwargs
        )

    def close(self) -> None:
        """Shut the engine down (frees its worker processes / KV cache); never raises, so a
        failing shutdown cannot mask the error that ended a run."""
        if getattr(self, "llm", None) is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # noqa: BLE001 - shutdown is best effort
                logger.warning("vLLM engine shutdown: %s", e)
            self.llm = None
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._sync_dir is not None:
            self._sync_dir.cleanup()
            self._sync_dir = None

    # ---- RolloutEngine ----------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        mixing: MixingConfig | None = None,
        keys: list[int] | None = None,
    ) -> RolloutBatch:
        """As :meth:`RolloutEngine.generate`; colocated in a multi-rank job it is a collective of
        all ranks (:func:`~megatron_ngrpo.rollout.vllm.replicas.generate_on_replicas`)."""
        mixing = active_mixing(mixing)
        self._validate(prompts, params, mixing, keys)
        keys = list(range(len(prompts))) if keys is None else [int(k) for k in keys]
        if mixing is not None:
            positions = len(prompts) * params.n * params.max_new_tokens
            if self.colocated:  # one mode on every rank (vLLM TP groups search together)
                most = torch.tensor([positions])
                dist.all_reduce(most, op=dist.ReduceOp.MAX)
                positions = int(most)
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
            self._ensure_strategy(
                mixing, resolve_mode(mixing, True, positions, self.spec.vocab_size, device_type)
            )
        if self.colocated:
            return generate_on_replicas(
                lambda p, k: self._generate(p, params, mixing, k),
                prompts,
                keys,
                self.cfg.tensor_parallel,
            )
        return self._generate(prompts, params, mixing, keys)

    def _generate(self, prompts, params: SamplingParams, mixing, keys) -> RolloutBatch:
        # lazy: vLLM is an optional extra (heavy import)
        from vllm import SamplingParams as VSamplingParams

        call = uuid.uuid4().hex
        stop_ids = []
        if mixing is not None and mixing.stop_after:
            stop_ids = self.tokenizer.encode(mixing.stop_after, add_special_tokens=False)
        requests = []
        for i, p in enumerate(prompts):
            extra = None
            if mixing is not None:
                extra = request_options(call, i, keys[i], params.n, params.seed, mixing, stop_ids)
            requests.append(
                VSamplingParams(
                    **sampling_options(
                        params, min(params.max_new_tokens, self.max_model_len - len(p)), extra
                    ),
                    detokenize=self.tokenizer is not None,
                )
            )
        try:
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompts], requests, use_tqdm=False
            )
        finally:  # the hook forgets this call's requests even when generation failed
            records = (
                self.llm.collective_rpc("nbr_mix_pop", args=(call,))[0]
                if mixing is not None
                else {}
            )
        return self._batch(
            prompts, params.n, outputs, records, mixing.k if mixing is not None else 1
        )

    def sync_weights(self, model_chunks) -> None:
        """Load the trainer's weights and refresh the neighbour table.

        ``model_chunks``: this rank's Megatron chunks, any TP/PP layout. Colocated in a multi-rank
        job this is a collective of all ranks: each rank streams the full HF tensors (gathered
        over TP/PP one parameter at a time) into its vLLM worker, whose weight loaders keep the
        worker's TP shard, or, where the layouts allow it (:attr:`tp_shards`), the worker's
        shards of the linear layers, which the loaders take as they are; by
        ``cfg.weight_transfer`` (vLLM's weight-transfer API in buckets of ``sync_bucket_mb``,
        :mod:`~megatron_ngrpo.rollout.vllm.weight_transfer`, or ``reload``).
        ``last_sync["num_params"]`` counts what this rank loaded.
        """
        t0 = time.perf_counter()
        if self.cfg.weight_transfer == "reload":
            self.load_weights(_export(model_chunks, self.spec, self.tp_shards))
        else:
            # lazy: keeps rollout.vllm.engine free of vllm at import (start-up)
            from megatron_ngrpo.rollout.vllm.weight_transfer import MegatronSource

            self.push_weights(MegatronSource(model_chunks, self.spec, tp_shards=self.tp_shards))
        self.last_sync["seconds"] = time.perf_counter() - t0
        self.last_sync["tp_shards"] = self.tp_shards is not None
        logger.info(
            "vLLM weight sync: %.3g M params, %.3f s",
            self.last_sync["num_params"] / 1e6,
            self.last_sync["seconds"],
        )

    def set_neighbor_table(self, table: torch.Tensor | None) -> None:
        """Use the trainer's neighbour table ([V, k] int ids, one per weight version) instead of
        building one from the synced weights (None: build it again)."""
        self._trainer_table = table
        self._table_key = None

    def neighbor_rows_searched(self) -> int:
        """Rows this rank's worker searched with the lookup of the current weight version."""
        return int(self.llm.collective_rpc("nbr_mix_stats")[0].get("neighbor_rows", 0))

    def sleep(self) -> None:
        """Free the engine's device memory while the trainer runs (vLLM sleep mode, GPU only)."""
        if self.cfg.sleep_level and torch.cuda.is_available():
            self.llm.sleep(level=self.cfg.sleep_level)

    def wake_up(self) -> None:
        if self.cfg.sleep_level and torch.cuda.is_available():
            self.llm.wake_up()

    # ---- weights and neighbour table --------------------------------------------------------
    def load_weights(self, named_tensors) -> None:
        """Reload HF-named tensors (the full set, any iterable: in-process workers consume it one
        tensor at a time) into the live engine and rebuild the current neighbour table (or STHT
        noise scale) from them; timings in :attr:`last_sync`."""
        sources, count = {}, {"tensors": 0, "params": 0, "bytes": 0}

        def stream():
            for name, t in named_tensors:
                t = t.detach()
                count["tensors"] += 1
                count["params"] += t.numel()
                count["bytes"] += t.numel() * t.element_size()
                if name in (EMBED_NAME, OUTPUT_NAME):
                    sources[name] = t
                yield name, t

        t0 = time.perf_counter()
        if self._worker_in_process:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        else:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_path": self._write_safetensors(list(stream()))}
            )
        if not count["tensors"]:
            raise ValueError("load_weights: no tensors")
        t1 = time.perf_counter()
        self._sources = sources
        table_seconds = self._refresh_table()
        self.last_sync = {
            "load_seconds": t1 - t0,
            "table_seconds": table_seconds,
            "num_params": count["params"],
            "bytes": count["bytes"],
        }

    def push_weights(self, source) -> None:
        """Send a vLLM ``WeightSource`` (HF names, the full set) through the weight-transfer
        engine ``cfg.weight_transfer`` and rebuild the table as :meth:`load_weights` does."""
        # lazy: keeps rollout.vllm.engine free of vllm at import (start-up)
        from megatron_ngrpo.rollout.vllm.weight_transfer import WeightSender

        if self._sender is None:
            self._sender = WeightSender(
                self.llm,
                self.cfg.weight_transfer,
                int(self.cfg.sync_bucket_mb * 2**20),
                self.cfg.verify_weights,
                num_workers=1 if self.colocated else self.cfg.tensor_parallel,
            )
        sources: dict[str, torch.Tensor] = {}
        stats = self._sender.send(_Keep(source, (EMBED_NAME, OUTPUT_NAME), sources))
        self._sources = sources
        table_seconds = self._refresh_table()
        self.last_sync = {
            "load_seconds": stats["seconds"],
            "table_seconds": table_seconds,
            "num_params": stats["params"],
            "bytes": stats["bytes"],
            **({"buckets": stats["buckets"]} if "buckets" in stats else {}),
        }

    def _write_safetensors(self, named) -> str:
        path = Path(self._sync_dir_name()) / "model.safetensors"
        with atomic_file(path) as tmp:
            save_file({n: t.contiguous().cpu() for n, t in named}, str(tmp))
        return str(path.parent)

    def _ensure_strategy(self, mixing: MixingConfig, lookup: str) -> None:
        """Send the workers the table or on-demand lookup (``neighbor``, per ``lookup``) / noise
        spec (``stht``) of ``mixing``."""
        key = (*(repr(getattr(mixing, f)) for f in _TABLE_FIELDS), lookup)
        if key != self._table_key:
            self._table_mixing, self._table_lookup = mixing, lookup
            self._table_key = None
            self._refresh_table()
            self._table_key = key

    def _refresh_table(self) -> float:
        """Rebuild and send the current strategy's table / noise spec (if any); seconds taken."""
        mixing = self._table_mixing
        if mixing is None:
            return 0.0

        t0 = time.perf_counter()
        table, noise = None, None
        if mixing.strategy == "neighbor" and self._trainer_table is not None:
            table = self._trainer_table
        elif mixing.strategy == "neighbor" and self._table_lookup == "on_demand":
            exclude = exclusion_mask(
                self.spec.vocab_size, mixing, self.num_real_tokens, self.special_ids
            )
            self.llm.collective_rpc(
                "nbr_mix_set_lookup",
                args=(
                    mixing.k,
                    mixing.metric,
                    mixing.neighbor_source,
                    exclude.nonzero().flatten().tolist(),
                    self.spec.vocab_size,
                    mixing.chunk_size,
                ),
            )
            return time.perf_counter() - t0
        elif mixing.strategy == "neighbor":
            # V×V scoring: on the GPU when there is one (the checkpoint is read on the CPU)
            weight = self._source_matrix(mixing.neighbor_source).to(
                "cuda" if torch.cuda.is_available() else "cpu"
            )
            exclude = exclusion_mask(
                weight.shape[0], mixing, self.num_real_tokens, self.special_ids
            )
            table = build_neighbor_table(
                weight, 0, mixing.k, mixing.metric, exclude, mixing.chunk_size
            )
        if mixing.strategy == "stht":
            spec = NoiseSpec.from_embedding(
                self._source_matrix("input"), self.num_real_tokens, mixing.noise_scale
            )
            noise = (spec.sigma, spec.dim)
        if table is not None and not self._worker_in_process:
            path = Path(self._sync_dir_name()) / "neighbors.pt"
            torch.save(table.cpu(), path)
            table = str(path)
        self.llm.collective_rpc("nbr_mix_set_table", args=(table, noise))
        return time.perf_counter() - t0

    @property
    def _worker_in_process(self) -> bool:
        """True when this rank's worker runs in this process, so tensors can be passed by RPC."""
        return self.cfg.in_process and (self.cfg.tensor_parallel == 1 or self.colocated)

    def _sync_dir_name(self) -> str:
        if self._sync_dir is None:
            self._sync_dir = tempfile.TemporaryDirectory(
                prefix="ngrpo_vllm_sync_", dir=_shm_or_tmp()
            )
        return self._sync_dir.name

    def _source_matrix(self, source: str) -> torch.Tensor:
        """[V, d] matrix whose rows define neighbours: the synced tensors, else the checkpoint."""
        names = [OUTPUT_NAME, EMBED_NAME] if source == "output" else [EMBED_NAME]
        for name in names:
            if name in self._sources:
                return self._sources[name]
        ckpt = HFCheckpoint(self.hf_path) if any(Path(self.hf_path).glob("*.safetensors")) else {}
        for name in names:
            if name in ckpt:
                return ckpt[name]
        raise ValueError(f"{self.hf_path}: no {names[0]} in the checkpoint")

    # ---- validation and results -------------------------------------------------------------
    def _validate(self, prompts, params: SamplingParams, mixing, keys) -> None:
        table = self._trainer_table
        validate_request(
            prompts,
            params,
            keys,
            self.max_model_len,
            self.num_real_tokens,
            "max_model_len",
            mixing,
            None if table is None else table.shape[1],
        )
        if self.tokenizer is None and (params.stop or (mixing is not None and mixing.stop_after)):
            raise ValueError(
                "generate: stop strings / mixing.stop_after need a tokenizer (none was found)"
            )

    def _batch(self, prompts, n: int, outputs, records: dict, k: int) -> RolloutBatch:
        prompt_ids, response_ids, logprobs, finish, texts = [], [], [], [], []
        for i, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(
                        f"prompt {i}, sample {c.index}: vLLM finished with {c.finish_reason!r}"
                    )
                tokens = list(c.token_ids)
                prompt_ids.append(list(prompts[i]))
                response_ids.append(tokens)
                logprobs.append([float(d[t].logprob) for d, t in zip(c.logprobs, tokens)])
                finish.append(c.finish_reason)
                texts.append(c.text)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=logprobs,
            finish_reasons=finish,
            mixes=hook_mix_record(records, n, [len(r) for r in response_ids], k),
            prompt_index=[i for i in range(len(prompts)) for _ in range(n)],
            texts=texts if self.tokenizer is not None else None,
        )


class _Keep:
    """A weight source that also keeps the tensors named ``names`` in ``into`` (the neighbour
    table's source matrices)."""

    def __init__(self, source, names, into: dict):
        self.source, self.names, self.into = source, names, into

    def metadata(self):
        return self.source.metadata()

    def __iter__(self):
        for name, t in self.source:
            if name in self.names:
                self.into[name] = t.detach()
            yield name, t


def _export(model_chunks, spec, tp_shards):
    return export_hf_tensors(model_chunks, spec, tp_shards=tp_shards)


def _shm_or_tmp() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
