"""The mixing embedding (mixing/embedding.py) by value, in one process: MixBatch's constructors and
cuts against exact expected positions; the embedding's output and weight gradient at TP=1
(autograd's gradient and megatron DDP's ``main_grad``) against float64 references written out
here; a TP=2 rank's share (its vocab partition; the 16-bit candidate reduce simulated) summed over
both ranks. They kill the mutants scripts/mutation_score.sh found surviving
(bench/results/mutation_score.md); tests/test_mixing.py's torchrun cases check real TP sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from torch.overrides import TorchFunctionMode

from megatron_ngrpo.mixing import embedding as E
from megatron_ngrpo.mixing.arithmetic import mix_rows
from megatron_ngrpo.mixing.embedding import (
    MixBatch,
    MixingVocabParallelEmbedding,
    install_mixing_embedding,
    mixing_embedding,
    mixing_inputs,
    to_device,
)
from tests.harness.records import mix_record

V, H, K = 16, 4, 3
# Tokens use even ids (0 and V/2 = 8, the TP=2 boundary, included), candidates odd ones and a
# weight-0 padding id 0: row 14 is named by neither; the first row no candidate names (2) is a
# token's, the first row no token names (1) a candidate's.
TOKENS = [[0, 2, 4, 2, 6], [0, 8, 10, 12, 2]]
MIXES = [  # (batch row, column), candidate ids, weights
    ((0, 1), [1, 9, 3], [0.5, 0.3, 0.2]),
    ((0, 3), [3, 5, 0], [0.6, 0.4, 0.0]),
    ((1, 0), [7, 15, 9], [0.25, 0.25, 0.5]),
    ((1, 4), [11, 1, 13], [0.7, 0.2, 0.1]),
]


pytestmark = pytest.mark.usefixtures("single_rank")


def _weight(dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(V, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(
        dtype
    )


def _noise(shape=(2, 5)) -> torch.Tensor:
    return 0.1 * torch.randn(*shape, H, generator=torch.Generator().manual_seed(7))


def _dense(shape=(2, 5), noise=None) -> tuple:
    """MIXES as from_dense's ids [B, S, k], weights [B, S, k] float64, mask [B, S], noise."""
    ids = torch.zeros(*shape, K, dtype=torch.long)
    weights = torch.zeros(*shape, K, dtype=torch.float64)
    mask = torch.zeros(shape, dtype=torch.bool)
    for (b, s), i, w in MIXES:
        ids[b, s], weights[b, s], mask[b, s] = torch.tensor(i), torch.tensor(w), True
    return ids, weights, mask, noise


def _reference(weight, tokens, noise, grad, embedding_grad=True, mixes=MIXES):
    """float64 output [B, S, h] and weight gradient [V, h] of Σ out·grad, element by element
    (``mixes`` at ``tokens``' positions); weight-0 candidates take no gradient."""
    w, g = weight.double(), grad.double()
    out, wgrad = w[tokens].clone(), torch.zeros_like(w)
    # the batch's weights are fp32
    mixed = {pos: (ids, torch.tensor(ws).float().tolist()) for pos, ids, ws in mixes}
    for b in range(tokens.shape[0]):
        for s in range(tokens.shape[1]):
            if (b, s) not in mixed:
                wgrad[tokens[b, s]] += g[b, s]
                continue
            out[b, s] = sum(a * w[c] for c, a in zip(*mixed[b, s]))
            if noise is not None:
                out[b, s] += noise[b, s].double()
            for c, a in zip(*mixed[b, s]):
                if embedding_grad and a:
                    wgrad[c] += a * g[b, s]
    return out, wgrad


class _Model(torch.nn.Module):
    """A first stage's ``embedding.word_embeddings`` (GPTModel's attribute path)."""

    def __init__(self, weight, reduce_scatter=False, tp_group=None):
        super().__init__()
        cfg = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False)
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = VocabParallelEmbedding(
            V,
            H,
            init_method=torch.nn.init.zeros_,
            config=cfg,
            reduce_scatter_embeddings=reduce_scatter,
            tp_group=tp_group,
        )
        emb = self.embedding.word_embeddings
        emb.to(weight.dtype).weight.data.copy_(weight[emb.vocab_start_index : emb.vocab_end_index])


def _embedding(weight, embedding_grad=True, **kw) -> MixingVocabParallelEmbedding:
    emb = install_mixing_embedding(_Model(weight, **kw), embedding_grad)
    assert type(emb) is MixingVocabParallelEmbedding and emb.embedding_grad is embedding_grad
    return emb


def _close(got, want, tol):
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


# ---- to_device and MixBatch ---------------------------------------------------------------------
class _Copies(TorchFunctionMode):
    """Records ``Tensor.to`` (source device type, target, non_blocking) and ``pin_memory``; a CUDA
    target is faked (the tensor stays), and a meta → host copy gives an empty host tensor."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:
            self.calls.append("pin")
            return args[0]
        if func is not torch.Tensor.to:
            return func(*args, **kwargs)
        t, target = args[0], (args[1:] or [kwargs.get("device")])[0]
        self.calls.append((t.device.type, str(target), kwargs.get("non_blocking")))
        if str(target) == "cuda" or (t.device.type, str(target)) == ("meta", "cpu"):
            return torch.empty(t.shape, dtype=t.dtype)
        return func(*args, **kwargs)


@pytest.mark.parametrize(
    "source, target, calls",
    [
        ("cpu", "meta", [("cpu", "meta", True)]),
        ("cpu", "cuda", ["pin", ("cpu", "cuda", True)]),
        ("meta", "meta", [("meta", "meta", None)]),
        ("meta", "cpu", [("meta", "cpu", None)]),  # a device → host copy must block
    ],
)
def test_to_device_pins_and_copies_only_host_tensors_without_blocking(source, target, calls):
    t = torch.zeros(3, device=source)
    with _Copies() as copies:
        out = to_device(t, target)
    assert copies.calls == calls and out.shape == (3,)
    cpu = torch.arange(3)
    assert to_device(cpu, "cpu") is cpu


@pytest.mark.parametrize("with_noise", [False, True])
def test_from_dense_takes_the_mixed_positions_in_order(with_noise):
    noise = _noise().double() if with_noise else None
    ids, weights, mask, _ = _dense()
    mix = MixBatch.from_dense(ids, weights, mask, noise)
    assert mix.rows.tolist() == mix.host_rows.tolist() == [1, 3, 5, 9] and mix.num_mixed == 4
    assert mix.ids.tolist() == [m[1] for m in MIXES] and mix.shape == (2, 5)
    assert mix.weights.dtype == torch.float32
    assert mix.weights.tolist() == torch.tensor([m[2] for m in MIXES]).float().tolist()
    assert torch.equal(mix.mask, mask)
    if with_noise:
        assert mix.noise.dtype == torch.float32
        assert torch.equal(mix.noise, noise.view(10, H)[[1, 3, 5, 9]].float())
    else:
        assert mix.noise is None
    one = MixBatch.from_dense(ids[:1, :2], weights[:1, :2], mask[:1, :2])  # a single mix
    assert one.rows.tolist() == [1] and one.ids.tolist() == [[1, 9, 3]] and one.shape == (1, 2)


@pytest.mark.parametrize("with_noise", [False, True])
def test_from_record_places_mixes_after_each_prompt(with_noise):
    record = mix_record(
        [[(0, [1, 9, 3], [0.5, 0.3, 0.2]), (2, [3, 5], [0.6, 0.4])], [(1, [7, 15], [0.5, 0.5])]],
        k=K,
    )
    noise = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
    record = dataclasses.replace(record, noise=noise if with_noise else None)
    mix = MixBatch.from_record(record, torch.tensor([1, 0]), seq_len=5)
    assert mix.rows.tolist() == [1, 3, 6] and mix.host_rows is mix.rows and mix.shape == (2, 5)
    assert torch.equal(mix.ids, record.ids) and torch.equal(mix.weights, record.weights)
    assert (mix.noise is None) if not with_noise else torch.equal(mix.noise, noise)
    on_meta = MixBatch.from_record(record, torch.tensor([1, 0]), 5, device="meta")
    assert on_meta.rows.device.type == "meta" and on_meta.host_rows.tolist() == [1, 3, 6]


@pytest.mark.parametrize("with_noise", [False, True])
def test_to_moves_every_tensor_but_the_host_rows(with_noise):
    mix = MixBatch.from_dense(*_dense(noise=_noise() if with_noise else None))
    assert mix.to("cpu") is mix
    moved = mix.to("meta")
    assert moved.shape == mix.shape and moved.host_rows is mix.host_rows
    for name in ("rows", "ids", "weights") + (("noise",) if with_noise else ()):
        got, want = getattr(moved, name), getattr(mix, name)
        assert (got.device.type, got.shape, got.dtype) == ("meta", want.shape, want.dtype), name
    assert with_noise or moved.noise is None


def _expect(mix, entries, host_rows, shape):
    """``mix`` holds entries ``entries`` of MIXES at ``host_rows`` of a ``shape`` batch."""
    assert mix.host_rows.tolist() == mix.rows.tolist() == host_rows and mix.shape == shape
    assert mix.ids.tolist() == [MIXES[e][1] for e in entries]
    assert mix.weights.tolist() == [torch.tensor(MIXES[e][2]).float().tolist() for e in entries]


@pytest.mark.parametrize("with_noise", [False, True])
def test_select_renumbers_rows_and_drops_columns(with_noise):
    """Batch rows [1, 0] become rows 1 and 0 of a [3, 4] batch: entry 3 (column 4) is dropped;
    batch row [1] alone, cut at 3 columns, keeps entry 2 only."""
    noise = _noise() if with_noise else None
    mix = MixBatch.from_dense(*_dense(noise=noise))
    got = mix.select(torch.tensor([1, 0]), seq_len=4, num_rows=3)
    _expect(got, [0, 1, 2], [5, 7, 0], (3, 4))
    assert got.noise is None if noise is None else torch.equal(got.noise, mix.noise[:3])
    _expect(mix.select(torch.tensor([1]), seq_len=3, num_rows=1), [2], [0], (1, 3))


@pytest.mark.parametrize("with_noise", [False, True])
def test_packed_concatenates_each_rows_first_tokens(with_noise):
    """Row r's first lengths[r] tokens (clamped to 0..S) concatenated: lengths [9, 5] keep every
    mix (row 1 starts at 5); [-1, 9] keep row 1's from column 0; [3, 4] drop the mixes at
    column 3 of row 0 and column 4 of row 1 (row 1 starts at 3)."""
    noise = _noise() if with_noise else None
    mix = MixBatch.from_dense(*_dense(noise=noise))
    _expect(mix.packed(torch.tensor([9, 5]), 10), [0, 1, 2, 3], [1, 3, 5, 9], (1, 10))
    _expect(mix.packed(torch.tensor([-1, 9]), 5), [2, 3], [0, 4], (1, 5))
    got = mix.packed(torch.tensor([3, 4], dtype=torch.int32), 7)
    _expect(got, [0, 2], [1, 3], (1, 7))
    assert got.noise is None if noise is None else torch.equal(got.noise, mix.noise[[0, 2]])


# ---- the embedding at TP=1 ----------------------------------------------------------------------
def _grad(shape=(2, 5), dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, H, generator=torch.Generator().manual_seed(5)).to(dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("embedding_grad", [True, False])
@pytest.mark.parametrize("with_noise", [False, True])
def test_mixed_rows_and_weight_grad_equal_float64(dtype, tol, embedding_grad, with_noise):
    """Mixed rows Σ w·E[c] (+ noise), plain rows E[token]; the weight gradient of Σ out·grad
    reaches the candidates scaled by their weights (none with ``embedding_grad`` False)."""
    weight, noise, tokens = _weight(dtype), _noise() if with_noise else None, torch.tensor(TOKENS)
    emb = _embedding(weight, embedding_grad)
    out = emb(tokens, MixBatch.from_dense(*_dense(noise=noise)))
    grad = _grad(dtype=dtype)
    out.backward(grad)
    want, want_grad = _reference(weight, tokens, noise, grad, embedding_grad)
    assert out.dtype == dtype and emb.weight.grad.dtype == dtype
    _close(out, want, tol)
    _close(emb.weight.grad, want_grad, tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_noise", [False, True])
def test_16bit_rows_are_the_engines_mix_rows_and_grad_is_rounded_once(dtype, with_noise):
    """16-bit weights: mixed rows are ``mix_rows`` of the candidate rows bit for bit, plain rows
    the weight's; the gradient is accumulated in fp32 and rounded once (token 2 takes 3 rows)."""
    weight, noise, tokens = _weight(dtype), _noise() if with_noise else None, torch.tensor(TOKENS)
    mix = MixBatch.from_dense(*_dense(noise=noise))
    out = _embedding(weight)(tokens, mix)
    want = weight[tokens].view(10, H)
    want[mix.rows] = mix_rows(weight[mix.ids], mix.weights, mix.noise)
    assert torch.equal(out.view(10, H).view(torch.int16), want.view(torch.int16))
    emb = _embedding(weight)
    grad = 10 * _grad(dtype=dtype)
    emb(tokens, mix).backward(grad)
    assert torch.equal(emb.weight.grad, _reference(weight, tokens, noise, grad)[1].to(dtype))


def test_without_mixes_it_is_megatrons_embedding_and_mixes_come_from_mixing_inputs():
    """No mix, or one with nothing mixed, is megatron's lookup (output and gradient); the mixes
    of ``mixing_inputs`` apply inside its block only; a mix of another shape is refused."""
    weight, tokens = _weight(), torch.tensor(TOKENS)
    model = _Model(weight)
    emb = install_mixing_embedding(model)
    plain, plain_grad = _reference(weight, tokens, None, _grad(), mixes=[])
    for none in (None, MixBatch.from_dense(*_dense()[:2], torch.zeros(2, 5, dtype=torch.bool))):
        emb.weight.grad = None
        out = emb(tokens, none)
        out.backward(_grad())
        assert torch.equal(out.double(), plain)
        _close(emb.weight.grad, plain_grad, 1e-6)
    mix = MixBatch.from_dense(*_dense())
    mixed = _reference(weight, tokens, None, _grad())[0]  # MIXES
    with mixing_inputs(model, mix):
        _close(emb(tokens), mixed, 1e-6)
        assert torch.equal(emb(tokens, None).double(), emb(tokens, mix).double())
    with mixing_inputs(torch.nn.Linear(1, 1), mix), mixing_inputs(model, None):
        assert emb._pending is None and torch.equal(emb(tokens).double(), plain)
    with pytest.raises(ValueError, match=r"mixes of a \(2, 5\) batch for input ids \(1, 10\)"):
        emb(tokens.view(1, 10), mix)


def test_sequence_parallel_output_is_sequence_major():
    """Under sequence parallelism the output is [S, B, h] (reduce-scattered over S; TP=1 here)."""
    weight, tokens, noise = _weight(), torch.tensor(TOKENS), _noise()
    out = _embedding(weight, reduce_scatter=True)(tokens, MixBatch.from_dense(*_dense(noise=noise)))
    assert out.shape == (5, 2, H)
    _close(out, _reference(weight, tokens, noise, _grad())[0].transpose(0, 1), 1e-6)


def test_a_weight_0_candidate_takes_no_gradient_even_from_an_inf():
    """Padding candidates (weight 0) go to the sink: 0·inf would put a nan into their row."""
    weight, tokens = _weight(), torch.tensor(TOKENS)
    grad = _grad()
    grad[0, 3, 0] = float("inf")  # the mix with padding id 0 (row 0 is token (0, 0)'s too)
    emb = _embedding(weight)
    emb(tokens, MixBatch.from_dense(*_dense())).backward(grad)
    want = _reference(weight, tokens, None, grad)[1]
    assert torch.equal(emb.weight.grad.double().isinf(), want.isinf()) and want.isinf().sum() == 2
    finite = want.isfinite()
    _close(emb.weight.grad[finite], want[finite], 1e-6)


# ---- megatron DDP's main_grad ---------------------------------------------------------------------
def _ddp(emb, dtype=torch.float32) -> torch.Tensor:
    """megatron DDP's protocol on the weight (the backward adds into ``main_grad`` itself, here
    holding an earlier micro-batch's sum); returns that earlier sum."""
    before = torch.randn(V, H, generator=torch.Generator().manual_seed(9)).to(dtype)
    emb.weight.main_grad = before.clone()
    emb.weight.grad_added_to_main_grad = False
    return before


def _nan_empty(size, dtype=None, device=None):
    """``torch.empty`` whose garbage is visible (nan)."""
    return torch.full(size, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["mixed", "no_embedding_grad", "every_row_named", "plain"])
def test_ddp_backward_adds_into_main_grad(dtype, case, monkeypatch):
    """``main_grad`` (fp32) gains the float64 gradient, unrounded for bf16 weights; a row no id
    names takes the excluded positions and is restored (``every_row_named``: none is free, they
    add -0.0 to row 0). The returned gradient is an uninitialised dummy (the hook discards it)."""
    shape = (2, 8) if case == "every_row_named" else (2, 5)
    tokens = torch.tensor(TOKENS)
    if case == "every_row_named":
        tokens = torch.randperm(V, generator=torch.Generator().manual_seed(2)).view(shape)
    weight, noise, grad = _weight(dtype), _noise(shape), _grad(shape, dtype)
    emb = _embedding(weight, embedding_grad=case != "no_embedding_grad")
    before = _ddp(emb)
    mix = None if case == "plain" else MixBatch.from_dense(*_dense(shape, noise))
    out = emb(tokens, mix)
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", _nan_empty)
        out.backward(grad)
    mixes = [] if case == "plain" else MIXES
    want, want_grad = _reference(weight, tokens, noise, grad, case != "no_embedding_grad", mixes)
    _close(out, want, 1e-6 if dtype == torch.float32 else 2**-8)
    _close(emb.weight.main_grad, before.double() + want_grad, 1e-6)
    assert emb.weight.grad_added_to_main_grad and emb.weight.grad.dtype == dtype
    assert emb.weight.grad.isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False])
def test_ddp_dummy_gradient_is_zeros_where_autograd_adds_it(dtype, tied, monkeypatch):
    """Tied to a second consumer (``zero_out_wgrad``) the weight's gradient is exactly that
    consumer's; a ``param.grad`` already there (aliasing ``main_grad`` after a step) gains 0."""
    weight, tokens, grad = _weight(dtype), torch.tensor(TOKENS), _grad(dtype=dtype)
    emb = _embedding(weight)
    _ddp(emb)
    probe = torch.ones(3, H, dtype=dtype)
    if tied:
        emb.weight.zero_out_wgrad = True
    else:
        emb.weight.grad = torch.zeros_like(emb.weight)
    loss = (emb(tokens, MixBatch.from_dense(*_dense())) * grad).sum()
    loss = loss + (probe @ emb.weight.t()).sum() if tied else loss
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", _nan_empty)
        loss.backward()
    assert torch.equal(emb.weight.grad, torch.full((V, H), 3.0 if tied else 0.0, dtype=dtype))


def test_a_16bit_main_grad_is_left_to_the_dense_gradient():
    """A bf16 ``main_grad`` would round every row addition: the dense gradient is returned and
    the hook adds it (``main_grad`` untouched here)."""
    weight, tokens, grad = _weight(), torch.tensor(TOKENS), _grad()
    emb = _embedding(weight)
    before = _ddp(emb, torch.bfloat16)
    emb(tokens, MixBatch.from_dense(*_dense())).backward(grad)
    assert torch.equal(emb.weight.main_grad, before) and not emb.weight.grad_added_to_main_grad
    _close(emb.weight.grad, _reference(weight, tokens, None, grad)[1], 1e-6)


# ---- a TP=2 rank's share, in one process ----------------------------------------------------------
class _Group:
    """A TP group's size and rank: all megatron's vocab range and the partition masks read."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _simulate_group(monkeypatch, group, mix, weight, lo, hi):
    """torch.distributed as ``group``'s rank sees it; the 16-bit candidate reduce adds the other
    rank's rows (the candidates outside [lo, hi)) and -0.0 elsewhere, as that rank does."""
    outside = ((mix.ids < lo) | (mix.ids >= hi)).unsqueeze(-1)
    others = weight[mix.ids].masked_fill(~outside, -0.0)

    def reduce(t, dst, group):
        assert dst == 0 and group is expected
        t.add_(others)

    def rank_of(group):
        assert group is expected
        return expected.rank()

    def global_rank(group, rank):
        assert group is expected
        return rank

    expected = group
    monkeypatch.setattr(E.dist, "reduce", reduce)
    monkeypatch.setattr(E.dist, "get_rank", rank_of)
    monkeypatch.setattr(E.dist, "get_global_rank", global_rank)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp2_rank_shares_sum_to_the_full_embedding(dtype, monkeypatch):
    """Each rank looks up its vocab half (ids 0 and 8 sit on the boundaries), noise on rank 0
    only; the shares' sum is the TP=1 embedding (16-bit: rank 0 mixes the full candidate rows,
    bit for bit ``mix_rows``, -0.0 in column 0 kept, rank 1 adds -0.0) and each rank's weight
    gradient its half of the float64 one."""
    weight, tokens, noise, grad = _weight(dtype), torch.tensor(TOKENS), _noise(), _grad(dtype=dtype)
    weight[:, 0], noise[..., 0] = -0.0, -0.0
    mix = MixBatch.from_dense(*_dense(noise=noise))
    want, want_grad = _reference(weight, tokens, noise, grad)
    shares = []
    for rank in (0, 1):
        group = _Group(2, rank)
        emb = _embedding(weight, tp_group=group)
        lo, hi = emb.vocab_start_index, emb.vocab_end_index
        assert (lo, hi) == (8 * rank, 8 * rank + 8)
        _simulate_group(monkeypatch, group, mix, weight, lo, hi)
        share = emb._mixed_local_rows(tokens, mix, None)
        share.backward(grad)
        if dtype == torch.float32:
            _close(emb.weight.grad, want_grad[lo:hi], 1e-6)
        else:
            assert torch.equal(emb.weight.grad, want_grad[lo:hi].to(dtype))
        shares.append(share.detach())
    total = (shares[0] + shares[1]).view(10, H)
    if dtype == torch.float32:
        _close(total, want.view(10, H), 1e-6)
        return
    mixed = mix_rows(weight[mix.ids], mix.weights, mix.noise)
    assert torch.equal(total[mix.rows].view(torch.int16), mixed.view(torch.int16))
    assert torch.equal(total, weight[tokens].view(10, H).index_copy(0, mix.rows, mixed))


# ---- helpers and installation ---------------------------------------------------------------------
def test_unused_row_is_the_first_row_no_id_names():
    target = torch.zeros(6, 2)
    assert E._unused_row(target, torch.tensor([0, 2]), torch.tensor([[1, 4], [2, 0]])) == 3
    assert E._unused_row(target, torch.arange(6)) is None
    assert E._unused_row(target.to("meta"), torch.tensor([0])) is None  # on a GPU: never


def test_add_rows_skips_the_sink_only_when_it_is_no_row_of_the_target():
    """sink 2 is a row (it gains its entries); sink 3 is none: its entries add -0.0 to row 0,
    which keeps it bit for bit (-0.0 here); a 1-row target has no row 1 to send them to."""
    src = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    target = torch.zeros(3, 2)
    E._add_rows(target, torch.tensor([2, 1, 2]), src, sink=2)
    assert target.tolist() == [[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]]
    target = torch.full((3, 2), -0.0)
    E._add_rows(target, torch.tensor([3, 1, 3]), src, sink=3)
    want = torch.tensor([[-0.0, -0.0], [3.0, 4.0], [-0.0, -0.0]])
    assert torch.equal(target.view(torch.int32), want.view(torch.int32))
    one = torch.full((1, 2), -0.0)
    E._add_rows(one, torch.tensor([1, 0]), src[:2], sink=1)
    assert one.tolist() == [[3.0, 4.0]]


def test_install_and_find_the_mixing_embedding():
    model = _Model(_weight())
    assert mixing_embedding(model) is None  # megatron's class still
    emb = install_mixing_embedding(model)
    assert emb is model.embedding.word_embeddings and emb.embedding_grad is True
    assert install_mixing_embedding(model, embedding_grad=False).embedding_grad is False
    wrapper = torch.nn.Module()  # DDP / Float16Module keep the model as ``module``
    wrapper.module = model
    assert mixing_embedding(wrapper) is emb
    later_stage, no_words = torch.nn.Linear(1, 1), torch.nn.Module()
    no_words.embedding = torch.nn.Module()
    assert mixing_embedding(later_stage) is None and mixing_embedding(no_words) is None
    no_words.embedding.word_embeddings = torch.nn.Linear(1, 1)
    with pytest.raises(TypeError, match="expected a VocabParallelEmbedding, found Linear"):
        install_mixing_embedding(no_words)
