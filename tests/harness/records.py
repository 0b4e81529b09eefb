"""MixRecords written and read as plain lists (tests, benchmarks): ``per_seq[s] = [(pos, ids,
weights), ...]``, the shape a test states its expected mixes in."""

from __future__ import annotations

import torch

from megatron_ngrpo.mixing.records import MixRecord


def mix_record(per_seq: list[list[tuple[int, list[int], list[float]]]], k: int) -> MixRecord:
    """A MixRecord of ``per_seq[s] = [(pos, ids, weights), ...]``; shorter id lists are padded
    with weight-0 entries, weights are renormalised to sum to 1."""
    seq, pos, ids, wts = [], [], [], []
    for s, entries in enumerate(per_seq):
        for p, i, w in entries:
            if len(i) != len(w) or not 1 <= len(i) <= k:
                raise ValueError(f"mix at seq {s} pos {p}: {len(i)} ids, {len(w)} weights, k={k}")
            total = float(sum(w))
            seq.append(s)
            pos.append(int(p))
            ids.append(list(i) + [0] * (k - len(i)))
            wts.append([x / total for x in w] + [0.0] * (k - len(w)))
    if not seq:
        return MixRecord.empty(len(per_seq), k)
    return MixRecord(
        seq=torch.tensor(seq, dtype=torch.long),
        pos=torch.tensor(pos, dtype=torch.long),
        ids=torch.tensor(ids, dtype=torch.long),
        weights=torch.tensor(wts, dtype=torch.float32),
        num_seqs=len(per_seq),
    ).sorted()


def sequence_mixes(record: MixRecord, s: int) -> list[tuple[int, list[int], list[float]]]:
    """``[(pos, ids, weights), ...]`` of sequence ``s`` of ``record`` (padding entries dropped)."""
    out = []
    for j in torch.nonzero(record.seq == s).flatten().tolist():
        nz = record.weights[j] > 0
        out.append((int(record.pos[j]), record.ids[j][nz].tolist(), record.weights[j][nz].tolist()))
    return out
