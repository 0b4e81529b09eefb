"""Built-in rollout engine: KV-cached generation with the trainer's own Megatron model chunks.

Runs wherever the trainer runs (CPU under the compat shim, GPU, any TP/PP/VPP layout) and needs
no weight conversion: it calls the policy's ``GPTModel`` chunks with megatron-core's
``StaticInferenceContext`` (the KV cache lives in the attention layers) and passes hidden states
between pipeline stages with megatron's inference p2p helpers (``communication_utils``).

Batching follows megatron's static engine (``TextGenerationController``): one prefill over the
shortest prompt, then one decode step per column for every row in lockstep, where rows whose
prompt is longer are fed their next prompt token instead of a sample. No row ever sees padding,
positions are each row's true positions, and the causal mask is megatron's own, so a batched
row is computed exactly as it would be alone (with any attention backend). Rows sorted by
prompt length share a batch when ``max_batch_size`` splits the work, and finished rows are
dropped from the KV cache once they are half of the batch.

Per decode step, on one rank (last pipeline stage, TP rank 0), from the gathered fp32 logits:

* the sample: temperature, top-k, top-p, then an inverse-CDF draw whose uniform is the
  counter-based hash of ``(seed ^ salt, key, t)`` — deterministic per (seed, sequence key,
  response position) and independent of batching; padded vocab rows (>= ``num_real_tokens``)
  have probability 0;
* the mixing decision (N-GRPO, docs/ALGORITHM.md §1): gate ``decision.gate(rate, seed, key, t)``
  with ``key = rollout.types.response_key(prompt_key, child)`` (every engine's), anchor, candidates
  and weights from :func:`~megatron_ngrpo.mixing.perturbations.decide_for_strategy` (neighbour
  table for N-GRPO; Soft Thinking, STHT and Gumbel baselines); the emitted token is the anchor
  (``emit="anchor"``) or the sample; the next step's input embedding is the mixture (plus the
  STHT noise, which every rank redraws from the same counters), entering through the mixing
  embedding (:func:`~megatron_ngrpo.mixing.embedding.mixing_inputs`);
* the log-prob ``log_softmax(logits / T)`` of the emitted token over the real vocabulary (T = 1
  for greedy), before top-k/top-p;
* stop ids, stop strings (through the ``decode`` callable) and the thinking-only gate
  (``stop_after``: no mix at the position whose token completes that text, nor after it).

The decision is broadcast over the model-parallel group as one small tensor, so every rank
holds the same tokens, records and log-probs. The decode-step state (a static batch's rows, a
call's results) and the step's pure pieces (the sample, KV-cache compaction) are in
:mod:`megatron_ngrpo.rollout.megatron_decode`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.inference.communication_utils import (
    recv_from_prev_pipeline_rank_,
    send_to_next_pipeline_rank,
)
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.utils import set_model_to_sequence_parallel

from megatron_ngrpo.architecture import ArchSpec, unwrap
from megatron_ngrpo.compat.cpu import device
from megatron_ngrpo.mixing.decision import anchors, id_mask
from megatron_ngrpo.mixing.embedding import MixBatch, mixing_embedding, mixing_inputs
from megatron_ngrpo.mixing.neighbor_mode import resolve_mode
from megatron_ngrpo.mixing.neighbors import (
    NeighborLookup,
    neighbor_lookup_for_model,
    neighbor_table_for_model,
)
from megatron_ngrpo.mixing.perturbations import (
    NoiseSpec,
    decide_for_strategy,
)
from megatron_ngrpo.models.batch_invariant import enable_batch_invariant
from megatron_ngrpo.models.invariant_logsoftmax import gathered_logprobs
from megatron_ngrpo.models.provider import build_model
from megatron_ngrpo.rollout.megatron_decode import (
    _LENGTH,
    _RUNNING,
    _STOP,
    _compact_kv,
    _Outputs,
    _RowState,
    _sample,
    _truncate_at_stop,
)
from megatron_ngrpo.rollout.types import (
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    active_mixing,
    sequence_keys,
    validate_request,
)

_STOP_WINDOW_EXTRA = (
    4  # tokens decoded beyond the longest stop text (tokens may decode to < 1 char)
)


class MegatronEngine(RolloutEngine):
    """Generates with Megatron ``GPTModel`` chunks of this rank (one per virtual stage).

    Args:
        model_chunks: the policy's chunks (possibly DDP / Float16Module wrapped).
        num_real_tokens: ids >= this are never sampled, never anchors (padded vocab rows).
        eos_token_ids: ids that end a response (finish reason "stop"); per-call
            ``SamplingParams.stop_token_ids`` are added.
        decode: token ids → text; needed for stop strings, ``stop_after`` and ``texts``.
        special_ids: ids excluded from neighbour sets (passed to the table builder).
        neighbor_table: a given [V, k] neighbour table (anchor first, see also
            :meth:`set_neighbor_table`); None = from the model, per :func:`resolve_mode`: the
            whole table (:func:`~megatron_ngrpo.mixing.neighbors.neighbor_table_for_model`) at
            the first mixed generate after construction or :meth:`sync_weights`, or on-demand
            rows of the anchors each decode step mixes (:class:`NeighborLookup`, sharded over TP,
            cached until :meth:`sync_weights`).
        max_batch_size: rows decoded at once (0 = all); rows are grouped by prompt length.
        max_seq_len: longest prompt + response (default: the model's max_sequence_length).
        separate_copy: generate with a copy of the weights (built from ``model_cfg``) that
            :meth:`sync_weights` refreshes, instead of the chunks themselves.
        model_cfg: the policy's ``ModelConfig`` (only for ``separate_copy``).
        groups: the process groups the engine's collectives (and a separate copy's layers) use,
            a megatron ``ProcessGroupCollection`` with ``tp``, ``pp``, ``mp``; default megatron's.
            Groups of their own let a separate copy generate on a second thread while the
            trainer runs collectives (training/async_rollout.py).
        batch_invariant: generate with the batch-invariant forward (``rollout.batch_invariant``,
            models/batch_invariant.py; enabled on the chunks here) and report the trainer's
            log-prob function's values: the trainer's replay equals them bit for bit.
    """

    neighbors_on_demand = True

    def __init__(
        self,
        model_chunks,
        num_real_tokens: int,
        *,
        eos_token_ids: Sequence[int] = (),
        decode: Callable[[list[int]], str] | None = None,
        special_ids: Sequence[int] = (),
        neighbor_table: torch.Tensor | None = None,
        max_batch_size: int = 0,
        max_seq_len: int | None = None,
        separate_copy: bool = False,
        model_cfg=None,
        groups=None,
        batch_invariant: bool = False,
    ):

        if separate_copy and model_cfg is None:
            raise ValueError("MegatronEngine(separate_copy=True) needs model_cfg to build the copy")
        if max_batch_size < 0:
            raise ValueError(f"MegatronEngine max_batch_size = {max_batch_size}: must be >= 0")
        self.num_real_tokens = int(num_real_tokens)
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.decode = decode
        self.special_ids = [int(i) for i in special_ids]
        self._special = id_mask(self.special_ids, self.num_real_tokens, device())
        self.max_batch_size = max_batch_size
        self.separate_copy = separate_copy
        self._device = device()
        self._fixed_table = neighbor_table
        # Per mixing-config key: neighbour table or STHT noise spec, derived from the weights.
        self._derived: dict[tuple, object] = {}
        self._src: int | None = None
        self.groups = groups or ProcessGroupCollection.use_mpu_process_groups(["tp", "pp", "mp"])
        if separate_copy:
            self.chunks = build_model(model_cfg, pg_collection=groups)
            self._copy_weights(model_chunks)
        else:
            self.chunks = list(model_chunks)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            enable_batch_invariant(self.chunks)
        inner = unwrap(self.chunks[0])
        self.config = inner.config
        self.max_seq_len = int(max_seq_len or inner.max_sequence_length)

    @classmethod
    def from_config(cls, rollout_cfg, model_chunks, model_cfg, **kwargs) -> MegatronEngine:
        """The engine of a ``RolloutConfig`` (``separate_copy``, ``max_batch_size``) for a policy
        built from ``model_cfg``; kwargs as in the constructor (decode, eos_token_ids, ...)."""

        num_real = model_cfg.num_real_tokens or ArchSpec.from_hf(model_cfg.hf_path).vocab_size
        return cls(
            model_chunks,
            num_real,
            max_batch_size=rollout_cfg.max_batch_size,
            separate_copy=rollout_cfg.separate_copy,
            model_cfg=model_cfg,
            batch_invariant=rollout_cfg.batch_invariant,
            **kwargs,
        )

    # ---- RolloutEngine ----------------------------------------------------------------------
    def sync_weights(self, model_chunks=None) -> None:
        """Copy the trainer's weights (``separate_copy``) or adopt ``model_chunks``; the neighbour
        table (and STHT noise scale) is rebuilt at the next mixed generate."""
        if model_chunks is not None:
            if self.separate_copy:
                self._copy_weights(model_chunks)
            else:
                self.chunks = list(model_chunks)
        self._derived.clear()

    def set_neighbor_table(self, table: torch.Tensor | None) -> None:
        """Mix with ``table`` [V, k] (anchor first) from now on, e.g. the trainer's table that it
        refreshes every ``mixing.refresh_every`` updates; None = build it from the weights."""
        self._fixed_table = table

    def neighbor_rows_searched(self) -> int:
        derived = list(self._derived.values())
        return sum(v.rows_computed for v in derived if isinstance(v, NeighborLookup))

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        mixing=None,
        keys: list[int] | None = None,
    ) -> RolloutBatch:
        mixing = active_mixing(mixing)
        self._validate(prompts, params, mixing, keys)
        keys = list(range(len(prompts))) if keys is None else [int(k) for k in keys]
        row_prompts = [list(prompts[i]) for i in range(len(prompts)) for _ in range(params.n)]
        row_keys = sequence_keys(keys, params.n)
        aux = (
            self._mixing_aux(mixing, len(row_prompts) * params.max_new_tokens)
            if mixing is not None
            else {}
        )
        if self._src is None:
            self._src = _decider_rank(self.groups.mp)
        order = sorted(range(len(row_prompts)), key=lambda r: len(row_prompts[r]))
        size = self.max_batch_size or len(order)
        out = _Outputs(len(row_prompts), mixing.k if mixing is not None else 1, aux.get("noise"))
        with self._generation_mode():
            for start in range(0, len(order), size):
                rows = order[start : start + size]
                self._generate_rows(
                    rows,
                    [row_prompts[r] for r in rows],
                    [row_keys[r] for r in rows],
                    params,
                    mixing,
                    aux,
                    out,
                )
        texts = None
        if self.decode is not None:
            texts = [
                _truncate_at_stop(self.decode(r), params.stop) if f == "stop" else self.decode(r)
                for r, f in zip(out.responses, out.finish)
            ]
        return RolloutBatch(
            prompt_ids=row_prompts,
            response_ids=out.responses,
            logprobs=out.logprobs,
            finish_reasons=out.finish,
            mixes=out.record(),
            prompt_index=[i for i in range(len(prompts)) for _ in range(params.n)],
            texts=texts,
        )

    # ---- validation (no collectives) --------------------------------------------------------
    def _validate(self, prompts, params: SamplingParams, mixing, keys) -> None:
        table = self._fixed_table
        validate_request(
            prompts,
            params,
            keys,
            self.max_seq_len,
            self.num_real_tokens,
            "the model's max length",
            mixing,
            None if table is None else table.shape[1],
        )
        if (params.stop or (mixing is not None and mixing.stop_after)) and self.decode is None:
            raise ValueError(
                "generate: stop strings / mixing.stop_after need the engine's decode callable"
            )
        if mixing is not None:
            if mixing.k > self.num_real_tokens:
                raise ValueError(
                    f"mixing.k = {mixing.k}: more than the {self.num_real_tokens} real tokens"
                )

    # ---- weights and neighbour table --------------------------------------------------------
    def _copy_weights(self, model_chunks) -> None:
        with torch.no_grad():
            for own, src in zip(self.chunks, model_chunks, strict=True):
                for (name, p), (src_name, q) in zip(
                    unwrap(own).state_dict().items(), unwrap(src).state_dict().items(), strict=True
                ):
                    if name != src_name:
                        raise ValueError(f"separate copy: parameter {name} vs {src_name}")
                    if torch.is_tensor(p):
                        p.copy_(q)

    def _mixing_aux(self, mixing, positions: int) -> dict:
        """What the strategy needs from the weights: ``table`` (neighbor: the [V, k] table, or
        the on-demand :class:`NeighborLookup` per :func:`resolve_mode` of ``positions`` decode
        positions) or ``noise`` (stht), built collectively on first use and cached until
        :meth:`sync_weights` (one per weight version; a lookup keeps its rows until then)."""
        if mixing.strategy == "neighbor":
            if self._fixed_table is not None:
                return {"table": self._fixed_table.to(self._device)}
            mode = resolve_mode(
                mixing, True, positions, unwrap(self.chunks[0]).vocab_size, self._device.type
            )
            key = (
                mode,
                mixing.k,
                mixing.metric,
                mixing.neighbor_source,
                mixing.exclude_special,
                mixing.exclude_padded,
                tuple(mixing.exclude_ids),
                mixing.chunk_size,
            )
            if key not in self._derived:
                self._derived[key] = (
                    neighbor_lookup_for_model(
                        self.chunks,
                        mixing,
                        self.num_real_tokens,
                        self.special_ids,
                        self.groups.tp,
                        self.groups.pp,
                    )
                    if mode == "on_demand"
                    else neighbor_table_for_model(
                        self.chunks, mixing, self.num_real_tokens, self.special_ids
                    ).to(self._device)
                )
            return {"table": self._derived[key]}
        if mixing.strategy == "stht":
            key = ("noise", mixing.noise_scale)
            if key not in self._derived:
                self._derived[key] = self._noise_spec(mixing.noise_scale)
            return {"noise": self._derived[key]}
        return {}

    def _noise_spec(self, scale: float) -> NoiseSpec:
        """STHT σ from the first stage's embedding, broadcast over the pipeline group."""

        sigma = torch.zeros(1, dtype=torch.float64, device=self._device)
        emb = mixing_embedding(self.chunks[0])
        if emb is not None:
            spec = NoiseSpec.from_embedding(
                emb.weight, self.num_real_tokens, scale, emb.vocab_start_index, self.groups.tp
            )
            sigma.fill_(spec.sigma)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(
                sigma, src=ps.get_pipeline_model_parallel_first_rank(), group=self.groups.pp
            )
        return NoiseSpec(sigma=float(sigma), dim=self.config.hidden_size)

    # ---- the generation loop ----------------------------------------------------------------
    @contextlib.contextmanager
    def _generation_mode(self):
        """eval(), no_grad and no sequence parallelism (static inference does not take it)."""

        training = [c.training for c in self.chunks]
        sp = bool(self.config.sequence_parallel)
        for c in self.chunks:
            c.eval()
            if sp:
                set_model_to_sequence_parallel(unwrap(c), False)
        try:
            with torch.no_grad():
                yield
        finally:
            for c, t in zip(self.chunks, training):
                c.train(t)
                if sp:
                    set_model_to_sequence_parallel(unwrap(c), True)

    def _generate_rows(
        self, rows, prompts, keys, params: SamplingParams, mixing, aux: dict, out: _Outputs
    ) -> None:
        """Generate the responses of ``rows`` (indices into ``out``) in one static batch."""

        b = len(rows)
        plen = torch.tensor([len(p) for p in prompts])
        limit = (self.max_seq_len - plen).clamp(max=params.max_new_tokens)
        total = int((plen + limit).max())
        tokens = torch.zeros(b, total, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        state = _RowState(rows=rows, keys=keys, plen=plen, limit=limit, tokens=tokens)
        if dist.get_rank() == self._src:
            state.draw(params, mixing)
        ctx = StaticInferenceContext(b, total)
        col = int(plen.min())
        logits = self._forward(tokens[:, :col], ctx, None)
        ctx.enable_decode_mode()
        live = torch.arange(b)  # rows held in the KV cache, in cache order
        while True:
            producing = (plen[live] <= col) & ~state.done[live]
            packed = None
            if isinstance(aux.get("table"), NeighborLookup):
                self._ensure_rows(aux["table"], logits, live, producing, col, state, mixing)
            if dist.get_rank() == self._src:
                packed = self._decide(logits, live, producing, col, state, params, mixing, aux)
            packed = self._broadcast(packed, len(live), mixing.k if mixing is not None else 1)
            mixed, noise = state.apply(packed, live, producing, col, out, params.seed)
            if bool(state.done.all()):
                break
            if 2 * int((~state.done[live]).sum()) <= len(live):
                keep = ~state.done[live]
                _compact_kv(ctx, torch.nonzero(keep).flatten().to(self._device))
                live, packed, mixed = live[keep], packed[keep.to(packed.device)], mixed[keep]
                noise = None if noise is None else noise[keep]
            mix = None
            if bool(mixed.any()):
                k = (packed.shape[1] - 4) // 2
                mix = MixBatch.from_dense(
                    ids=packed[:, 4 : 4 + k].long().unsqueeze(1).to(self._device),
                    weights=packed[:, 4 + k :].float().unsqueeze(1).to(self._device),
                    mask=mixed.unsqueeze(1),
                    noise=None if noise is None else noise.unsqueeze(1).to(self._device),
                )
            logits = self._forward(tokens[live, col : col + 1], ctx, mix)
            col += 1

    def _forward(self, tokens: torch.Tensor, ctx, mix: MixBatch | None) -> torch.Tensor | None:
        """One KV-cached step over all chunks of this rank: tokens [B, s] → last-position logits
        [B, V] (gathered over TP) on the last pipeline stage, None elsewhere."""

        b, s = tokens.shape
        tokens = tokens.to(self._device)
        pos = (
            torch.arange(ctx.sequence_len_offset, ctx.sequence_len_offset + s, device=self._device)
            .unsqueeze(0)
            .expand(b, s)
        )
        comm_dtype = (
            torch.float32 if self.config.fp32_residual_connection else self.config.params_dtype
        )
        pp_group = self.groups.pp
        out = None
        for chunk in self.chunks:
            inner = unwrap(chunk)
            if not inner.pre_process:
                buf = torch.empty(
                    s, b, self.config.hidden_size, dtype=comm_dtype, device=self._device
                )
                recv_from_prev_pipeline_rank_(buf, pp_group)
                inner.set_input_tensor(buf)
            with mixing_inputs(chunk, mix):
                out = chunk(tokens, pos, None, inference_context=ctx, runtime_gather_output=True)
            if not inner.post_process:
                send_to_next_pipeline_rank(out.to(comm_dtype).contiguous(), pp_group)
        ctx.increment_sequence_len_offset(s)
        return out[:, -1, :] if unwrap(self.chunks[-1]).post_process else None

    def _broadcast(self, packed: torch.Tensor | None, b: int, k: int) -> torch.Tensor:
        group = self.groups.mp
        if dist.get_world_size(group) == 1:
            return packed
        if packed is None:
            packed = torch.empty(b, 4 + 2 * k, dtype=torch.float64, device=self._device)
        dist.broadcast(packed, src=self._src, group=group)
        return packed

    def _decide(
        self,
        logits,
        live,
        producing,
        col,
        state: _RowState,
        params: SamplingParams,
        mixing,
        aux: dict,
    ) -> torch.Tensor:
        """Tokens, log-probs, mixes and finish codes of the rows in ``live`` → packed [B, 4+2k]
        float64: token, log-prob, mixed, finish code, ids (k), weights (k)."""
        b = len(live)
        k = mixing.k if mixing is not None else 1
        z = logits.float()  # fp32 logits are masked in place: they are this step's own tensor
        z[:, self.num_real_tokens :] = float("-inf")
        temp = params.temperature
        scaled = z / (temp if temp > 0 else 1.0)
        t = state.column(live, col)
        if temp > 0:
            token = _sample(scaled, params.top_k, params.top_p, state.uniform[live, t].to(z.device))
        else:
            token = z.argmax(dim=-1)
        packed = torch.zeros(b, 4 + 2 * k, dtype=torch.float64, device=z.device)
        mixed = torch.zeros(b, dtype=torch.bool, device=z.device)
        if mixing is not None:
            gated = state.gated(live, producing, t)
            if bool(gated.any()):
                sel = torch.nonzero(gated).flatten()
                rows = sel.to(z.device)
                dec = decide_for_strategy(
                    mixing,
                    logits[rows],
                    gated[sel],
                    temperature=temp if temp > 0 else 1.0,
                    num_real_tokens=self.num_real_tokens,
                    table=aux.get("table"),
                    noise=aux.get("noise"),
                    seed=params.seed,
                    key=torch.tensor(state.keys)[live[sel]],
                    position=t[sel],
                    special=self._special,
                )
                mixed[rows] = dec.mixed
                if mixing.emit == "anchor":  # a step left unmixed keeps its sampled token
                    token[rows] = torch.where(dec.mixed, dec.anchor, token[rows])
                packed[rows, 4 : 4 + k] = dec.ids.double()
                packed[rows, 4 + k :] = dec.weights.double()
        packed[:, 0] = token.double()
        packed[:, 1] = self._token_logprobs(z, scaled, token, temp if temp > 0 else 1.0).double()
        finish, mix_stop = self._finish(token.cpu(), live, producing, t, state, params, mixing)
        mixed &= ~mix_stop.to(z.device)
        packed[:, 2] = mixed.double()
        packed[:, 3] = finish.double().to(z.device)
        return packed

    def _token_logprobs(self, z, scaled, token, temp: float) -> torch.Tensor:
        """log softmax(z / T)[token] [B]: in the batch-invariant mode the trainer's function
        (models/invariant_logsoftmax.py, per TP shard of ``z``), else from ``scaled`` = z / T."""
        if self.batch_invariant:
            shards = dist.get_world_size(self.groups.tp)
            return gathered_logprobs(z, token, temp, shards, self.num_real_tokens)
        return scaled.gather(1, token.unsqueeze(1)).squeeze(1) - torch.logsumexp(scaled, dim=-1)

    def _ensure_rows(
        self, lookup: NeighborLookup, logits, live, producing, col, state: _RowState, mixing
    ) -> None:
        """On-demand neighbours: the decider sends the anchors of this step's gated rows over
        the model-parallel group (one broadcast of [B] ids, -1 = none; special anchors are -1
        where the decision skips them) and every rank searches the rows not cached yet
        (collective over TP, broadcast over PP), so that the decision reads cached rows only."""
        ids = torch.full((len(live),), -1, dtype=torch.long, device=self._device)
        if dist.get_rank() == self._src:
            mixed = state.gated(live, producing, state.column(live, col))
            rows = torch.nonzero(mixed).flatten().to(logits.device)
            found = anchors(logits[rows], self.num_real_tokens).to(self._device)
            if mixing.skip_special_anchors:
                found = found.masked_fill(self._special[found], -1)
            ids[: rows.numel()] = found
        if dist.get_world_size(self.groups.mp) > 1:
            dist.broadcast(ids, src=self._src, group=self.groups.mp)
        lookup.ensure(ids[ids >= 0])

    def _finish(self, token, live, producing, t, state: _RowState, params, mixing):
        """Finish codes [B] and the rows whose token completes ``mixing.stop_after`` (they stop
        mixing from this position on)."""
        b = len(live)
        finish = torch.full((b,), _RUNNING, dtype=torch.long)
        mix_stop = torch.zeros(b, dtype=torch.bool)
        eos = [] if params.ignore_eos else self.eos_token_ids
        stop_ids = torch.tensor(eos + list(params.stop_token_ids), dtype=torch.long)
        finish[producing & (t + 1 >= state.limit[live])] = _LENGTH
        finish[producing & torch.isin(token, stop_ids)] = _STOP
        stop_after = mixing.stop_after if mixing is not None else ""
        if not params.stop and not stop_after:
            return finish, mix_stop
        texts = list(params.stop) + ([stop_after] if stop_after else [])
        window = max(len(s) for s in texts) + _STOP_WINDOW_EXTRA
        for i in torch.nonzero(producing).flatten().tolist():
            row = int(live[i])
            tail = self.decode(state.response(row, window - 1) + [int(token[i])])
            if params.stop and any(s in tail for s in params.stop):
                finish[i] = _STOP
            if stop_after and not state.mix_off[row] and stop_after in tail:
                state.mix_off[row] = True
                mix_stop[i] = True
        return finish, mix_stop


def _decider_rank(group) -> int:
    """Global rank that samples and decides for this model-parallel group: last pipeline
    stage, TP rank 0."""

    me = dist.get_rank()
    mine = (
        ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    )
    if dist.get_world_size(group) == 1:
        return me

    flag = torch.tensor([me if mine else -1], dtype=torch.long, device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag)
