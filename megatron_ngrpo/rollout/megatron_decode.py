"""Decode-step state of the built-in engine (:mod:`megatron_ngrpo.rollout.megatron_engine`):
one static batch's rows (:class:`_RowState`: token buffer, lengths, sampling uniforms and mixing
gates, what a broadcast step records), a generate call's results (:class:`_Outputs`), and the
step's pure pieces: the inverse-CDF sample, the finish codes, dropping finished rows from the KV
cache, cutting a text at its stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_ngrpo.mixing.decision import gate, gate_uniform
from megatron_ngrpo.mixing.perturbations import NoiseSpec, gaussian_noise
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.rollout.types import SamplingParams

# Separates the sampling draws from the mixing gate's draws of the same (seed, key, position).
_SAMPLE_SALT = 0x5D588B656C078965
_RUNNING, _STOP, _LENGTH = 0, 1, 2


def _compact_kv(ctx, keep: torch.Tensor) -> None:
    """Drop finished rows from the static KV cache (megatron's ``swap_key_value_dict`` only
    permutes)."""
    for layer, (k, v) in ctx.key_value_memory_dict.items():
        ctx.key_value_memory_dict[layer] = (k[:, keep].contiguous(), v[:, keep].contiguous())


def _sample(scaled: torch.Tensor, top_k: int, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: ``scaled`` [B, V] fp32 logits / T (-inf = excluded), ``u`` [B]
    float64 uniforms in [0, 1) → [B] ids. A counter-based uniform instead of a generator makes
    the draw a pure function of (seed, key, position): identical on every rank and batching."""
    v = scaled.shape[-1]
    if 0 < top_k < v:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled.double(), dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True, stable=True)
        cum = sp.cumsum(dim=-1)
        sp = sp.masked_fill(cum - sp >= top_p, 0.0)  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    cdf = probs.cumsum(dim=-1)
    x = (u.to(cdf) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    last = ((probs > 0).long() * torch.arange(v, device=probs.device)).argmax(dim=-1)
    return torch.minimum(idx, last)


def _truncate_at_stop(text: str, stops: Sequence[str]) -> str:
    cut = [text.find(s) for s in stops if s in text]
    return text[: min(cut)] if cut else text


@dataclass
class _Outputs:
    """Per-response results of one generate call, filled batch by batch (row = response index)."""

    num_rows: int
    k: int
    noise: NoiseSpec | None = None  # STHT: mixed rows carry recorded noise
    responses: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: list = field(default_factory=list)
    mixes: list = field(
        default_factory=list
    )  # (seq [N], pos [N], ids [N,k], weights [N,k], noise [N,d])

    def __post_init__(self):
        self.responses = [[] for _ in range(self.num_rows)]
        self.logprobs = [[] for _ in range(self.num_rows)]
        self.finish = ["length"] * self.num_rows

    def record(self) -> MixRecord:
        if not self.mixes:
            return MixRecord.empty(self.num_rows, self.k)
        seq, pos, ids, w, noise = zip(*self.mixes)
        return MixRecord(
            seq=torch.cat(seq),
            pos=torch.cat(pos),
            ids=torch.cat(ids),
            weights=torch.cat(w),
            num_seqs=self.num_rows,
            noise=None if self.noise is None else torch.cat(noise),
        ).sorted()


@dataclass
class _RowState:
    """Decode state of one static batch, indexed by batch row (``rows[i]`` = response index):
    ``tokens`` [B, S] prompt + response buffer, ``ntok`` [B] response lengths, ``done`` [B];
    ``mix_off`` [B] (past ``stop_after``), ``uniform`` and ``gates`` are kept by the deciding
    rank only."""

    rows: list
    keys: list
    plen: torch.Tensor
    limit: torch.Tensor
    tokens: torch.Tensor
    mix_off: torch.Tensor = None
    ntok: torch.Tensor = None
    done: torch.Tensor = None
    uniform: torch.Tensor = None
    gates: torch.Tensor = None

    def __post_init__(self):
        b = len(self.rows)
        self.mix_off = torch.zeros(b, dtype=torch.bool)
        self.ntok = torch.zeros(b, dtype=torch.long)
        self.done = torch.zeros(b, dtype=torch.bool)

    def draw(self, params: SamplingParams, mixing) -> None:
        """The sampling uniforms ``uniform`` and mixing gates ``gates`` [B, max new tokens] of
        every (row, response position), drawn at once (deciding rank only)."""
        keys = torch.tensor(self.keys, dtype=torch.long).unsqueeze(1)
        t = torch.arange(int(self.limit.max())).unsqueeze(0)
        self.uniform = gate_uniform(params.seed ^ _SAMPLE_SALT, keys, t)
        if mixing is not None:
            self.gates = gate(mixing.rate, params.seed, keys, t)

    def column(self, live: torch.Tensor, col: int) -> torch.Tensor:
        """Response position t [len(live)] of the rows ``live`` at batch column ``col``
        (clamped into the drawn range for rows still in their prompt)."""
        return (col - self.plen[live]).clamp(min=0, max=self.uniform.shape[1] - 1)

    def gated(self, live: torch.Tensor, producing: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[len(live)] bool: rows whose gate fires at position t and that may mix."""
        return self.gates[live, t] & producing & ~self.mix_off[live]

    def response(self, i: int, last: int) -> list[int]:
        """The last ``last`` response tokens of batch row ``i``."""
        end = int(self.plen[i] + self.ntok[i])
        return self.tokens[i, max(int(self.plen[i]), end - last) : end].tolist()

    def apply(
        self,
        packed: torch.Tensor,
        live: torch.Tensor,
        producing: torch.Tensor,
        col: int,
        out: _Outputs,
        seed: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Record the broadcast step of rows ``live`` (packed as in ``_decide``) into ``out``;
        returns the mixed flag [len(live)] (CPU) and, for STHT, the noise [len(live), d] (zero
        on unmixed rows), redrawn here from the decision's counters (seed, key, t)."""
        cpu = packed.cpu()
        token, logp, mixed, finish = cpu[:, 0].long(), cpu[:, 1], cpu[:, 2] > 0, cpu[:, 3].long()
        idx = torch.nonzero(producing).flatten()
        rows_b = live[idx]
        self.tokens[rows_b, col] = token[idx]
        self.ntok[rows_b] += 1
        for i, r in zip(idx.tolist(), rows_b.tolist()):
            resp = self.rows[r]
            out.responses[resp].append(int(token[i]))
            out.logprobs[resp].append(float(logp[i]))
            if finish[i] != _RUNNING:
                self.done[r] = True
                out.finish[resp] = "stop" if finish[i] == _STOP else "length"
        m = torch.nonzero(mixed).flatten()
        noise = None
        if len(m):
            k = (cpu.shape[1] - 4) // 2
            seq = torch.tensor([self.rows[r] for r in live[m].tolist()], dtype=torch.long)
            pos = col - self.plen[live[m]]
            drawn = None
            if out.noise is not None:
                keys = torch.tensor(self.keys, dtype=torch.long)[live[m]]
                drawn = gaussian_noise(seed, keys, pos, out.noise)
                noise = torch.zeros(len(live), out.noise.dim)
                noise[m] = drawn
            out.mixes.append((seq, pos, cpu[m, 4 : 4 + k].long(), cpu[m, 4 + k :].float(), drawn))
        return mixed, noise
