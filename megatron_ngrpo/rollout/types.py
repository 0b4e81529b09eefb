"""What every rollout engine takes and returns.

Both engines (built-in Megatron, vLLM) return a :class:`RolloutBatch`: per response its prompt
ids, response token ids, the engine's sampling log-probs of those tokens, a finish reason, and one
:class:`~megatron_ngrpo.mixing.records.MixRecord` for the whole batch (sequence index = response
index). The trainer replays any engine's batch and must get the engine's log-probs back.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, fields

import torch

from megatron_ngrpo import config_loader
from megatron_ngrpo.mixing.records import MixRecord

# Sequence key of child j of a prompt with key p: p * KEY_STRIDE + j (every engine: the mixing
# gate and the sampling draws are functions of (seed, sequence key, position)).
KEY_STRIDE = 1000003


def response_key(prompt_key: int, child: int) -> int:
    """Gate/sampling key of sample ``child`` of the prompt with key ``prompt_key``."""
    return int(prompt_key) * KEY_STRIDE + int(child)


def sequence_keys(keys, n: int) -> list[int]:
    """Keys of every response, prompt-major: ``response_key(keys[i], j)`` for j < ``n``."""
    return [response_key(k, j) for k in keys for j in range(n)]


def active_mixing(mixing):
    """The mixing config a generate call mixes with: ``mixing`` when given and enabled, else
    None (plain generation)."""
    return mixing if mixing is not None and mixing.enabled else None


@dataclass
class SamplingFields:
    """The sampling settings a config section names like a generate call (the evaluation's
    ``sampling`` section derives from it with its own defaults; the training job's ``rollout``
    section has the same names)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256


@dataclass
class SamplingParams(SamplingFields):
    """Per-call generation settings (the config's defaults live in rollout/config.py)."""

    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    # Generate max_new_tokens whatever the model's EOS (``stop``/``stop_token_ids`` still apply):
    # fixed work per call, for benchmarks (vLLM's ``ignore_eos``).
    ignore_eos: bool = False

    @classmethod
    def from_config(
        cls, section, eos_token_id: int | None = None, seed: int | None = None
    ) -> SamplingParams:
        """The one builder from a config section (the training job's ``rollout``, the evaluation
        CLI's and in-training validation's ``sampling``): its :class:`SamplingFields`, and
        ``stop`` / ``seed`` where it has them; ``seed`` overrides the section's. Responses also
        stop at ``eos_token_id`` (the tokenizer's EOS)."""
        return cls(
            **{f.name: getattr(section, f.name) for f in fields(SamplingFields)},
            stop=list(getattr(section, "stop", [])),
            stop_token_ids=[eos_token_id] if eos_token_id is not None else [],
            seed=seed if seed is not None else getattr(section, "seed", 0),
        )

    def validate(self, fail=None) -> None:
        """The one rule for sampling settings. ``fail(field, value, why)`` raises (default: a
        ``ValueError``; config sections pass ``config_loader.fail`` for their one-line errors)."""
        fail = fail or _value_error
        if self.n < 1:
            fail("n", self.n, "must be >= 1")
        if self.temperature < 0:
            fail("temperature", self.temperature, "must be >= 0")
        if not 0 < self.top_p <= 1:
            fail("top_p", self.top_p, "must be in (0, 1]")
        if self.max_new_tokens < 1:
            fail("max_new_tokens", self.max_new_tokens, "must be >= 1")


def _value_error(field: str, value, why: str) -> None:
    raise ValueError(f"sampling {field} = {value}: {why}")


@dataclass
class RolloutBatch:
    """Responses of one generate call, ordered prompt-major: response ``i*n + j`` is sample ``j``
    of prompt ``i``.

    ``prompt_ids[r]`` / ``response_ids[r]``: token id lists; ``logprobs[r]``: float list, the
    engine's log-probability of each response token under the distribution it sampled from
    (temperature-scaled, before top-p/top-k truncation); ``finish_reasons[r]``: "stop" (EOS or
    stop string) or "length"; ``mixes``: the mixes of all responses; ``prompt_index[r]``: index of
    the prompt in the call.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    mixes: MixRecord
    prompt_index: list[int]
    texts: list[str] | None = None
    policy_version: int | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    def validate(self, vocab_size: int) -> None:
        n = len(self.response_ids)
        for name in ("prompt_ids", "logprobs", "finish_reasons", "prompt_index"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"RolloutBatch.{name} has {len(getattr(self, name))} entries, expected {n}"
                )
        for r, (toks, lps) in enumerate(zip(self.response_ids, self.logprobs)):
            if len(toks) != len(lps):
                raise ValueError(f"response {r}: {len(toks)} tokens but {len(lps)} log-probs")
        self.mixes.validate(self.response_lengths, vocab_size)
        v = self.policy_version
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(
                f"RolloutBatch.policy_version = {v!r}: expected a step number >= 0 or None"
            )

    def select_prompts(self, indices: list[int]) -> RolloutBatch:
        """The responses of the prompts at ``indices`` (in that order), renumbered 0..len-1."""
        by_prompt: dict[int, list[int]] = {}
        for r, i in enumerate(self.prompt_index):
            by_prompt.setdefault(i, []).append(r)
        rows = [r for i in indices for r in by_prompt.get(i, [])]
        new_index = [j for j, i in enumerate(indices) for _ in by_prompt.get(i, [])]
        return RolloutBatch(
            prompt_ids=[self.prompt_ids[r] for r in rows],
            response_ids=[self.response_ids[r] for r in rows],
            logprobs=[self.logprobs[r] for r in rows],
            finish_reasons=[self.finish_reasons[r] for r in rows],
            mixes=self.mixes.select(rows),
            prompt_index=new_index,
            texts=None if self.texts is None else [self.texts[r] for r in rows],
            policy_version=self.policy_version,
        )

    @staticmethod
    def cat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Concatenate batches of consecutive prompt ranges (prompt indices of later batches are
        offset by the prompts before them)."""
        offset, index = 0, []
        for b in batches:
            index += [i + offset for i in b.prompt_index]
            offset += max(b.prompt_index, default=-1) + 1
        texts = (
            None if any(b.texts is None for b in batches) else [t for b in batches for t in b.texts]
        )
        versions = {b.policy_version for b in batches}
        if len(versions) > 1:
            raise ValueError(
                f"RolloutBatch.cat: batches of different policy versions {sorted(versions, key=str)}"
            )
        return RolloutBatch(
            prompt_ids=[x for b in batches for x in b.prompt_ids],
            response_ids=[x for b in batches for x in b.response_ids],
            logprobs=[x for b in batches for x in b.logprobs],
            finish_reasons=[x for b in batches for x in b.finish_reasons],
            mixes=MixRecord.cat([b.mixes for b in batches]),
            prompt_index=index,
            texts=texts,
            policy_version=versions.pop() if versions else None,
        )

    def padded(self, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded prompt+response batch: ``tokens`` [B, L] int64, ``offsets`` [B] (prompt
        lengths = column of response token 0), ``lengths`` [B] (prompt + response)."""
        seqs = [p + r for p, r in zip(self.prompt_ids, self.response_ids)]
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
        tokens = torch.full((len(seqs), int(lengths.max())), pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        offsets = torch.tensor([len(p) for p in self.prompt_ids], dtype=torch.long)
        return tokens, offsets, lengths


def validate_request(
    prompts: list[list[int]],
    params: SamplingParams,
    keys,
    max_len: int,
    num_real_tokens: int,
    limit_name: str,
    mixing=None,
    table_width: int | None = None,
) -> None:
    """The checks every engine makes before generating (no collectives): one ValueError naming
    the request index or the mixing field (``mixing``: the enabled MixingConfig, or None;
    ``table_width``: columns of the given neighbour table the engine mixes with, None when it
    builds its own for ``mixing``)."""
    params.validate()
    if mixing is not None:
        config_loader.validate(mixing)
        if mixing.strategy == "neighbor" and table_width not in (None, mixing.k):
            raise ValueError(
                f"mixing.k = {mixing.k} but the neighbour table has {table_width} columns"
            )
    if keys is not None and len(keys) != len(prompts):
        raise ValueError(f"generate: {len(keys)} keys for {len(prompts)} prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i}: empty")
        if len(p) >= max_len:
            raise ValueError(
                f"prompt {i}: {len(p)} tokens, no room for a response within {limit_name} {max_len}"
            )
        bad = [t for t in p if not 0 <= int(t) < num_real_tokens]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} outside [0, {num_real_tokens})")


class RolloutEngine(abc.ABC):
    """The contract between the trainer (and evaluation) and every rollout engine.

    In a multi-rank job every method is called on every rank at the same point (engines may
    run collectives in any of them). ``last_sync``: figures of the last weight sync (seconds,
    bytes, ...), logged by the trainer as ``weight_sync/*``; empty for engines without one.
    """

    last_sync: dict = {}
    # Whether the engine searches exact neighbour rows itself, on demand, when it is given no
    # table and ``mixing.neighbor_lookup`` resolves to "on_demand" (mixing/neighbors.py); the
    # trainer's neighbour source (training/neighbor_source.py) reads it.
    neighbors_on_demand: bool = False

    @abc.abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        mixing=None,
        keys: list[int] | None = None,
    ) -> RolloutBatch:
        """Prompts (token-id lists) → :class:`RolloutBatch` of ``len(prompts) * params.n``
        responses; ``mixing`` None or disabled generates plainly (evaluation); ``keys`` (one int
        per prompt, default its index; the trainer passes global prompt indices) seed the
        per-sequence mixing gate together with ``params.seed``, so the same (seed, key) draws the
        same gates in any engine."""

    @abc.abstractmethod
    def sync_weights(self, model_chunks) -> None:
        """Load the trainer's current weights (``model_chunks``: this rank's Megatron chunks; a
        no-op when the engine generates with the training model itself)."""

    @abc.abstractmethod
    def set_neighbor_table(self, table) -> None:
        """Use the trainer's neighbour table ([V, k] ids) of the current weight version: the one
        table every engine mixes with (a generate whose ``mixing.k`` is not its width is refused);
        None: no table (an engine that searches rows on demand does so)."""

    def neighbor_rows_searched(self) -> int:
        """Neighbour rows this rank's engine searched on demand since the last weight sync (0
        for engines that only mix with a given table)."""
        return 0

    def sleep(self) -> None:
        """Release device memory between rollouts (engines that hold their own copy)."""

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next weight sync."""

    def close(self) -> None:
        """Free the engine's resources; never raises."""
