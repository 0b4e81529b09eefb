"""The one record type of a rollout's mixes: what engines produce and the trainer replays.

Contract (docs/ALGORITHM.md §1.1): for response token t of sequence s (0-based index into the response),
a record says that the *input embedding at that token's position* — the input from which token
t+1 is predicted — is ``Σ_c weights[c] · E[ids[c]]`` instead of ``E[response[t]]``. ``ids[0]`` is
the anchor (argmax). The token emitted at t (``response[t]``) is the anchor in paper mode or the
ordinary sample in reference mode; it is kept in the response ids, not here.

Storage is sparse (COO over mixed positions only), which at ρ=0.1 is ~10% of response tokens × k
ids and weights. Positions are response-relative, so records do not depend on prompt lengths or
padding of any engine; :meth:`MixRecord.flat_positions` places them into a padded [B, L] batch.

An optional per-position ``noise`` [N, d] (STHT baseline) is added to the mixture on replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MixRecord:
    """Mixed positions of a batch of ``num_seqs`` responses.

    Shapes: ``seq`` [N] int64 (sequence index), ``pos`` [N] int64 (response-token index),
    ``ids`` [N, k] int64 (anchor first), ``weights`` [N, k] float32 (rows sum to 1; padding
    entries have weight 0 and id 0), ``noise`` [N, d] float32 or None.
    """

    seq: torch.Tensor
    pos: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    num_seqs: int
    noise: torch.Tensor | None = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def empty(cls, num_seqs: int, k: int) -> MixRecord:
        return cls(
            seq=torch.zeros(0, dtype=torch.long),
            pos=torch.zeros(0, dtype=torch.long),
            ids=torch.zeros(0, k, dtype=torch.long),
            weights=torch.zeros(0, k, dtype=torch.float32),
            num_seqs=num_seqs,
        )

    @staticmethod
    def cat(records: list[MixRecord]) -> MixRecord:
        """Concatenate batches: sequence indices of later records are offset."""
        if not records:
            raise ValueError("MixRecord.cat needs at least one record")
        k = max(r.k for r in records)
        offset, parts = 0, []
        for r in records:
            parts.append(
                (r.seq + offset, r.pos, _pad_k(r.ids, k, 0), _pad_k(r.weights, k, 0.0), r.noise)
            )
            offset += r.num_seqs
        noises = [p[4] for p in parts]
        has_noise = any(n is not None for n in noises)
        if has_noise and any(n is None and len(p[0]) for n, p in zip(noises, parts)):
            raise ValueError("MixRecord.cat: cannot mix records with and without noise")
        return MixRecord(
            seq=torch.cat([p[0] for p in parts]),
            pos=torch.cat([p[1] for p in parts]),
            ids=torch.cat([p[2] for p in parts]),
            weights=torch.cat([p[3] for p in parts]),
            num_seqs=offset,
            noise=torch.cat([n for n in noises if n is not None]) if has_noise else None,
        )

    # ---- views --------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return self.ids.shape[1]

    def __len__(self) -> int:
        return self.seq.numel()

    def sorted(self) -> MixRecord:
        """Order by (seq, pos); engines may emit in any order."""
        if len(self) == 0:
            return self
        order = torch.argsort(self.seq * (int(self.pos.max()) + 1) + self.pos, stable=True)
        return self._take(order, self.seq[order], self.num_seqs)

    def select(self, seq_indices: list[int] | torch.Tensor) -> MixRecord:
        """The records of the given sequences, renumbered 0..len(seq_indices)-1 in that order."""
        seq_indices = torch.as_tensor(seq_indices, dtype=torch.long)
        remap = torch.full((self.num_seqs,), -1, dtype=torch.long)
        remap[seq_indices] = torch.arange(len(seq_indices))
        new_seq = remap[self.seq] if len(self) else self.seq
        keep = torch.nonzero(new_seq >= 0).flatten()
        return self._take(keep, new_seq[keep], len(seq_indices)).sorted()

    def flat_positions(self, offsets: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Flat positions s·seq_len + column [N] of the mixes in a right-padded [num_seqs,
        seq_len] token batch whose response s starts at column ``offsets[s]`` (the prompt length);
        host tensors in, a host tensor out."""
        col = torch.as_tensor(offsets, dtype=torch.long)[self.seq] + self.pos
        if len(self) and int(col.max()) >= seq_len:
            raise ValueError(f"mix position {int(col.max())} outside a batch of length {seq_len}")
        return self.seq * seq_len + col

    def validate(self, response_lengths: list[int] | torch.Tensor, vocab_size: int) -> None:
        """Raise ValueError on records that cannot belong to responses of these lengths."""
        lengths = torch.as_tensor(response_lengths, dtype=torch.long)
        if len(lengths) != self.num_seqs:
            raise ValueError(
                f"records for {self.num_seqs} sequences, {len(lengths)} responses given"
            )
        if not len(self):
            return
        if int(self.seq.min()) < 0 or int(self.seq.max()) >= self.num_seqs:
            raise ValueError("mix record sequence index out of range")
        bad = (self.pos < 0) | (self.pos >= lengths[self.seq])
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"mix at seq {int(self.seq[j])} pos {int(self.pos[j])} outside a response of "
                f"{int(lengths[self.seq[j]])} tokens"
            )
        if int(self.ids.min()) < 0 or int(self.ids.max()) >= vocab_size:
            raise ValueError(f"mix ids outside the vocabulary [0, {vocab_size})")
        sums = self.weights.sum(-1)
        if not torch.allclose(sums, torch.ones_like(sums), atol=1e-4):
            raise ValueError("mix weights do not sum to 1")

    # ---- serialisation ------------------------------------------------------------------
    def to_json(self) -> dict:
        """Plain lists, for JSONL dumps of generations."""
        d = {
            "seq": self.seq,
            "pos": self.pos,
            "ids": self.ids,
            "weights": self.weights,
            "num_seqs": self.num_seqs,
        }
        if self.noise is not None:
            d["noise"] = self.noise
        return {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in d.items()}

    def _take(self, index: torch.Tensor, new_seq: torch.Tensor, num_seqs: int) -> MixRecord:
        return MixRecord(
            seq=new_seq,
            pos=self.pos[index],
            ids=self.ids[index],
            weights=self.weights[index],
            num_seqs=num_seqs,
            noise=None if self.noise is None else self.noise[index],
        )


def _pad_k(t: torch.Tensor, k: int, value) -> torch.Tensor:
    if t.shape[1] == k:
        return t
    return torch.nn.functional.pad(t, (0, k - t.shape[1]), value=value)
