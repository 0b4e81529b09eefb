"""What every rollout engine takes and returns.

Both engines (built-in Megatron, vLLM) return a :class:`RolloutBatch`: per response its prompt
ids, response token ids, the engine's sampling log-probs of those tokens, a finish reason, and one
:class:`~megatron_ngrpo.mixing.records.MixRecord` for the whole batch (sequence index = response
index). The trainer replays any engine's batch and must get the engine's log-probs back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_ngrpo.mixing.records import MixRecord


@dataclass
class SamplingParams:
    """Per-call generation settings (the config's defaults live in rollout/config.py)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling n = {self.n}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"sampling temperature = {self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p = {self.top_p}: must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens = {self.max_new_tokens}: must be >= 1")


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

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    def validate(self, vocab_size: int) -> None:
        n = len(self.response_ids)
        for name in ("prompt_ids", "logprobs", "finish_reasons", "prompt_index"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(self, name))} entries, expected {n}")
        for r, (toks, lps) in enumerate(zip(self.response_ids, self.logprobs)):
            if len(toks) != len(lps):
                raise ValueError(f"response {r}: {len(toks)} tokens but {len(lps)} log-probs")
        self.mixes.validate(self.response_lengths, vocab_size)

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


def validate_request(prompts: list[list[int]], params: SamplingParams, keys, max_len: int,
                     num_real_tokens: int, limit_name: str) -> None:
    """The checks both engines make before generating (no collectives): one ValueError naming
    the request index."""
    params.validate()
    if keys is not None and len(keys) != len(prompts):
        raise ValueError(f"generate: {len(keys)} keys for {len(prompts)} prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i}: empty")
        if len(p) >= max_len:
            raise ValueError(f"prompt {i}: {len(p)} tokens, no room for a response within {limit_name} {max_len}")
        bad = [t for t in p if not 0 <= int(t) < num_real_tokens]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} outside [0, {num_real_tokens})")


class RolloutEngine:
    """Interface of the rollout engines.

    ``generate``: prompts (token-id lists) → :class:`RolloutBatch` of ``len(prompts) * params.n``
    responses; ``mixing`` None or disabled generates plainly (evaluation); ``keys`` (one int per
    prompt, default its index) seed the per-sequence mixing gate together with ``params.seed``,
    so the same (seed, key) draws the same gates in any engine.
    ``sync_weights``: load the trainer's current weights (a no-op when the engine generates with
    the training model itself) and rebuild the neighbour table.
    """

    def generate(self, prompts: list[list[int]], params: SamplingParams, mixing=None,
                 keys: list[int] | None = None) -> RolloutBatch:
        raise NotImplementedError

    def sync_weights(self, model_chunks) -> None:
        raise NotImplementedError
