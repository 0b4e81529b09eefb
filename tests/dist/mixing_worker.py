"""Cases of the mixing core, run under one 4-process torchrun launch (tests/test_mixing.py).

References are float64 and single-process (:mod:`tests.harness.reference`): brute-force
neighbour tables, Σ w·E by the definition, decisions by the definition, and a tiny Qwen2-like
GPTModel at TP=1 in float64 fed the reference mixed embeddings as ``decoder_input``. Every layout
loads the reference weights through megatron's sharding metadata (``reference.local_shards``),
and the float64 reference gradients are mapped the same way, so each rank compares its own shards elementwise.
"""

from __future__ import annotations

import os
import tempfile
from typing import NamedTuple

import torch

from tests.harness.multiproc import case, run_cases

VOCAB, NUM_REAL, PADDED = 500, 480, 512
SPECIAL = [0, 1]
B, S, K = 2, 8, 3
TOL = 1e-6
# Weight grads through 4 fp32 transformer layers: a few fp32 ulps of the largest entry.
TOL_GRAD = 4e-6
_S: dict = {}


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = TOL) -> float:
    """Max abs difference / max(1, |b|max), asserted ≤ tol; returned for the report."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    err = float((a - b).abs().max()) if a.numel() else 0.0
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:g} × {scale:.3g}"
    return err / scale


def _groups():
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_data_parallel_group(),
        ps.get_tensor_model_parallel_rank(),
    )


# ---- neighbour table ------------------------------------------------------------------------
def _matrices() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    centers = torch.randn(5, 8, generator=g)
    clusters = centers[torch.randint(0, 5, (64,), generator=g)] + 1e-3 * torch.randn(
        64, 8, generator=g
    )
    ties = torch.randint(
        -1, 2, (64, 4), generator=g
    ).float()  # many duplicate rows and equal scores
    ties[5] = 0.0  # a zero row (cosine 0 to everything)
    return {"random": torch.randn(64, 6, generator=g), "ties": ties, "clusters": clusters}


@case
def neighbor_table_matches_bruteforce():
    """TP=1 (DP=4), TP=2 (DP=2 and no DP split), TP=4; four metrics; exclusions; chunks that
    straddle partitions; cosine and dot under both scoring screens (fp32, bf16) whatever the
    CPU has."""
    from megatron_ngrpo.mixing import gemm_cpu
    from megatron_ngrpo.mixing.neighbors import build_neighbor_table
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.reference import neighbor_table64

    mats = _matrices()
    exclude = torch.zeros(64, dtype=torch.bool)
    exclude[[3, 17, 40, 41, 63]] = True
    refs, checked = {}, 0
    combos = [
        (name, metric, 5, exclude) for name in mats for metric in ("cosine", "l2", "l1", "dot")
    ]
    combos += [("random", metric, 2, None) for metric in ("cosine", "l2", "l1", "dot")]
    auto = gemm_cpu.screen_dtype
    for tp, screen in [
        (tp, screen) for tp in (1, 2, 4) for screen in (torch.float32, torch.bfloat16)
    ]:
        gemm_cpu.screen_dtype = lambda device, metric, screen=screen: (
            screen if metric in ("cosine", "dot") else torch.float32
        )
        initialize_model_parallel(tp=tp)
        tp_group, dp_group, rank = _groups()
        n = 64 // tp
        for name, metric, k, exc in combos:
            key = (name, metric, k)
            if key not in refs:
                refs[key] = neighbor_table64(mats[name], k, metric, exc)
            for dp in (dp_group, None) if tp == 2 else (dp_group,):
                w = mats[name][rank * n : (rank + 1) * n]
                got = build_neighbor_table(
                    w, rank * n, k, metric, exc, chunk_size=24, tp_group=tp_group, dp_group=dp
                )
                assert torch.equal(got, refs[key]), (
                    f"tp={tp} {screen} {key}: {(got != refs[key]).nonzero()[:4].tolist()}"
                )
                if exc is not None:
                    assert not exclude[got[:, 1:]].any()
                checked += 1
    gemm_cpu.screen_dtype = auto
    return {"tables_checked": checked}


# ---- mixing embedding alone -----------------------------------------------------------------
class Dense(NamedTuple):
    """Mixes in dense form (the float64 reference's): ids [B, S, k], weights [B, S, k], mask
    [B, S] bool, noise [B, S, h] or None."""

    ids: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    noise: torch.Tensor | None = None

    def batch(self):
        from megatron_ngrpo.mixing.embedding import MixBatch

        return MixBatch.from_dense(*self)

    @classmethod
    def of(cls, mix) -> Dense:
        """The dense form of a MixBatch."""
        b, s = mix.shape
        ids = torch.zeros(b * s, mix.ids.shape[1], dtype=torch.long).index_copy_(
            0, mix.rows, mix.ids
        )
        weights = torch.zeros(b * s, mix.ids.shape[1]).index_copy_(0, mix.rows, mix.weights)
        noise = None
        if mix.noise is not None:
            noise = (
                torch.zeros(b * s, mix.noise.shape[1])
                .index_copy_(0, mix.rows, mix.noise)
                .view(b, s, -1)
            )
        return cls(ids.view(b, s, -1), weights.view(b, s, -1), mix.mask, noise)


def _mix_batch(
    vocab: int,
    num_real: int,
    hidden: int,
    seed: int,
    rate: float = 0.4,
    noise: bool = False,
    b: int = B,
    s: int = S,
) -> tuple[torch.Tensor, Dense]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, num_real, (b, s), generator=g)
    ids = torch.randint(0, num_real, (b, s, K), generator=g)
    w = torch.rand(b, s, K, generator=g)
    mask = torch.rand(b, s, generator=g) < rate
    mask[0, 1] = True  # at least one mix
    nz = 0.1 * torch.randn(b, s, hidden, generator=g) if noise else None
    return tokens, Dense(ids, w / w.sum(-1, keepdim=True), mask, nz)


def _standalone_embedding(
    tp: int, weight: torch.Tensor, embedding_grad: bool = True, sequence_parallel: bool = False
):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from megatron_ngrpo.mixing.embedding import MixingVocabParallelEmbedding

    cfg = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        perform_initialization=False,
        sequence_parallel=sequence_parallel,
    )
    plain = VocabParallelEmbedding(
        weight.shape[0],
        weight.shape[1],
        init_method=torch.nn.init.zeros_,
        config=cfg,
        reduce_scatter_embeddings=sequence_parallel,
    )
    plain.weight.data.copy_(weight[plain.vocab_start_index : plain.vocab_end_index])
    mixing = VocabParallelEmbedding(
        weight.shape[0],
        weight.shape[1],
        init_method=torch.nn.init.zeros_,
        config=cfg,
        reduce_scatter_embeddings=sequence_parallel,
    )
    mixing.__class__ = MixingVocabParallelEmbedding
    mixing.embedding_grad = embedding_grad
    mixing.weight.data.copy_(plain.weight.data)
    return plain, mixing


@case
def embedding_matches_reference():
    """TP=1,2,4: ρ=0 is exactly megatron's embedding (output and grads); mixed rows = Σ w·E[c]
    (+ recorded noise) and weight grads equal float64; embedding_grad=False removes exactly the
    mixture's gradient."""
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.reference import mixed_embedding64

    v, h = 64, 16
    weight = torch.randn(v, h, generator=torch.Generator().manual_seed(3))
    errs = {}
    for tp in (1, 2, 4):
        initialize_model_parallel(tp=tp)
        tokens, mix = _mix_batch(v, v, h, seed=tp, noise=True)
        grad = torch.randn(B, S, h, generator=torch.Generator().manual_seed(11))
        plain, mixing = _standalone_embedding(tp, weight)
        lo, hi = plain.vocab_start_index, plain.vocab_end_index

        no_mix = mix._replace(mask=torch.zeros_like(mix.mask)).batch()
        a, b = plain(tokens), mixing(tokens, no_mix)
        a.backward(grad), b.backward(grad)
        assert torch.equal(a, b) and torch.equal(plain.weight.grad, mixing.weight.grad), (
            f"tp={tp}: ρ=0 differs"
        )

        for with_grad in (True, False):
            _, mixing = _standalone_embedding(tp, weight, embedding_grad=with_grad)
            out = mixing(tokens, mix.batch())
            out.backward(grad)
            w64 = weight.double().requires_grad_()
            if with_grad:
                ref = mixed_embedding64(w64, tokens, mix.ids, mix.weights, mix.mask, mix.noise)
            else:  # mixed rows: the detached mixture
                plain_rows = w64[tokens] * (~mix.mask).unsqueeze(-1)
                ref = plain_rows + mixed_embedding64(
                    w64.detach(), tokens, mix.ids, mix.weights, mix.mask, mix.noise
                ) * mix.mask.unsqueeze(-1)
            ref.backward(grad.double())
            errs[f"tp{tp}_grad{with_grad}_fwd"] = _close(out, ref, f"tp={tp} forward")
            errs[f"tp{tp}_grad{with_grad}_bwd"] = _close(
                mixing.weight.grad, w64.grad[lo:hi], f"tp={tp} weight grad"
            )
    return errs


@case
def embedding_main_grad_under_ddp():
    """TP=1,2,4 under megatron DDP, where the backward adds into ``main_grad`` itself: four
    micro-batches (mixed with noise, none mixed, mixed, mixed with every row of the vocabulary
    named: no unused row to take the excluded positions) accumulate the float64 sum of their
    gradients, with and without the mixture's gradient; tied to a second consumer
    (``zero_out_wgrad``, as megatron marks a shared embedding/output weight at PP=1) the
    consumer's gradient is added exactly once; bf16 weights accumulate into the fp32 ``main_grad``
    unrounded; the hook leaves no ``param.grad``."""
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.reference import mixed_embedding64
    from tests.harness.tiny import in_megatron_ddp

    v, h = 64, 16
    weight = torch.randn(v, h, generator=torch.Generator().manual_seed(3))
    errs = {}
    for tp in (1, 2, 4):
        initialize_model_parallel(tp=tp)
        batches = [_mix_batch(v, v, h, seed=10 * tp + i, noise=i == 0) for i in range(3)]
        batches[1] = (
            batches[1][0],
            batches[1][1]._replace(mask=torch.zeros(B, S, dtype=torch.bool)),
        )
        every_row = _mix_batch(v, v, h, seed=10 * tp + 3, b=4, s=v // 4)[1]
        batches.append(
            (torch.randperm(v, generator=torch.Generator().manual_seed(4)).view(4, -1), every_row)
        )
        grads = [
            torch.randn(*t.shape, h, generator=torch.Generator().manual_seed(20 + i))
            for i, (t, _) in enumerate(batches)
        ]
        probe = torch.randn(
            5, h, generator=torch.Generator().manual_seed(30)
        )  # the tied consumer's input
        for with_grad, tied, dtype in (
            (True, False, torch.float32),
            (False, False, torch.float32),
            (True, True, torch.float32),
            (True, False, torch.bfloat16),
        ):
            _, mixing = _standalone_embedding(tp, weight, embedding_grad=with_grad)
            lo, hi = mixing.vocab_start_index, mixing.vocab_end_index
            ddp = in_megatron_ddp(mixing.to(dtype), tp)
            if tied:
                mixing.weight.zero_out_wgrad = True
            ddp.zero_grad_buffer()
            w64 = weight.double().requires_grad_()
            for (tokens, mix), grad in zip(batches, grads):
                out = ddp(tokens, mix.batch())
                grad = grad.to(dtype)  # the gradient reaching a bf16 output is bf16
                loss = (out * grad).sum()
                ref = mixed_embedding64(
                    w64 if with_grad else w64.detach(),
                    tokens,
                    mix.ids,
                    mix.weights,
                    mix.mask,
                    mix.noise,
                )
                if not with_grad:  # mixed rows: the detached mixture
                    ref = ref * mix.mask.unsqueeze(-1) + w64[tokens] * (~mix.mask).unsqueeze(-1)
                ref_loss = (ref * grad.double()).sum()
                if tied:
                    loss = loss + (probe @ mixing.weight.t()).sum()
                    ref_loss = ref_loss + (probe.double() @ w64[lo:hi].t()).sum()
                loss.backward()
                ref_loss.backward()
                assert mixing.weight.grad is None and mixing.weight.grad_added_to_main_grad
            key = f"tp{tp}_grad{with_grad}_tied{tied}_{dtype}"
            errs[key] = _close(mixing.weight.main_grad, w64.grad[lo:hi], f"{key}: main_grad")
    return errs


@case
def embedding_16bit_equals_mix_rows():
    """bf16 and fp16 weights at TP=1,2,4, with and without recorded noise, with and without
    sequence parallelism: every mixed row equals, bit for bit, ``mix_rows`` on the full candidate
    rows (the arithmetic of vLLM's hook, rollout/vllm/hook.py; tests/test_vllm_engine.py checks the
    hook against it), plain rows the weight's rows. Mixed rows with candidates on several ranks
    occur at every TP > 1 (there per-rank partial mixtures would round differently). The weight
    gradient equals float64 to the 16-bit rounding of the returned gradient."""
    from megatron.core import parallel_state as ps

    from megatron_ngrpo.mixing.arithmetic import mix_rows
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.reference import mixed_embedding64

    v, h = 64, 32
    weight = torch.randn(v, h, generator=torch.Generator().manual_seed(12))
    rows_checked = 0
    for tp in (1, 2, 4):
        initialize_model_parallel(tp=tp)
        rank, n = ps.get_tensor_model_parallel_rank(), S // tp
        for dtype in (torch.bfloat16, torch.float16):
            w16 = weight.to(dtype)
            for noise, sp in ((False, False), (True, False), (True, tp > 1)):
                tokens, mix = _mix_batch(v, v, h, seed=40 + tp, rate=0.6, noise=noise)
                m = mix.mask
                owner = mix.ids[m] // (v // tp)
                assert tp == 1 or bool((owner != owner[:, :1]).any()), "no row spans two ranks"
                _, mixing = _standalone_embedding(tp, weight, sequence_parallel=sp)
                mixing.to(dtype)
                out = mixing(tokens, mix.batch())
                want = w16[tokens]
                want[m] = mix_rows(
                    w16[mix.ids[m]], mix.weights[m], None if mix.noise is None else mix.noise[m]
                )
                if sp:  # [S/TP, B, h]: this rank's sequence slice
                    want = want.transpose(0, 1)[rank * n : (rank + 1) * n]
                assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (
                    f"tp={tp} {dtype} noise={noise} sp={sp}: {int((out != want).any(-1).sum())} rows differ"
                )
                rows_checked += int(m.sum())
                if sp:
                    continue
                grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(13)).to(dtype)
                out.backward(grad)
                w64 = weight.double().requires_grad_()
                (mixed_embedding64(w64, tokens, *mix) * grad.double()).sum().backward()
                lo, hi = mixing.vocab_start_index, mixing.vocab_end_index
                _close(mixing.weight.grad, w64.grad[lo:hi], f"tp={tp} {dtype} weight grad", 2.0**-7)
    return {"mixed_rows_checked": rows_checked}


# ---- tiny GPTModel at every layout ----------------------------------------------------------
def _model_cfg(tp: int, pp: int):
    from megatron_ngrpo.models.config import ModelConfig

    return ModelConfig(
        hf_path=_S["hf"],
        tensor_parallel=tp,
        pipeline_parallel=pp,
        dtype="float32",
        num_real_tokens=NUM_REAL,
    )


def _inputs():
    tokens, mix = _mix_batch(VOCAB, NUM_REAL, 1, seed=5, rate=0.3)
    pos = torch.arange(S).expand(B, S)
    attn = torch.triu(torch.ones(S, S, dtype=torch.bool), 1).expand(B, 1, S, S)
    cot = torch.randn(B, S, PADDED, generator=torch.Generator().manual_seed(6))
    return tokens, pos, attn, mix._replace(noise=None), cot


def _reference() -> dict:
    """float64 TP=1 logits, full weights and full grads of Σ logits·cot, with the mixes fed as
    ``decoder_input`` built by the float64 definition."""
    if "ref" in _S:
        return _S["ref"]
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.reference import full_state, mixed_embedding64
    from tests.harness.tiny import write_tiny_hf

    _S["tmp"] = tempfile.TemporaryDirectory(prefix="mixing_worker_")  # per rank, removed at exit
    _S["hf"] = str(
        write_tiny_hf(
            os.path.join(_S["tmp"].name, "hf"),
            weights=False,
            vocab_size=VOCAB,
            initializer_range=0.05,
        )
    )
    initialize_model_parallel(1, 1, seed=1234)
    model = build_model(_model_cfg(1, 1))[0].double()
    weights = full_state(model)

    tokens, pos, attn, mix, cot = _inputs()
    emb = model.embedding.word_embeddings
    x = (
        mixed_embedding64(emb.weight, tokens, mix.ids, mix.weights, mix.mask)
        .transpose(0, 1)
        .contiguous()
    )
    logits = model(tokens, pos, attn, decoder_input=x)
    (logits * cot.double()).sum().backward()
    matrices = dict(emb=emb.weight.detach().clone(), out=model.output_layer.weight.detach().clone())
    for p in model.parameters():
        p.data = p.grad
    _S["ref"] = dict(logits=logits.detach(), weights=weights, grads=full_state(model), **matrices)
    return _S["ref"]


def _layout(tp: int, pp: int):
    """The chunk at (tp, pp) with the reference weights, and this rank's reference grads."""
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.reference import local_shards

    ref = _reference()
    initialize_model_parallel(tp, pp, seed=99)
    chunk = build_model(_model_cfg(tp, pp))[0]
    missing, _ = chunk.load_state_dict(local_shards(chunk, ref["weights"]), strict=False)
    assert not [m for m in missing if not m.endswith("_extra_state")], missing
    return chunk, local_shards(chunk, ref["grads"])


def _run_schedule(chunk, forward_only: bool):
    """Logits shard (last stage, else None) of one micro-batch through megatron's schedule, with
    the mixes replayed by the first stage's mixing embedding; backward of Σ logits·cot."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ngrpo.mixing.embedding import mixing_inputs

    tokens, pos, attn, mix, cot = _inputs()
    rank, n = (
        ps.get_tensor_model_parallel_rank(),
        PADDED // ps.get_tensor_model_parallel_world_size(),
    )
    cot = cot[..., rank * n : (rank + 1) * n]
    captured = []

    def forward_step(_data, model):
        with mixing_inputs(model, mix.batch()):
            out = model(tokens, pos, attn)

        def loss_func(logits):
            captured.append(logits.detach().clone())
            return (logits * cot).sum(), {}

        return out, loss_func

    chunk.zero_grad(set_to_none=True)
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[chunk],
        num_microbatches=1,
        seq_length=S,
        micro_batch_size=B,
        forward_only=forward_only,
    )
    return captured[0] if captured else None


def _model_case(tp: int, pp: int) -> dict:
    """Logits (forward-only and with backward) and every parameter's grad vs float64; the
    model's neighbour table vs brute force (input and output matrices)."""
    from megatron.core import parallel_state as ps

    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.mixing.neighbors import exclusion_mask, neighbor_table_for_model
    from tests.harness.reference import neighbor_table64

    ref = _reference()
    chunk, ref_grads = _layout(tp, pp)
    assert set(ref_grads) == {n for n, _ in chunk.named_parameters()}
    errs = {}
    rank, n = ps.get_tensor_model_parallel_rank(), PADDED // tp
    for forward_only in (True, False):
        logits = _run_schedule(chunk, forward_only)
        if ps.is_pipeline_last_stage():
            errs[f"logits_fwd_only={forward_only}"] = _close(
                logits, ref["logits"][..., rank * n : (rank + 1) * n], "logits"
            )
    for name, p in chunk.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        errs[name] = _close(grad, ref_grads[name], f"grad of {name}", TOL_GRAD)

    for source, metric in (("input", "cosine"), ("output", "cosine"), ("input", "l2")):
        cfg = MixingConfig(k=K, neighbor_source=source, metric=metric)
        table = neighbor_table_for_model(chunk, cfg, NUM_REAL, special_ids=SPECIAL)
        key = f"table_{source}_{metric}"
        if key not in _S:
            _S[key] = neighbor_table64(
                ref["emb" if source == "input" else "out"],
                K,
                metric,
                exclusion_mask(PADDED, cfg, NUM_REAL, SPECIAL),
            )
        assert torch.equal(table, _S[key]), (
            f"neighbour table ({source}, {metric}) differs at tp={tp} pp={pp}"
        )
    assert not torch.equal(
        _S["table_input_cosine"], _S["table_input_l2"]
    )  # the metric matters here
    return {"compared": len(errs), "max_scaled_err": max(errs.values())}


@case
def model_tp1():
    return _model_case(1, 1)


@case
def model_tp2():
    return _model_case(2, 1)


@case
def model_tp4():
    return _model_case(4, 1)


@case
def model_pp2():
    return _model_case(1, 2)


@case
def model_tp2_pp2():
    return _model_case(2, 2)


# ---- decision and baselines, vocab-parallel -------------------------------------------------
def _logits(rows: int, v: int, seed: int) -> torch.Tensor:
    """Small-integer logits (many exact ties, also across shards); padded columns large."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(0, 4, (rows, v), generator=g).float()
    z[0, :] = 0.0
    z[0, [v // 2 + 1, 2]] = 9.0  # tie across shards → lower id (2)
    z[1, :] = 0.0
    z[1, [v - 10, v // 4 + 3]] = 9.0
    z[:, -4:] = 50.0  # padded ids: never anchors or candidates
    return z


@case
def decision_vocab_parallel():
    """decide(): anchor = global argmax over real ids (ties → lower id, across shards), ids =
    table row, weights = softmax of z/τ on them and sum to 1; equal to the float64 definition."""
    from megatron_ngrpo.mixing.decision import decide
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.reference import decide64, neighbor_table64

    v, real, rows = 64, 60, 48
    z = _logits(rows, v, seed=1)
    table = neighbor_table64(
        torch.randn(v, 8, generator=torch.Generator().manual_seed(2)),
        K,
        exclude=torch.arange(v) >= real,
    )
    mixed = torch.rand(rows, generator=torch.Generator().manual_seed(3)) < 0.5
    anchor, ids, weights = decide64(z, table, 0.7, real)
    assert anchor[0] == 2 and anchor[1] == v // 4 + 3
    errs = {}
    for tp in (1, 2, 4):
        initialize_model_parallel(tp=tp)
        tp_group, _, rank = _groups()
        n = v // tp
        dec = decide(z[:, rank * n : (rank + 1) * n], table, 0.7, mixed, real, rank * n, tp_group)
        assert (
            torch.equal(dec.anchor, anchor)
            and torch.equal(dec.ids, ids)
            and torch.equal(dec.mixed, mixed)
        )
        assert (dec.anchor < real).all()
        errs[f"tp{tp}"] = _close(dec.weights, weights, "weights")
        _close(dec.weights.sum(-1), torch.ones(rows), "weight sums")
    return errs


@case
def baselines_vocab_parallel():
    """soft_thinking / stht / gumbel at TP=2,4 equal TP=1 (top-k merge across shards, ties →
    lower id, counter-based draws independent of the layout); soft_thinking equals the float64
    top-k definition; gumbel weights are the clean softmax on its candidates."""
    from megatron_ngrpo.mixing import perturbations as P
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.reference import topk_mixture64

    v, real, rows, k = 64, 60, 48, 5
    z = _logits(rows, v, seed=4)
    mixed = torch.rand(rows, generator=torch.Generator().manual_seed(5)) < 0.5
    key, position = torch.arange(rows) * 7, torch.arange(rows) % 5
    spec = P.NoiseSpec(sigma=0.2, dim=16)
    full = {
        "soft": P.soft_thinking(z, k, 0.5, mixed, real),
        "stht": P.stht(z, k, 0.5, mixed, real, spec, 11, key, position),
        "gumbel": P.gumbel(z, k, 1.0, mixed, real, 11, key, position),
    }
    ids64, w64 = topk_mixture64(z, k, 0.5, real)
    assert torch.equal(full["soft"].ids, ids64)
    _close(full["soft"].weights, w64, "soft_thinking weights")
    g = full["gumbel"]
    _close(g.weights, torch.softmax(torch.gather(z.double(), 1, g.ids), -1), "gumbel weights")
    assert not torch.equal(g.ids[mixed], full["soft"].ids[mixed]), "gumbel noise had no effect"
    assert torch.equal(g.ids[~mixed], full["soft"].ids[~mixed])
    assert (full["stht"].noise[~mixed] == 0).all() and (full["stht"].noise[mixed] != 0).all()
    for tp in (2, 4):
        initialize_model_parallel(tp=tp)
        tp_group, _, rank = _groups()
        n = v // tp
        zl, start = z[:, rank * n : (rank + 1) * n], rank * n
        got = {
            "soft": P.soft_thinking(zl, k, 0.5, mixed, real, start, tp_group),
            "stht": P.stht(zl, k, 0.5, mixed, real, spec, 11, key, position, start, tp_group),
            "gumbel": P.gumbel(zl, k, 1.0, mixed, real, 11, key, position, start, tp_group),
        }
        for name, dec in got.items():
            ref = full[name]
            assert torch.equal(dec.ids, ref.ids) and torch.equal(dec.anchor, ref.anchor), (
                f"{name} tp={tp}"
            )
            assert torch.equal(dec.weights, ref.weights), f"{name} weights tp={tp}"
            assert (dec.noise is None) == (ref.noise is None)
            assert dec.noise is None or torch.equal(dec.noise, ref.noise)
    return {"ok": True}


@case
def records_replay_through_embedding():
    """STHT decisions at TP=1,2,4 → MixRecord → MixBatch.from_record → mixing embedding equals
    Σ w·E[ids] + recorded noise in float64 (noise added once across TP ranks)."""
    from megatron_ngrpo.mixing import perturbations as P
    from megatron_ngrpo.mixing.embedding import MixBatch
    from megatron_ngrpo.mixing.records import MixRecord
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.reference import mixed_embedding64

    v, h, k, resp = 64, 16, 4, 6
    weight = torch.randn(v, h, generator=torch.Generator().manual_seed(8))
    z = torch.randn(B * resp, v, generator=torch.Generator().manual_seed(9))
    seq, pos = torch.arange(B).repeat_interleave(resp), torch.arange(resp).repeat(B)
    mixed = pos % 2 == 1
    errs = {}
    for tp in (1, 2, 4):
        initialize_model_parallel(tp=tp)
        tp_group, _, rank = _groups()
        n = v // tp
        spec = P.NoiseSpec.from_embedding(
            weight[rank * n : (rank + 1) * n], 60, 0.33, rank * n, tp_group
        )
        dec = P.stht(
            z[:, rank * n : (rank + 1) * n],
            k,
            1.0,
            mixed,
            60,
            spec,
            3,
            seq,
            pos,
            rank * n,
            tp_group,
        )
        rec = MixRecord(
            seq=seq[mixed],
            pos=pos[mixed],
            ids=dec.ids[mixed],
            weights=dec.weights[mixed],
            num_seqs=B,
            noise=dec.noise[mixed],
        )
        offsets = torch.tensor([1, 0])  # responses start at column 1 and 0 of a [B, 8] batch
        mix = MixBatch.from_record(rec, offsets, S)
        tokens = torch.randint(0, 60, (B, S), generator=torch.Generator().manual_seed(10))
        _, mixing = _standalone_embedding(tp, weight)
        out = mixing(tokens, mix)
        dense = Dense.of(mix)
        ref = mixed_embedding64(weight, tokens, *dense)
        assert int(mix.mask.sum()) == int(mixed.sum())
        errs[f"tp{tp}"] = _close(out, ref, f"replay tp={tp}")
    return errs


if __name__ == "__main__":
    run_cases()
