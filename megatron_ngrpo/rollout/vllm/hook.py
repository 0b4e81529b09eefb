"""Semantic-neighbour mixing inside vLLM 0.32's V1 model runner (docs/ENVIRONMENT.md §4).

Only the model runner sees the logits, the row → request map and the next step's input
embeddings together, so the hook lives there:

* ``LLM(worker_extension_cls="megatron_ngrpo.rollout.vllm.hook.NeighborMixExtension")`` adds the
  ``nbr_mix_*`` methods to vLLM's Worker; ``collective_rpc("nbr_mix_install")`` swaps
  ``worker.model_runner.__class__`` for a subclass with :class:`NeighborMixRunner` in front.
* ``_update_states``: registers opted-in requests (``SamplingParams(extra_args={"nbr_mix": ...})``,
  the request protocol of :mod:`~megatron_ngrpo.rollout.vllm.protocol`), drawing their gates
  ``gate_uniform(seed, key, t) < rate`` for every response position t at once
  (``key = rollout.types.response_key(prompt_key, child)``), and drops the pending mixes of
  finished ones (records stay until popped).
* ``_sample``: for each opted-in row that is not a partial prefill (``discard_request_mask``),
  whose position is undecided and whose gate fires, takes the anchor, neighbours and weights
  from the raw logits *before* vLLM's sampler (which edits the logits in place), with
  ``mixing.perturbations.decide_for_strategy`` (N-GRPO ``neighbor``, or the ``soft_thinking`` /
  ``stht`` / ``gumbel`` baselines, whose draws are counter-based on the same key and position).
  Mixes are kept per request, keyed by absolute position. In paper mode (``emit == "anchor"``)
  the sampled id of a mixed row is replaced by the anchor.
* ``_preprocess``: writes ``Σ w·embed(ids)`` (+ recorded noise) over the ``inputs_embeds`` rows of
  pending positions inside each request's scheduled range ``[num_computed, +n)``. A preempted
  request is re-prefilled from scratch and gets its mixes re-applied. On the token-id path it
  embeds the scheduled ids itself and passes ``input_ids=None``.

Log-probs. The engine is built with ``logprobs_mode="raw_logits"`` (vLLM only clones the logits)
and requests ``logprobs=0``; ``_sample`` computes ``log_softmax(z / T)`` of the raw logits before
the sampler and overwrites every returned value with it, gathered at the returned token ids: the
log-probability under the temperature-scaled *full* distribution, exactly what the trainer
recomputes. vLLM's own modes do not give that: ``raw_logprobs`` ignores T and
``processed_logprobs`` is taken after top-k/top-p truncation (and disables FlashInfer sampling on
GPU). A forced anchor's id (and rank) is written before the gather, so the value belongs to the
emitted token. Greedy rows (T = 0) use T = 1, vLLM's convention.

Thinking-only gate (``stop_ids``, the ids of e.g. ``"</think>"``): once the emitted tokens end with
``stop_ids`` the request is never mixed again, and the position that completed them is not mixed.

Tensor parallelism (GPU, untested here): vLLM all-gathers the logits before ``_sample``, every TP
rank runs the sampler on the same full-vocabulary logits, the gate is a stateless hash and the
table is replicated, so every rank takes identical decisions with ``tp_group=None`` and no
communication (an on-demand lookup, ``nbr_mix_set_lookup``, searches the new anchors' rows in each
rank's vocab shard: one all-reduce and one all-gather over vLLM's TP group per step with new anchors); ``embed_input_ids`` is vLLM's vocab-parallel embedding (one all-reduce).
Pipeline parallelism and speculative decoding are refused at install.

GPU notes (untested here):

* vLLM's GPU default is Model Runner V2 (``vllm/v1/worker/gpu/``), which has none of these
  methods; :mod:`megatron_ngrpo.rollout.vllm.engine` pins ``VLLM_USE_V2_MODEL_RUNNER=0`` so this
  V1 hook is used. The V2 route (designed, not run; docs/ENVIRONMENT.md §4) is an out-of-tree model
  class whose ``get_model_state_cls()`` returns a ``DefaultModelState`` subclass overriding
  ``prepare_inputs_embeds`` (overlay by ``input_batch.req_ids``) and ``custom_sampler``
  (decide before sampling, skip rows still in prefill); V2 re-sorts the batch every step, so
  lookups stay keyed by request id as here.
* The hook reads sampled ids and positions on the host every step: the engine turns async
  scheduling off. Switching between token ids and embeddings per step needs
  ``enforce_eager=True`` (or ``enable_prompt_embeds=True`` so CUDA graphs capture the static
  ``inputs_embeds`` buffer).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from megatron_ngrpo.mixing import decision
from megatron_ngrpo.mixing.arithmetic import mix_rows
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.neighbors import NeighborLookup
from megatron_ngrpo.mixing.perturbations import NoiseSpec, decide_for_strategy
from megatron_ngrpo.rollout.types import response_key
from megatron_ngrpo.rollout.vllm.protocol import (
    DECISION_FIELDS,
    OPTION_KEY,
    SUPPORTED_VLLM,
    missing_touch_points,
)

_GREEDY_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy
_NEVER = 1 << 62  # a position no request reaches


@dataclass
class _Request:
    """Mixing state of one opted-in request."""

    req_id: str
    call: str
    index: int
    child: int
    key: int
    prompt_len: int
    seed: int
    gated: list[int]  # sorted response positions t whose gate fires (drawn once, at registration)
    emit_anchor: bool
    stop_ids: tuple[int, ...]
    decision: MixingConfig
    group: tuple  # the settings under which gated rows share one batched decision
    # Absolute position of the next gated position not decided yet (_NEVER: none left, or the
    # thinking-only gate closed): one comparison per row and step, a gate lookup only when due.
    next_gate: int = _NEVER
    last_pos: int = -1  # highest absolute position watched (requests with stop_ids only)
    tail: list[int] = field(default_factory=list)  # last len(stop_ids) emitted tokens
    # absolute position → (ids, weights: k-lists, noise: [h] tensor or None), until it finishes
    pending: dict = field(default_factory=dict)
    records: list = field(default_factory=list)  # [(abs_pos, ids, weights, noise)]

    def emitted(self, token: int) -> bool:
        """Track the thinking-only gate; True when ``token`` completes ``stop_ids``."""
        self.tail.append(token)
        del self.tail[: -len(self.stop_ids)]
        return tuple(self.tail) == self.stop_ids

    def gate_fires(self, pos: int) -> bool:
        """Whether the gate of absolute position ``pos`` (>= ``next_gate``) fires; moves
        ``next_gate`` past ``pos``, so no position is decided twice."""
        t = pos - self.prompt_len
        j = bisect.bisect_right(self.gated, t)
        self.next_gate = self.prompt_len + self.gated[j] if j < len(self.gated) else _NEVER
        return j > 0 and self.gated[j - 1] == t


class _MixState:
    """Per-runner state: neighbour table, STHT noise spec, opted-in requests, counters."""

    def __init__(self, device, num_real_tokens: int, special_ids=()):
        self.device = device
        self.num_real_tokens = num_real_tokens
        # The special ids (mixing.skip_special_anchors): a gated step anchored there stays plain.
        self.special = decision.id_mask(special_ids, num_real_tokens, device)
        self.table = None  # [V, k] neighbour table or an on-demand NeighborLookup
        self.noise: NoiseSpec | None = None
        self.requests: dict[str, _Request] = {}
        # req_id → (abs_pos, entry): each request's newest mix, overlaid at its next decode step
        self.due: dict = {}
        # req_id → newest pending position, for preempted requests until their re-prefill passed it
        self.refill: dict = {}
        # resumed: opted-in requests resumed after preemption; reapplied: mixes overlaid in a
        # re-prefill; applied: all overlaid mixes.
        self.stats = {"resumed": 0, "reapplied": 0, "applied": 0}

    def resume(self, req_id: str) -> None:
        """A preempted request is re-prefilled from scratch: its mixes are overlaid again."""
        r = self.requests[req_id]
        self.stats["resumed"] += 1
        if r.pending:
            self.refill[req_id] = max(r.pending)

    def register(self, new_reqs, max_model_len: int) -> None:
        """Track the opted-in requests among ``new_reqs`` (vLLM ``NewRequestData``) and draw
        their gates for every possible response position: one hash call per seed and step,
        instead of one per decode step."""
        fresh = []
        for new in new_reqs:
            opts = (getattr(new.sampling_params, "extra_args", None) or {}).get(OPTION_KEY)
            if opts is None or new.req_id in self.requests:
                continue
            child = int(new.req_id.split("_", 1)[0]) if opts["n"] > 1 else 0
            prompt_len = len(new.prompt_token_ids or ())
            decision_cfg = MixingConfig(**opts["decision"])
            emit_anchor = opts["emit"] == "anchor"
            r = _Request(
                req_id=new.req_id,
                call=opts["call"],
                index=opts["index"],
                child=child,
                key=response_key(opts["key"], child),
                prompt_len=prompt_len,
                seed=opts["seed"],
                gated=[],
                emit_anchor=emit_anchor,
                stop_ids=tuple(opts["stop_ids"]),
                decision=decision_cfg,
                group=(
                    opts["seed"],
                    emit_anchor,
                    *(getattr(decision_cfg, f) for f in DECISION_FIELDS),
                ),
            )
            self.requests[new.req_id] = r
            length = min(
                new.sampling_params.max_tokens or max_model_len, max_model_len - prompt_len
            )
            fresh.append((r, opts["rate"], max(length, 0)))
        by_seed: dict = {}
        for item in fresh:
            by_seed.setdefault(item[0].seed, []).append(item)
        for seed, items in by_seed.items():
            keys = torch.tensor([r.key for r, _, _ in items]).unsqueeze(1)
            steps = torch.arange(max(length for _, _, length in items)).unsqueeze(0)
            rates = torch.tensor([rate for _, rate, _ in items], dtype=torch.float64).unsqueeze(1)
            fires = decision.gate_uniform(seed, keys, steps) < rates  # [R, T]
            for (r, _, length), row in zip(items, fires):
                r.gated = torch.nonzero(row[:length]).flatten().tolist()
                if r.gated:
                    r.next_gate = r.prompt_len + r.gated[0]

    def finish(self, req_id: str) -> None:
        r = self.requests.get(req_id)
        if r is not None:
            r.pending.clear()
            self.due.pop(req_id, None)
            self.refill.pop(req_id, None)

    def pop(self, call: str) -> dict:
        out = {}
        for req_id in [i for i, r in self.requests.items() if r.call == call]:
            self.finish(req_id)
            r = self.requests.pop(req_id)
            mixes = []
            if r.records:
                pos, ids, weights, noise = zip(*r.records)
                noise = noise if noise[0] is None else torch.stack(noise).tolist()
                mixes = [[p - r.prompt_len, *m] for p, *m in zip(pos, ids, weights, noise)]
            out[req_id] = {"index": r.index, "child": r.child, "mix": mixes}
        return out


@dataclass
class _Group:
    """One step's decisions for gated rows of equal settings: ``members`` [(row, request,
    absolute position)], ``rows`` [M] row indices, ``dec`` the MixDecision; for forced anchors,
    the anchor's rank in the vocabulary (vLLM's ``Logprob.rank``): [M] or 1 for all."""

    members: list
    rows: torch.Tensor
    dec: decision.MixDecision
    rank: torch.Tensor | int | None = None


class NeighborMixRunner:
    """Mixin placed in front of vLLM's (CPU/GPU) V1 model runner class by ``nbr_mix_install``."""

    _nm: _MixState

    # ---- request bookkeeping ----------------------------------------------------------------
    def _update_states(self, scheduler_output):
        result = super()._update_states(scheduler_output)
        state = self._nm
        for req_id in scheduler_output.finished_req_ids:
            state.finish(req_id)
        if scheduler_output.scheduled_new_reqs:
            state.register(scheduler_output.scheduled_new_reqs, self.max_model_len)
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            if req_id in state.requests:
                state.resume(req_id)
        return result

    # ---- inputs: overlay pending mixtures ---------------------------------------------------
    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        out = super()._preprocess(scheduler_output, num_input_tokens, intermediate_tensors)
        if not (self._nm.due or self._nm.refill):
            return out
        rows, entries = self._nm_scheduled_mixes(scheduler_output)
        if not rows:
            return out
        input_ids, inputs_embeds, *rest = out
        device = self.inputs_embeds.gpu.device
        # Requests of different k can share a step (two clients of one server): narrower mixes
        # get weight-0 copies of their first candidate, which add an exact 0.
        k = max(len(e[0]) for e in entries)
        ids = torch.tensor(
            [e[0] + e[0][:1] * (k - len(e[0])) for e in entries],
            dtype=self.input_ids.gpu.dtype,
            device=device,
        )
        weights = torch.tensor(
            [e[1] + [0.0] * (k - len(e[1])) for e in entries], dtype=torch.float32, device=device
        )
        if (
            inputs_embeds is None
        ):  # token-id path: embed the scheduled ids here, with the candidates
            # (eager, as VLLMConfig requires: no CUDA graph reads the static inputs_embeds buffer)
            n = num_input_tokens
            emb = self.model.embed_input_ids(torch.cat([self.input_ids.gpu[:n], ids.flatten()]))
            inputs_embeds, cand, input_ids = emb[:n], emb[n:], None
        else:
            cand = self.model.embed_input_ids(ids.flatten())
        cand = cand.view(*ids.shape, -1)  # [M, k, h]
        noisy = [j for j, e in enumerate(entries) if e[2] is not None]  # STHT
        noise = None
        if noisy:  # rows without noise add an exact 0
            noise = torch.zeros(len(entries), cand.shape[-1], dtype=torch.float32, device=device)
            noise[noisy] = torch.stack([entries[j][2] for j in noisy]).to(
                device=device, dtype=torch.float32
            )
        mix = mix_rows(cand, weights, noise)  # the trainer's arithmetic (mixing/arithmetic.py)
        index = torch.tensor(rows, dtype=torch.long, device=device)
        inputs_embeds.index_copy_(0, index, mix.to(inputs_embeds.dtype))
        return (input_ids, inputs_embeds, *rest)

    def _nm_scheduled_mixes(self, scheduler_output):
        """Flat token rows of this step that carry a pending mix, and those mixes: every pending
        mix inside a re-prefilled request's scheduled range ``[num_computed, +n)``, and each
        other request's newest mix at its next decode step."""
        state = self._nm
        batch = self.input_batch
        index, computed = batch.req_id_to_index, batch.num_computed_tokens_cpu
        starts = self.query_start_loc.np
        scheduled = scheduler_output.num_scheduled_tokens
        rows, entries = [], []
        for req_id, newest in list(state.refill.items()):
            n = scheduled.get(req_id)
            if n is None:
                continue
            r, i = state.requests[req_id], index[req_id]
            lo = int(computed[i])
            hits = [p for p in r.pending if lo <= p < lo + n]
            state.stats["reapplied"] += len(hits)
            rows += [int(starts[i]) + p - lo for p in hits]
            entries += [r.pending[p] for p in hits]
            if lo + n > newest:  # re-prefilled past the newest mix (the due one included)
                del state.refill[req_id]
                state.due.pop(req_id, None)
        for req_id, (p, entry) in list(state.due.items()):
            if scheduled.get(req_id) == 1 and req_id not in state.refill:
                i = index[req_id]
                if computed[i] == p:
                    rows.append(int(starts[i]))
                    entries.append(entry)
                    del state.due[req_id]
        state.stats["applied"] += len(rows)
        return rows, entries

    # ---- sampling: decide before vLLM's sampler, fix ids/log-probs after --------------------
    def _sample(self, logits, spec_decode_metadata):
        state = self._nm
        meta = self.input_batch.sampling_metadata
        num_reqs = self.input_batch.num_reqs
        if state.num_real_tokens < logits.shape[1]:  # unused vocab rows are never sampled
            logits[:, state.num_real_tokens :] = float("-inf")
        temp = self._nm_temperatures(meta, num_reqs, logits.device)
        logp = None
        if meta.max_num_logprobs is not None:  # [num_reqs, V] what the trainer recomputes
            logp = (logits.float() / temp.unsqueeze(1)).log_softmax(dim=-1)
        plan = self._nm_plan(logits, temp) if state.requests else None

        out = super()._sample(logits, spec_decode_metadata)

        if plan is not None:
            self._nm_commit(plan, out)
        lp = out.logprobs_tensors
        if logp is not None and lp is not None:
            lp.logprobs.copy_(logp.gather(1, lp.logprob_token_ids.long()))
        return out

    @staticmethod
    def _nm_temperatures(meta, num_reqs: int, device) -> torch.Tensor:
        """[num_reqs] sampling temperature of each row, 1 for greedy rows (vLLM's convention)."""
        if meta.temperature is None:  # all greedy
            return torch.ones(num_reqs, device=device)
        t = meta.temperature[:num_reqs].float()
        return torch.where(t < _GREEDY_EPS, torch.ones_like(t), t)

    def _nm_plan(self, logits: torch.Tensor, temp: torch.Tensor):
        """This step's opted-in rows to watch for stop ids, ``[(row, request, absolute
        position)]``, and the decisions of the gated rows (taken on the raw logits), batched per
        group of equal settings. Rows in a partial prefill (``discard_request_mask``) are
        skipped. Plain Python per row: after the model's forward each numpy/torch call costs
        tens of µs (cold caches), more than this loop."""
        state = self._nm
        num_reqs = logits.shape[0]
        positions = self.optimistic_seq_lens_cpu[:num_reqs].tolist()
        discard = self.discard_request_mask.np
        stop_rows, gated = [], []
        for i, req_id in enumerate(self.input_batch.req_ids[:num_reqs]):
            r = state.requests.get(req_id)
            if r is None:
                continue
            p = positions[i]
            if r.stop_ids and p > r.last_pos and not discard[i]:
                stop_rows.append((i, r, p))
            if p >= r.next_gate and not discard[i] and r.gate_fires(p):
                gated.append((i, r, p))
        if not (stop_rows or gated):
            return None
        groups: dict = {}
        if gated:
            temps = temp.tolist()
            for w in gated:
                groups.setdefault((temps[w[0]], w[1].group), []).append(w)
        decided = (
            self._nm_decide(logits, members, temperature)
            for (temperature, _), members in groups.items()
        )
        return stop_rows, [g for g in decided if g is not None]

    def _nm_decide(self, logits: torch.Tensor, members, temperature: float) -> _Group | None:
        """Decisions of gated rows sharing temperature, seed, emission and strategy settings;
        the rows the decision leaves unmixed (special anchors) are plain steps (None: all)."""
        state = self._nm
        r0 = members[0][1]
        rows = torch.tensor([m[0] for m in members], device=logits.device)
        z = logits.index_select(0, rows)
        # keys and positions as lists: only the strategies with draws make tensors of them
        dec = decide_for_strategy(
            r0.decision,
            z,
            torch.ones(len(members), dtype=torch.bool, device=z.device),
            temperature=temperature,
            num_real_tokens=state.num_real_tokens,
            table=state.table,
            noise=state.noise,
            seed=r0.seed,
            key=[m[1].key for m in members],
            position=[m[2] - m[1].prompt_len for m in members],
            special=state.special,
        )
        keep = dec.mixed.tolist() if r0.decision.skip_special_anchors else ()
        if not all(keep):  # one host read, only where the decision can leave rows out
            members = [m for m, mixed in zip(members, keep) if mixed]
            if not members:
                return None
            index = torch.nonzero(dec.mixed).flatten()
            rows, z, dec = rows[index], z[index], dec.select(index)
        group = _Group(members, rows, dec)
        if r0.emit_anchor and r0.decision.strategy == "neighbor":
            group.rank = 1  # the argmax of z (unused rows are -inf): nothing ranks above it
        elif r0.emit_anchor:
            anchor_logit = z.gather(1, dec.anchor.unsqueeze(1))
            group.rank = (z > anchor_logit).sum(-1) + 1
        return group

    def _nm_commit(self, plan, out) -> None:
        """Force anchors, apply the thinking-only gate, store pending mixes and records."""
        state = self._nm
        stop_rows, groups = plan
        sampled = out.sampled_token_ids
        lp = out.logprobs_tensors
        for g in groups:
            if g.rank is None:
                continue
            anchor = g.dec.anchor.to(sampled.dtype)
            sampled[g.rows, 0] = anchor
            if lp is not None:  # its log-prob is gathered in _sample
                lp.logprob_token_ids[g.rows, 0] = anchor.to(lp.logprob_token_ids.dtype)
                ranks = lp.selected_token_ranks
                ranks[g.rows] = g.rank if isinstance(g.rank, int) else g.rank.to(ranks.dtype)
        completed = set()
        if stop_rows:
            tokens = sampled[:, 0].tolist()
            for i, r, p in stop_rows:
                r.last_pos = p
                if r.emitted(tokens[i]):
                    completed.add(i)
                    r.last_pos = r.next_gate = _NEVER  # never watched nor mixed again
        for g in groups:
            # host lists: one copy per group, exact for float32 weights
            ids, weights, noise = g.dec.ids.tolist(), g.dec.weights.tolist(), g.dec.noise
            for j, (i, r, p) in enumerate(g.members):
                if i in completed:  # the token that completes stop_ids is never mixed
                    continue
                entry = (ids[j], weights[j], None if noise is None else noise[j])
                r.pending[p] = entry
                r.records.append((p, *entry))
                state.due[r.req_id] = (p, entry)


class NeighborMixExtension:
    """vLLM worker extension: ``collective_rpc("nbr_mix_...")`` methods on every worker."""

    def nbr_mix_install(self, num_real_tokens: int, special_ids: list[int] | None = None) -> str:
        """Put :class:`NeighborMixRunner` in front of the model runner's class (idempotent).
        Ids ``>= num_real_tokens`` are never sampled (as in the Megatron engine); ``special_ids``
        never anchor a mix where a request asks ``mixing.skip_special_anchors``."""
        runner = self.model_runner
        cfg = runner.vllm_config
        if cfg.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("neighbour mixing in vLLM: pipeline parallelism is not supported")
        if cfg.speculative_config is not None:
            raise ValueError("neighbour mixing in vLLM: speculative decoding is not supported")
        if cfg.model_config.logprobs_mode != "raw_logits":
            raise ValueError(
                f"neighbour mixing in vLLM: logprobs_mode must be 'raw_logits', got "
                f"{cfg.model_config.logprobs_mode!r} (the hook converts raw logits)"
            )
        if getattr(runner, "use_async_scheduling", False):
            raise ValueError("neighbour mixing in vLLM: async scheduling must be off")
        # lazy: vLLM's runner is imported inside vLLM's worker process (heavy)
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

        if not isinstance(runner, V1Runner):  # Model Runner V2 has none of the patched methods
            raise ValueError(
                f"neighbour mixing in vLLM: the model runner is {type(runner).__module__}."
                f"{type(runner).__name__}, not the V1 runner the hook patches (VLLM_USE_V2_MODEL_RUNNER=0)"
            )
        missing = missing_touch_points(runner)
        if missing:
            raise ValueError(
                f"neighbour mixing in vLLM: this vLLM lacks {len(missing)} of the hook's private touch "
                f"points: {', '.join(missing)} (written against vLLM {SUPPORTED_VLLM})"
            )
        if not isinstance(runner, NeighborMixRunner):
            cls = type(runner)
            runner.__class__ = type(f"NeighborMix{cls.__name__}", (NeighborMixRunner, cls), {})
            runner._nm = _MixState(runner.device, int(num_real_tokens), special_ids or ())
        return type(runner).__name__

    def nbr_mix_set_table(self, table, noise: tuple[float, int] | None = None) -> None:
        """Install the [V, k] neighbour table (a tensor in-process, a ``torch.save`` path for
        worker processes; None for strategies without one) and the STHT noise ``(sigma, dim)``."""
        if isinstance(table, str):
            table = torch.load(table, map_location="cpu", weights_only=True)
        state = self.model_runner._nm
        state.table = None if table is None else table.to(device=state.device, dtype=torch.long)
        state.noise = None if noise is None else NoiseSpec(float(noise[0]), int(noise[1]))

    def nbr_mix_set_lookup(
        self, k: int, metric: str, source: str, excluded: list[int], num_rows: int, chunk_size: int
    ) -> None:
        """Search neighbour rows on demand (``mixing.neighbor_lookup``): a
        :class:`~megatron_ngrpo.mixing.neighbors.NeighborLookup` of this worker's vocab shard of
        the input embedding / LM head (``source``) over vLLM's TP group, exact and cached until
        the next call (one per weight version). ``excluded``: ids never neighbours among the
        ``num_rows`` checkpoint rows; vLLM's padding rows beyond them are excluded too. Every TP
        rank takes the same decisions, so they search the same anchors together."""
        # lazy: vLLM internals, resolved inside the worker
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        want = ParallelLMHead if source == "output" else VocabParallelEmbedding
        layer = next(
            (
                m
                for m in self.model_runner.get_model().modules()
                if isinstance(m, want) and (source == "output" or not isinstance(m, ParallelLMHead))
            ),
            None,
        )
        if layer is None:
            raise ValueError(
                f"neighbour lookup: the vLLM model has no {want.__name__} ({source!r} matrix)"
            )
        exclude = torch.ones(layer.num_embeddings_padded, dtype=torch.bool)
        exclude[:num_rows] = False
        exclude[torch.as_tensor(excluded, dtype=torch.long)] = True
        tp = get_tp_group()
        state = self.model_runner._nm
        state.table = NeighborLookup(
            layer.weight.detach(),
            layer.shard_indices.padded_org_vocab_start_index,
            k,
            metric,
            exclude,
            chunk_size,
            tp.device_group if tp.world_size > 1 else None,
        )
        state.noise = None

    def nbr_mix_pop(self, call: str) -> dict:
        """Records of the finished requests of generate call ``call``:
        ``{req_id: {"index", "child", "mix": [[t, ids, weights, noise], ...]}}`` with ``t`` the
        response-token index. Forgets those requests."""
        return self.model_runner._nm.pop(call)

    def nbr_load_tp_shards(self, on: bool) -> int:
        """Make the TP-split linear layers (q/k/v, o, gate/up, down) take tensors that already
        are this rank's shard (shard-to-shard weight sync, ``on``) or full HF tensors again;
        returns how many parameters it set. vLLM's v1 loaders (biases) read their own
        ``is_sharded_weight`` flag; its v2 parameters always cut ``narrow(tp_rank · shard,
        shard)``, which is the identity on a shard-sized tensor at ``tp_rank`` 0. Both are set
        on the live parameters and on the copies vLLM's layerwise reload recorded at load time
        (it rebuilds the parameters from those). Vocab-parallel layers still cut full tensors."""
        # lazy: vLLM is an optional extra (heavy import)
        from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.parameter import BasevLLMParameter

        count = 0
        for module in self.model_runner.get_model().modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            info = LAYERWISE_INFO.get(module)
            recorded = info.restore_metadata[0] if info is not None else {}
            for name, param in module.named_parameters(recurse=False):
                for p in (param, recorded.get(name)):
                    if p is None:
                        continue
                    p.is_sharded_weight = on
                    if isinstance(p, BasevLLMParameter):
                        if not hasattr(p, "nbr_tp_rank"):
                            p.nbr_tp_rank = p.tp_rank
                        p.tp_rank = 0 if on else p.nbr_tp_rank
                count += 1
        return count

    def nbr_mix_stats(self) -> dict:
        """Counters since install, plus ``tracked``: requests still held (0 once every call's
        records were popped)."""
        state = self.model_runner._nm
        rows = getattr(state.table, "rows_computed", None)  # on-demand neighbour rows searched
        return dict(
            state.stats,
            tracked=len(state.requests),
            **({} if rows is None else {"neighbor_rows": rows}),
        )
