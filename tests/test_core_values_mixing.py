"""The mixing decision and the mix records by value (issue #45 item 3): the tests that kill the
mutants of megatron_ngrpo/mixing/{decision,records}.py that scripts/mutation_score.sh found
surviving (bench/results/mutation_score.md). Fast, single-process: the tensor-parallel branches
run on a world of threads (:class:`_ThreadWorld`) whose all-reduce combines the ranks' tensors as
torch.distributed does; the device placement runs on the meta device (shapes, no values), a
device other than the host's.
"""

from __future__ import annotations

import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from megatron_ngrpo.mixing import decision
from megatron_ngrpo.mixing.decision import (
    MixDecision,
    anchors,
    counter_uniform,
    decide,
    gate,
    gate_uniform,
    id_mask,
)
from megatron_ngrpo.mixing.neighbors import NeighborLookup, build_neighbor_table
from megatron_ngrpo.mixing.records import MixRecord, _pad_k


class _ThreadWorld:
    """``torch.distributed``'s ``get_world_size`` and ``all_reduce`` over a world of ``size``
    ranks, one thread each (:meth:`run`). A group is a tuple of world ranks, None the whole world.
    Every all-reduce rank 0 takes part in is logged as (op, group) in ``calls``; tensors of
    different shapes or dtypes across a group raise (a real backend fails or hangs)."""

    ReduceOp = dist.ReduceOp
    _REDUCE = {
        dist.ReduceOp.SUM: lambda t: t.sum(0),
        dist.ReduceOp.MAX: lambda t: t.amax(0),
        dist.ReduceOp.MIN: lambda t: t.amin(0),
    }

    def __init__(self, size: int):
        self.size, self.calls = size, []
        self._slots = [None] * size
        self._barrier = threading.Barrier(size, timeout=60)
        self._local = threading.local()

    def get_world_size(self, group=None) -> int:
        return self.size if group is None else len(group)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None):
        ranks = range(self.size) if group is None else group
        rank = self._local.rank
        self._slots[rank] = tensor.clone()
        if rank == 0:
            self.calls.append((op, group))
        self._barrier.wait()
        parts = [self._slots[r] for r in ranks]
        if any(p.shape != tensor.shape or p.dtype != tensor.dtype for p in parts):
            raise RuntimeError("all_reduce over tensors of different shapes or dtypes")
        out = self._REDUCE[op](torch.stack(parts))
        self._barrier.wait()  # every rank has read the slots before the next collective
        tensor.copy_(out)

    def run(self, fn) -> list:
        """[fn(rank) for every rank], each rank in its own thread."""

        def one(rank):
            self._local.rank = rank
            try:
                return fn(rank)
            except BaseException:
                self._barrier.abort()  # the other ranks fail now instead of waiting
                raise

        with ThreadPoolExecutor(self.size) as pool:
            return [f.result() for f in [pool.submit(one, r) for r in range(self.size)]]


# ---- mixing decision --------------------------------------------------------------------------
# Neighbour table of a vocabulary of 10 ids (row v: v, then its neighbours).
TABLE = torch.tensor(
    [[0, 3, 7], [1, 0, 2], [2, 5, 9], [3, 0, 1], [4, 8, 1],
     [5, 6, 4], [6, 5, 4], [7, 2, 0], [8, 9, 0], [9, 8, 1]]
)  # fmt: skip
INF = math.inf
# Rows of full-vocabulary logits [4, 10]; split in two TP partitions of 5 ids: row 0's max (id 6)
# is in the second partition, row 1 ties ids 2 and 7 across the partitions, row 2's max is the
# padding id 8 and its candidates [0, 3, 7] include a real id of logit -inf (3) while id 5, where
# the first rank's clamped reads of other partitions land, is -inf too; row 3's anchor is the
# first partition's last column. Row 0's id 5 beats every id < 5: the anchor when only ids < 5
# are real would be wrong if the second partition took part.
LOGITS = torch.tensor(
    [
        [0.5, 1.0, -1.0, 0.25, 1.5, 2.5, 3.0, 0.0, -2.0, 1.0],
        [0.0, -0.5, 2.0, 1.0, 0.5, 1.5, -1.0, 2.0, 0.0, 0.0],
        [1.0, 0.5, 0.0, -INF, -1.0, -INF, 0.25, 0.75, 5.0, -3.0],
        [-1.0, 0.0, 0.5, 1.0, 2.0, 1.75, 0.0, -0.5, 0.0, 0.0],
    ]
)
MIXED = torch.tensor([True, False, True, True])


def _decision64(logits: torch.Tensor, table: torch.Tensor, tau: float, num_real: int):
    """(anchors, ids, weights) by definition, in Python floats: the highest logit among the
    real ids (the lowest id among ties), its table row, the softmax of z/τ over that row with
    padding ids at -inf."""
    out = ([], [], [])
    for z in logits.tolist():
        anchor = max(range(num_real), key=lambda v: (z[v], -v))
        ids = table[anchor].tolist()
        s = [z[c] / tau if c < num_real else -INF for c in ids]
        e = [math.exp(x - max(s)) for x in s]
        for part, value in zip(out, (anchor, ids, [x / sum(e) for x in e])):
            part.append(value)
    return out


def _assert_decision(d: MixDecision, logits, table, tau, num_real, mixed):
    anchor, ids, weights = _decision64(logits, table, tau, num_real)
    assert d.anchor.tolist() == anchor and d.ids.tolist() == ids
    assert d.mixed.tolist() == mixed.tolist() and d.weights.dtype == torch.float32
    for got, want in zip(d.weights.tolist(), weights):
        assert got == pytest.approx(want, rel=1e-6, abs=0.0)


@pytest.mark.parametrize("num_real", [8, 5])  # 5: the second partition holds no real id
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_decide_under_tp2_dp2_equals_the_float64_decision(monkeypatch, num_real, tau):
    """Ranks (0, 1) and (2, 3) are two TP groups (two DP replicas of different logits): each rank
    holds 5 of the 10 vocabulary columns, and every rank of a group decides its replica's rows
    as one process with the whole vocabulary would."""
    replicas = [LOGITS, 2.0 * LOGITS[[3, 2, 1, 0]] + 1.0]
    world = _ThreadWorld(4)
    monkeypatch.setattr(decision, "dist", world)

    def rank_decision(rank):
        replica, tp_rank = divmod(rank, 2)
        start = 5 * tp_rank
        local = replicas[replica][:, start : start + 5]
        group = (2 * replica, 2 * replica + 1)
        return decide(local, TABLE, tau, MIXED, num_real, vocab_start=start, tp_group=group)

    for rank, d in enumerate(world.run(rank_decision)):
        _assert_decision(d, replicas[rank // 2], TABLE, tau, num_real, MIXED)
    assert [op for op, _ in world.calls] == [
        dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.SUM,
    ]  # fmt: skip
    assert {group for _, group in world.calls} == {(0, 1)}


def test_decide_with_tp_groups_of_one_rank_needs_no_collective(monkeypatch):
    """Two DP replicas of one rank each (TP size 1): the single-process decision, and not one
    all-reduce."""
    world = _ThreadWorld(2)
    monkeypatch.setattr(decision, "dist", world)
    out = world.run(lambda rank: decide(LOGITS + rank, TABLE, 0.7, MIXED, 8, tp_group=(rank,)))
    for rank, d in enumerate(out):
        _assert_decision(d, LOGITS + rank, TABLE, 0.7, 8, MIXED)
    assert world.calls == []


def test_decide_with_an_on_demand_lookup_equals_the_float64_decision():
    weight = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))
    table = build_neighbor_table(weight, 0, 3)
    d = decide(LOGITS, NeighborLookup(weight, 0, 3), 0.7, MIXED, 8)
    _assert_decision(d, LOGITS, table, 0.7, 8, MIXED)


class _HostLookup:
    """A neighbour lookup that keeps its rows on the host; for meta anchors (no values) it
    returns row 0 for each."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return TABLE[[0] * ids.shape[0]]


def test_decision_outputs_are_on_the_logits_device():
    """Table, lookup rows, gate and skip mask on the host, logits on another device (meta):
    every output of the decision lives where the logits do."""
    logits = torch.zeros(4, 10, device="meta")
    for table in (TABLE, _HostLookup()):
        d = decide(logits, table, 1.0, MIXED, 8)
        assert [t.device.type for t in (d.mixed, d.anchor, d.ids, d.weights)] == ["meta"] * 4
    d.unmix_anchors(torch.zeros(10, dtype=torch.bool))
    assert d.mixed.device.type == "meta"
    assert anchors(logits[:, 8:], 8, vocab_start=8).device.type == "meta"  # no real id here
    assert id_mask([1, 3], 8, device="meta").device.type == "meta"


def test_anchor_ids_start_at_0_and_id_mask_stops_before_num_real():
    # The default partition starts at id 0: its last real id (3) can be the anchor.
    assert anchors(torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0]]), 4).tolist() == [3]
    assert id_mask([4, 2], 4).tolist() == [False, False, True, False]


def test_gate_mixes_where_the_draw_is_strictly_below_the_rate():
    u = gate_uniform(3, [5, 6], [1, 2])
    rate = float(u[0])  # a rate equal to the draw: not mixed
    assert gate(rate, 3, [5, 6], [1, 2]).tolist() == [False, float(u[1]) < rate]


def _splitmix_uniform(seed: int, *counters: int) -> float:
    """The counter draw in Python integers mod 2**64: h = mix(mix(c_1·M1 + mix(… c_n)) ^ seed),
    uniform = (h >> 11) / 2**53."""
    mask, m1, m2 = 2**64 - 1, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * m1) & mask
        x = ((x ^ (x >> 27)) * m2) & mask
        return x ^ (x >> 31)

    acc = mix(counters[-1] & mask)
    for c in reversed(counters[:-1]):
        acc = mix((c * m1 + acc) & mask)
    return (mix(acc ^ (seed & mask)) >> 11) / 2**53


@pytest.mark.parametrize("seed", [3, 2**63 + 3, 2**64 + 3])  # any int: its low 64 bits
def test_counter_uniform_of_three_counters_is_the_splitmix_chain(seed):
    assert counter_uniform(seed, [5, 6], [1, 2], [9, 0]).tolist() == [
        _splitmix_uniform(seed, 5, 1, 9), _splitmix_uniform(seed, 6, 2, 0),
    ]  # fmt: skip


def test_counter_uniform_hashes_int32_counters_as_int64_on_the_counters_device():
    key, pos = torch.tensor([5, 6]), torch.tensor([1, 2], dtype=torch.int32)
    assert counter_uniform(3, key, pos).tolist() == gate_uniform(3, [5, 6], [1, 2]).tolist()
    # A host counter first, one on another device (meta) second: drawn where the latter is.
    assert counter_uniform(3, key, pos.to("meta")).device.type == "meta"


# ---- mix records ------------------------------------------------------------------------------
def _record(weights, noise=None) -> MixRecord:
    n = len(weights)
    return MixRecord(
        seq=torch.arange(n),
        pos=torch.zeros(n, dtype=torch.long),
        ids=torch.zeros(n, len(weights[0]), dtype=torch.long),
        weights=torch.tensor(weights),
        num_seqs=n,
        noise=None if noise is None else torch.tensor(noise),
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: MixRecord.cat([]), "MixRecord.cat needs at least one record"),
        (
            lambda: MixRecord.cat([_record([[1.0]], [[0.5]]), _record([[1.0]])]),
            "MixRecord.cat: cannot mix records with and without noise",
        ),
        (
            lambda: MixRecord(
                *[torch.tensor([1])] * 2, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), 1
            ).validate([2], 4),
            "mix record sequence index out of range",
        ),  # fmt: skip
        (lambda: _record([[0.5, 0.4]]).validate([1], 4), "mix weights do not sum to 1"),
    ],
)
def test_record_errors_say_exactly_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        call()


def test_record_validate_sums_each_row_of_weights():
    # Rows sum to 1, columns do not (1.25 and 0.75): valid.
    _record([[1.0, 0.0], [0.25, 0.75]]).validate([1, 1], 4)


def test_record_empty_weights_are_float32_whatever_the_default_dtype():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert MixRecord.empty(2, 3).weights.dtype == torch.float32
    finally:
        torch.set_default_dtype(old)


def test_record_sorted_and_select_carry_each_mix_s_weights():
    r = _record([[1.0, 0.0], [0.25, 0.75], [0.5, 0.5]])
    r.seq, r.num_seqs = torch.tensor([2, 0, 1]), 3
    assert r.sorted().weights.tolist() == [[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]]
    assert r.select([2, 1]).weights.tolist() == [[1.0, 0.0], [0.5, 0.5]]


def test_record_select_of_no_sequence_is_empty():
    sel = _record([[1.0], [1.0]]).select([])
    assert (sel.num_seqs, len(sel), sel.k) == (0, 0, 1)


def test_pad_k_pads_with_the_value_given():
    assert _pad_k(torch.tensor([[1.0], [2.0]]), 3, 7.0).tolist() == [
        [1.0, 7.0, 7.0],
        [2.0, 7.0, 7.0],
    ]
