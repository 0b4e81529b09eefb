"""Mixing core: neighbour table, mixing embedding, decision op, baselines.

Multi-process cases (TP=1/2/4, DP split, PP=2, TP2×PP2) run in one 4-process launch
(tests/dist/mixing_worker.py); the single-process tests below cover edge cases and statistics.
"""

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_ngrpo.mixing import gemm_cpu as G
from megatron_ngrpo.mixing import perturbations as P
from megatron_ngrpo.mixing import topk_certified as T
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.decision import counter_uniform, gate, gate_uniform, id_mask
from megatron_ngrpo.mixing.neighbors import build_neighbor_table, exclusion_mask
from tests.harness.multiproc import check, launch
from tests.harness.records import mix_record
from tests.harness.reference import neighbor_table64, splitmix_uniform64
from tests.harness.reference import tf32 as _tf32

WORKER = Path(__file__).parent / "dist" / "mixing_worker.py"
MODEL_LAYOUTS = ["model_tp1", "model_tp2", "model_tp4", "model_pp2", "model_tp2_pp2"]
METRICS = ["cosine", "l2", "l1", "dot"]


@pytest.fixture(scope="module")
def results():
    return launch(WORKER, nproc=4)


# ---- multi-process --------------------------------------------------------------------------
def test_neighbor_table_tp_dp_equals_bruteforce(results):
    """Random, tied/duplicate and clustered matrices, 4 metrics, exclusions: TP=1/2/4 (+DP)."""
    assert check(results, "neighbor_table_matches_bruteforce")["tables_checked"] == 128


def test_mixing_embedding_equals_reference(results):
    """ρ=0 is exactly megatron's embedding; mixed rows and weight grads equal float64 (1e-6)."""
    assert max(check(results, "embedding_matches_reference").values()) <= 1e-6


def test_mixing_embedding_16bit_equals_the_engines_arithmetic(results):
    """bf16/fp16 at TP=1,2,4 (also sequence parallel): mixed rows equal mix_rows on full
    candidate rows bit for bit, the arithmetic of vLLM's hook."""
    assert check(results, "embedding_16bit_equals_mix_rows")["mixed_rows_checked"] > 100


def test_mixing_embedding_main_grad_under_ddp(results):
    """Under megatron DDP the backward adds into main_grad: micro-batches with and without mixes
    accumulate the float64 gradient sum; a tied consumer's gradient is added once."""
    assert max(check(results, "embedding_main_grad_under_ddp").values()) <= 1e-6


@pytest.mark.parametrize("name", MODEL_LAYOUTS)
def test_model_with_mixes_equals_float64_tp1(results, name):
    """Tiny Qwen2-like GPTModel through megatron's schedule with mixes: logits (forward-only and
    with backward) and every parameter's grad equal the float64 TP=1 reference; the model's
    neighbour table (input and output matrix) equals brute force."""
    assert check(results, name)["max_scaled_err"] <= 4e-6


def test_decision_vocab_parallel(results):
    check(results, "decision_vocab_parallel")


def test_baselines_vocab_parallel(results):
    check(results, "baselines_vocab_parallel")


def test_records_replay_through_embedding(results):
    check(results, "records_replay_through_embedding")


# ---- neighbour table, single process --------------------------------------------------------
@pytest.mark.parametrize("k", [0, -1, 12, 50])
def test_table_k_out_of_range_raises(k):
    with pytest.raises(ValueError, match="k = "):
        build_neighbor_table(torch.randn(12, 4), 0, k)


def test_table_bad_inputs_raise():
    w = torch.randn(12, 4)
    with pytest.raises(ValueError, match="only 3 of 12 rows"):
        build_neighbor_table(w, 0, 4, exclude=torch.arange(12) >= 3)
    with pytest.raises(ValueError, match="metric"):
        build_neighbor_table(w, 0, 2, metric="cos")
    with pytest.raises(ValueError, match="exclude"):
        build_neighbor_table(w, 0, 2, exclude=torch.zeros(11, dtype=torch.bool))
    with pytest.raises(ValueError, match="non-finite"):
        build_neighbor_table(w.index_fill(0, torch.tensor([3]), float("nan")), 0, 2)


@pytest.fixture(
    params=[torch.float32, torch.bfloat16, "cuda"], ids=["fp32_screen", "bf16_screen", "gpu_choice"]
)
def screen(request, monkeypatch):
    """Both scoring screens whatever this CPU has (bf16 applies to the matmul metrics cosine,
    dot; the others keep fp32), and a GPU's whole choice run on CPU tensors: the screen dtype
    ``gemm_cpu.screen_dtype`` picks for "cuda" (bf16 for cosine/dot) with fp32 matmuls in TF32
    (``allow_tf32``, torch's "high"), emulated: TF32-rounded inputs of the fp32 products (screen
    GEMM of l2, fp32 re-scoring of the bf16 screen's candidates) and the bound
    ``input_roundoff("cuda")`` reads from the flag. Returns the cosine/dot screen dtype."""
    if request.param != "cuda":
        monkeypatch.setattr(
            G,
            "screen_dtype",
            lambda device, metric: request.param if metric in ("cosine", "dot") else torch.float32,
        )
        return request.param
    dtype_of, roundoff_of, mm_into, bmm = G.screen_dtype, G.input_roundoff, G.mm_into, torch.bmm
    monkeypatch.setattr(G, "screen_dtype", lambda device_type, metric: dtype_of("cuda", metric))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    monkeypatch.setattr(G, "input_roundoff", lambda device_type: roundoff_of("cuda"))
    assert G.input_roundoff("cpu") == 2.0**-11

    def tf32(x):
        return _tf32(x) if x.dtype == torch.float32 else x

    monkeypatch.setattr(G, "mm_into", lambda a, b, out: mm_into(tf32(a), tf32(b.contiguous()), out))
    monkeypatch.setattr(torch, "bmm", lambda a, b: bmm(tf32(a), tf32(b.contiguous())))
    return G.screen_dtype("cuda", "cosine")


@pytest.mark.parametrize("metric", METRICS)
def test_table_all_ties_and_chunking(metric, screen):
    """Identical rows (every score ties: the float64 fallback path) and a zero row; chunk sizes
    1, 5 and > V; a row range is the matching slice."""
    w = torch.ones(23, 3)
    w[7] = 0.0
    w[9] = torch.tensor([1.0, -2.0, 0.5])
    ref = neighbor_table64(w, 6, metric)
    assert ref[0].tolist() == [0, 1, 2, 3, 4, 5] and ref[8].tolist() == [8, 0, 1, 2, 3, 4]
    for chunk in (1, 5, 4096):
        assert torch.equal(build_neighbor_table(w, 0, 6, metric, chunk_size=chunk), ref)
    assert torch.equal(build_neighbor_table(w, 0, 6, metric, rows=(4, 19), chunk_size=5), ref[4:19])
    assert torch.equal(build_neighbor_table(w, 0, 1, metric), torch.arange(23).unsqueeze(1))


def test_table_orders_fp32_indistinguishable_scores_by_float64(screen):
    """Dot scores 1 + i·2^-25 collapse in fp32; the certificate falls back to float64."""
    x = torch.arange(40, dtype=torch.float64) * 2.0**-13
    w = torch.stack([torch.ones(40, dtype=torch.float64), x], 1).float()
    w[0] = torch.tensor([1.0, 2.0**-12])  # the query row
    ref = neighbor_table64(w, 8, "dot")
    assert ref[0, 1:].tolist() == list(range(39, 32, -1))
    assert torch.equal(build_neighbor_table(w, 0, 8, "dot", chunk_size=16), ref)


def test_table_orders_near_parallel_rows_by_float64(screen, monkeypatch):
    """Cosine scores 1 - O(i²·2^-27) of rows nearly parallel to the query: bf16 and fp32 both
    merge them, so the certificate must fall back to float64 (and does), exactly."""
    retried = []
    rescore = T._rescore_above
    monkeypatch.setattr(
        T,
        "_rescore_above",
        lambda keys, q32, *a: retried.append(len(q32)) or rescore(keys, q32, *a),
    )
    x = torch.arange(60, dtype=torch.float64) * 2.0**-13
    w = torch.stack([torch.ones(60, dtype=torch.float64), x, -x.flip(0)], 1)
    w = torch.cat([w, torch.randn(200, 3, generator=torch.Generator().manual_seed(5)).double()])
    w = w.float()
    ref = neighbor_table64(w, 6, "cosine")
    assert torch.equal(build_neighbor_table(w, 0, 6, "cosine", chunk_size=64), ref)
    assert torch.equal(
        build_neighbor_table(w, 0, 6, "cosine", rows=(0, 80), chunk_size=32), ref[:80]
    )
    assert sum(retried) > 0


def test_gpu_screen_is_bf16_with_fp32_reductions(monkeypatch):
    """On CUDA the screen of cosine/dot is bf16 (fp32 for l2/l1), and its GEMM runs with cuBLAS's
    reduced-precision reductions off (the bound assumes fp32 accumulation), the setting restored
    after (checked by the flag torch.mm sees, on CPU tensors)."""
    assert [G.screen_dtype("cuda", m) for m in METRICS] == [
        torch.bfloat16,
        torch.float32,
        torch.float32,
        torch.bfloat16,
    ]
    matmul = torch.backends.cuda.matmul
    seen, mm = [], torch.mm
    monkeypatch.setattr(
        torch,
        "mm",
        lambda *a, **kw: seen.append(matmul.allow_bf16_reduced_precision_reduction) or mm(*a, **kw),
    )
    before = matmul.allow_bf16_reduced_precision_reduction
    a = torch.randn(8, 16).bfloat16()
    out = torch.empty(8, 8, dtype=torch.bfloat16)
    G.mm_into(a, a.T, out)
    assert seen == [False] and matmul.allow_bf16_reduced_precision_reduction == before
    assert torch.equal(out, mm(a, a.T))


@pytest.mark.parametrize("metric", METRICS)
def test_table_two_stage_topk_path(metric, screen):
    """V large enough for the blocked top-k (several key blocks), with heavy ties and exclusions."""
    g = torch.Generator().manual_seed(0)
    w = torch.cat(
        [torch.randint(-1, 2, (2500, 3), generator=g).float(), torch.randn(2500, 3, generator=g)]
    )
    exclude = torch.rand(5000, generator=g) < 0.1
    rows = list(range(0, 5000, 125)) + [2499, 2500]
    got = build_neighbor_table(w, 0, 4, metric, exclude, chunk_size=700)
    assert torch.equal(got[rows], neighbor_table64(w, 4, metric, exclude, rows=rows))


def test_table_bf16_weights(screen):
    w = torch.randn(50, 8).bfloat16()
    assert torch.equal(build_neighbor_table(w, 0, 4), neighbor_table64(w.float(), 4))


@pytest.mark.parametrize("metric", ["cosine", "dot"])
@pytest.mark.parametrize("own", [False, True])  # general path queries / symmetric path (key rows)
def test_screen_score_bounds_contain_float64_scores(metric, own, screen):
    """Every screen score's [lower, upper] interval contains the float64 score, on rows of
    mixed magnitudes (dot) and with a near-parallel pair; the cosine bf16 interval is a few u_bf16."""
    g = torch.Generator().manual_seed(3)
    w = (
        torch.randn(2000, 96, generator=g)
        * torch.logspace(-2, 2, 2000).unsqueeze(1)[torch.randperm(2000, generator=g)]
    )
    w[1] = w[0] * (1 + 1e-3)
    keys = T.Keys(w, 0, metric, torch.zeros(2000, dtype=torch.bool))
    ids = torch.arange(0, 300)
    st, _, shift, tol = keys.screen_scores(w[ids], ids, own=own)
    assert st.dtype == screen and not bool(shift.any())
    s = st.T
    true = T.pair_scores64(w[ids].double().unsqueeze(1), w.double().unsqueeze(0), metric)
    finite = torch.isfinite(s)
    assert int((~finite).sum()) == 300  # self only
    t = tol.unsqueeze(1)
    assert bool((T._lower(s, t) <= true)[finite].all()) and bool(
        (true <= T._upper(s, t))[finite].all()
    )
    if (
        metric == "cosine"
    ):  # (dot's bound scales with the largest key norm, 10^4 × the smallest here)
        width = (T._upper(s, t) - T._lower(s, t))[finite]
        assert float(width.max()) < (8 * 2.0**-8 if screen == torch.bfloat16 else 1e-3)


def test_bf16_screen_rescores_only_near_ties(monkeypatch):
    """The bf16 screen's wider margin keeps the near-tie fallback rare on random rows (general
    and symmetric paths), and the table exact."""
    monkeypatch.setattr(G, "screen_dtype", lambda device, metric: torch.bfloat16)
    retried = []
    rescore = T._rescore_above
    monkeypatch.setattr(
        T,
        "_rescore_above",
        lambda keys, q32, *a: retried.append(len(q32)) or rescore(keys, q32, *a),
    )
    w = torch.randn(3000, 128, generator=torch.Generator().manual_seed(0))
    ref = neighbor_table64(w, 3, "cosine")
    assert torch.equal(build_neighbor_table(w, 0, 3, "cosine", chunk_size=1024), ref)
    assert torch.equal(
        build_neighbor_table(w, 0, 3, "cosine", rows=(0, 1500), chunk_size=1024), ref[:1500]
    )
    assert sum(retried) < 0.03 * 4500, retried


def test_screen_choice_times_both_gemms_without_touching_the_global_rng():
    """The screen dtype is decided by timing bf16 against fp32 once per process; a table build
    after ``torch.manual_seed`` must leave the run's random stream where it was."""
    G.cpu_bf16_matmul_is_faster.cache_clear()
    state = torch.get_rng_state()
    choice = G.screen_dtype("cpu", "cosine")
    assert torch.equal(torch.get_rng_state(), state)
    assert choice in (torch.float32, torch.bfloat16)
    assert G.screen_dtype("cpu", "l2") == torch.float32  # not a bare product


def test_exclusion_mask_from_config():
    cfg = MixingConfig(exclude_ids=[5])
    m = exclusion_mask(16, cfg, 12, special_ids=[0, 1])
    assert m.nonzero().squeeze(1).tolist() == [0, 1, 5, 12, 13, 14, 15]
    cfg = MixingConfig(exclude_special=False, exclude_padded=False)
    assert not exclusion_mask(16, cfg, 12, special_ids=[0]).any()
    with pytest.raises(ValueError, match="outside"):
        exclusion_mask(16, MixingConfig(exclude_ids=[16]), 12)


# ---- gate and counter-based draws -----------------------------------------------------------
def test_gate_uniform_matches_splitmix_spec_and_is_deterministic():
    key = torch.randint(-(2**40), 2**62, (500,))
    pos = torch.randint(0, 10**6, (500,))
    for seed in (0, 7, 2**63 + 5, -3):
        u = gate_uniform(seed, key, pos)
        assert torch.equal(u, splitmix_uniform64(seed, key.numpy(), pos.numpy()))
        assert torch.equal(u, gate_uniform(seed, key.tolist(), pos.tolist()))
        assert ((u >= 0) & (u < 1)).all()
    assert not torch.equal(gate_uniform(1, key, pos), gate_uniform(2, key, pos))
    assert not torch.equal(counter_uniform(1, key, pos, 0), counter_uniform(1, key, pos, 1))


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_gate_fraction_is_binomial(rate):
    n_seq, n_pos = 400, 500
    key = torch.arange(n_seq).repeat_interleave(n_pos)
    pos = torch.arange(n_pos).repeat(n_seq)
    frac = float(gate(rate, 1234, key, pos).double().mean())
    n = n_seq * n_pos
    assert abs(frac - rate) <= 5 * (rate * (1 - rate) / n) ** 0.5
    assert not gate(0.0, 1, key[:100], pos[:100]).any() and gate(1.0, 1, key[:100], pos[:100]).all()


# ---- baselines, single process --------------------------------------------------------------
def test_stht_noise_sigma_and_statistics():
    w = torch.randn(40, 64) * 0.3
    w[30:] = 100.0  # padded rows do not count
    spec = P.NoiseSpec.from_embedding(w, 30, 0.33)
    assert spec.dim == 64
    assert spec.sigma == pytest.approx(
        0.33 * float(w[:30].double().pow(2).mean().sqrt()), rel=1e-12
    )
    n = P.gaussian_noise(5, torch.arange(400), torch.zeros(400, dtype=torch.long), spec).double()
    assert n.shape == (400, 64)
    assert abs(float(n.mean())) < 5 * spec.sigma / n.numel() ** 0.5
    assert float(n.std()) == pytest.approx(spec.sigma, rel=5 * (0.5 / n.numel()) ** 0.5)
    assert float((n.abs() < spec.sigma).double().mean()) == pytest.approx(0.6827, abs=0.01)
    assert torch.equal(
        n, P.gaussian_noise(5, torch.arange(400), torch.zeros(400, dtype=torch.long), spec)
    )


def test_gumbel_first_candidate_samples_softmax():
    """ids[0] of gumbel is the Gumbel-max token: distributed as softmax(z/T)."""
    z = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, 3.0])
    rows = 20000
    logits = z.expand(rows, 6)
    dec = P.gumbel(
        logits,
        3,
        1.0,
        torch.ones(rows, dtype=torch.bool),
        6,
        9,
        torch.arange(rows),
        torch.zeros(rows, dtype=torch.long),
    )
    p = torch.softmax(z.double(), 0)
    freq = torch.bincount(dec.ids[:, 0], minlength=6).double() / rows
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / rows).sqrt() + 1e-12).all(), (freq, p)
    assert torch.allclose(dec.weights.double(), torch.softmax(z.double()[dec.ids], -1), atol=1e-6)
    assert (dec.ids[:, 1:] != dec.ids[:, :1]).all()


def test_decide_for_strategy_dispatch():
    v, rows = 20, 6
    z = torch.randn(rows, v)
    mixed = torch.tensor([True, False] * 3)
    key, pos = torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    table = neighbor_table64(torch.randn(v, 4), 3)
    spec = P.NoiseSpec(0.1, 4)
    kw = dict(
        temperature=0.7, num_real_tokens=v, table=table, noise=spec, seed=1, key=key, position=pos
    )
    for strategy in ("neighbor", "soft_thinking", "stht", "gumbel"):
        dec = P.decide_for_strategy(MixingConfig(strategy=strategy, k=3), z, mixed, **kw)
        assert dec.ids.shape == (rows, 3) and torch.equal(dec.mixed, mixed)
        assert torch.allclose(dec.weights.sum(-1), torch.ones(rows))
        assert (dec.noise is not None) == (strategy == "stht")
        if strategy != "gumbel":
            assert torch.equal(dec.anchor, z.argmax(-1)) and torch.equal(dec.ids[:, 0], dec.anchor)
    # α's temperature: mixing.temperature, else the sampling temperature (0.7 here)
    for tau in (None, 0.3):
        dec = P.decide_for_strategy(
            MixingConfig(strategy="soft_thinking", temperature=tau), z, mixed, **kw
        )
        want = torch.softmax(z.gather(1, dec.ids) / (tau or 0.7), -1)
        assert torch.allclose(dec.weights[mixed], want[mixed], atol=1e-6), tau
    # gumbel's weights: softmax of the clean z / mixing.gumbel_temperature on its candidates
    for t in (1.0, 0.25):
        cfg = MixingConfig(strategy="gumbel", k=3, gumbel_temperature=t)
        dec = P.decide_for_strategy(cfg, z, mixed, **kw)
        assert torch.allclose(dec.weights, torch.softmax(z.gather(1, dec.ids) / t, -1), atol=1e-6)
    none = P.decide_for_strategy(MixingConfig(strategy="none"), z, mixed, **kw)
    assert not none.mixed.any() and torch.equal(none.anchor, z.argmax(-1))
    with pytest.raises(ValueError, match="table"):
        P.decide_for_strategy(
            MixingConfig(strategy="neighbor"), z, mixed, temperature=1.0, num_real_tokens=v
        )
    with pytest.raises(ValueError, match="NoiseSpec"):
        P.decide_for_strategy(
            MixingConfig(strategy="stht"),
            z,
            mixed,
            temperature=1.0,
            num_real_tokens=v,
            key=key,
            position=pos,
        )
    with pytest.raises(ValueError, match="k = "):
        P.soft_thinking(z, v + 1, 1.0, mixed, v)


def test_special_anchors_stay_unmixed_in_every_strategy():
    """mixing.skip_special_anchors: a gated row whose anchor is a special id is left unmixed (its
    STHT noise zero), the other gated rows mix; off (the reference code), every gated row mixes."""
    v, rows = 20, 6
    z = torch.randn(rows, v, generator=torch.Generator().manual_seed(0))
    z[0, 4] = z[3, 17] = 50.0  # argmax: special 4 on gated row 0, real 17 on ungated row 3
    z[2, 9] = z[1, 11] = z[4, 13] = 50.0  # special 9 on gated row 2; real ids on gated 1 and 4
    mixed = torch.tensor([True, True, True, False, True, False])
    special = id_mask([4, 9, 30], v)  # 30: beyond the real ids, ignored
    assert special.nonzero().flatten().tolist() == [4, 9]
    kw = dict(
        temperature=1.0,
        num_real_tokens=v,
        table=neighbor_table64(torch.randn(v, 4), 3),
        noise=P.NoiseSpec(0.1, 4),
        seed=1,
        key=torch.arange(rows),
        position=torch.zeros(rows, dtype=torch.long),
        special=special,
    )
    for strategy in ("neighbor", "soft_thinking", "stht"):
        on = P.decide_for_strategy(MixingConfig(strategy=strategy), z, mixed, **kw)
        assert on.mixed.tolist() == [False, True, False, False, True, False], strategy
        off_cfg = MixingConfig(strategy=strategy, skip_special_anchors=False)
        off = P.decide_for_strategy(off_cfg, z, mixed, **kw)
        assert torch.equal(off.mixed, mixed) and torch.equal(off.ids, on.ids), strategy
        if strategy == "stht":
            assert (on.noise[[0, 2]] == 0).all() and (on.noise[[1, 4]] != 0).all()
            assert (off.noise[[0, 2]] != 0).all()
    # gumbel's anchor is its Gumbel-max sample: skipped where that sample is special
    dec = P.decide_for_strategy(MixingConfig(strategy="gumbel"), z, mixed, **kw)
    assert torch.equal(dec.mixed, mixed & ~special[dec.anchor])


@pytest.mark.parametrize("rows", [None, (0, 1500)])  # symmetric full table / general query slice
def test_table_exact_under_tf32_matmul(monkeypatch, rows):
    """TF32 matmul (GPU "high" precision), emulated on CPU: the certificate's bound covers the
    input rounding, the table is still exact, and only near-tie rows are re-scored (the bound
    used to exceed the cosine range at large d, re-scoring every pair)."""
    monkeypatch.setattr(G, "screen_dtype", lambda device, metric: torch.float32)
    monkeypatch.setattr(G, "input_roundoff", lambda device: 2.0**-11)
    monkeypatch.setattr(
        G, "mm_into", lambda a, b, out: torch.mm(_tf32(a), _tf32(b.contiguous()), out=out)
    )
    retried = []
    rescore = T._rescore_above
    monkeypatch.setattr(
        T,
        "_rescore_above",
        lambda keys, q32, *a: retried.append(len(q32)) or rescore(keys, q32, *a),
    )
    w = torch.randn(3000, 64, generator=torch.Generator().manual_seed(0))
    got = build_neighbor_table(w, 0, 3, "cosine", rows=rows, chunk_size=1024)
    ref = neighbor_table64(w, 3, "cosine")
    assert torch.equal(got, ref if rows is None else ref[rows[0] : rows[1]])
    assert sum(retried) < 0.05 * got.shape[0], retried
    tol = T.Keys(w, 0, "cosine", torch.zeros(3000, dtype=torch.bool)).bound(w[:1])[2]
    assert float(tol) < 1.1e-3


def test_decide_anchor_from_raw_logits_in_near_ties():
    """Two logits one fp32 ulp apart that z/τ in fp32 would merge into a tie (→ the lower id):
    the anchor is the true argmax, and α is the float64 softmax of the gathered logits."""
    from megatron_ngrpo.mixing.decision import decide

    tau = 1.7  # z in [1.7, 2) → z/τ in [1, 1.18): one output ulp per 1.7 input ulps
    a = torch.tensor(1.8) + torch.arange(1, 200) * torch.finfo(torch.float32).eps
    hi = a[1:][(a[1:] / tau) == (a[:-1] / tau)][0]  # fp32 division merges it with its predecessor
    lo = torch.nextafter(hi, torch.tensor(0.0))
    z = torch.full((1, 8), -5.0)
    z[0, 2], z[0, 5] = lo, hi
    table = torch.stack([torch.arange(8), (torch.arange(8) + 1) % 8, (torch.arange(8) + 2) % 8], 1)
    dec = decide(z, table, tau, torch.ones(1, dtype=torch.bool), num_real_tokens=8)
    assert int(dec.anchor) == 5
    cand = z[0, table[5]].double() / tau
    assert torch.equal(dec.weights[0], torch.softmax(cand, 0).float())


# ---- replay without host syncs --------------------------------------------------------------
class _HostToDeviceCopies(TorchFunctionMode):
    """Records every copy from the host onto the meta device that is not ``non_blocking`` (on a
    GPU such a copy of pageable memory synchronises the stream)."""

    def __init__(self):
        super().__init__()
        self.blocking = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        target = kwargs.get("device") or next(
            (a for a in args[1:] if isinstance(a, (str, torch.device))), None
        )
        to_meta = target is not None and torch.device(target).type == "meta"
        if func in (torch.Tensor.to, torch.Tensor.cuda) and to_meta:
            if src is not None and src.device.type == "cpu" and not kwargs.get("non_blocking"):
                self.blocking.append(func.__name__)
        elif func in (torch.tensor, torch.as_tensor) and to_meta:
            self.blocking.append(func.__name__)
        elif func is torch.Tensor.copy_ and args[0].device.type == "meta":
            if args[1].device.type == "cpu" and not (args[2:] or kwargs.get("non_blocking")):
                self.blocking.append("copy_")
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("main_grad", [False, True], ids=["autograd", "ddp_main_grad"])
def test_mixed_replay_has_no_host_sync(dtype, main_grad):
    """The replay path of a mixed micro-batch — TokenBatch.from_rollout onto the device, a
    micro-batch cut from it, the mixing embedding's forward and backward (into a megatron-DDP
    ``main_grad`` or autograd's gradient) — never waits for the device, like the plain one.
    Proxy for a GPU: the "device" is the meta device, where every op that needs device values on
    the host (nonzero, item, tolist, bool of a tensor, .cpu(), boolean indexing) raises, and a
    TorchFunctionMode records host→device copies that are not non_blocking. Host-side work on
    the record (CPU tensors) is allowed."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    from megatron_ngrpo.grpo.batches import TokenBatch
    from megatron_ngrpo.mixing.embedding import MixingVocabParallelEmbedding
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel
    from megatron_ngrpo.rollout.types import RolloutBatch

    init_distributed()
    initialize_model_parallel(1, 1)
    mixes = mix_record(
        [[(0, [5, 6, 7], [0.5, 0.3, 0.2]), (2, [9, 3], [0.6, 0.4])], [], [(1, [4, 8], [0.7, 0.3])]],
        k=3,
    )
    rollout = RolloutBatch(
        [[10, 11], [12], [13, 14, 15]],
        [[20, 21, 22, 23], [24, 25], [26, 27, 28]],
        [[-1.0] * 4, [-1.0] * 2, [-1.0] * 3],
        ["stop", "length", "stop"],
        mixes,
        [0, 1, 2],
    )
    cfg = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False)
    emb = VocabParallelEmbedding(32, 8, init_method=torch.nn.init.zeros_, config=cfg)
    emb.__class__ = MixingVocabParallelEmbedding
    emb.to(device="meta", dtype=dtype)
    if main_grad:  # megatron DDP's protocol: the backward adds into main_grad itself
        emb.weight.main_grad = torch.zeros(emb.weight.shape, device="meta")
        emb.weight.grad_added_to_main_grad = False
    copies = _HostToDeviceCopies()
    for replay in (False, True):  # plain, then mixed
        with copies:
            tb = TokenBatch.from_rollout(rollout, replay_mixes=replay, device="meta")
            assert (tb.mix.num_mixed if replay else tb.mix) == (3 if replay else None)
            for rows, length in (([0, 2], None), ([1], 8), ([0, 1, 2], None)):
                mb = tb.micro_batch(rows, num_rows=4, seq_len=length)
                out = emb(mb.tokens, mb.mix)
                out.backward(torch.ones(out.shape, device="meta", dtype=dtype))
            if replay:
                tb.mix.mask  # noqa: B018 (the trainer's mixed-token mask, built on the device)
    assert copies.blocking == [], copies.blocking
