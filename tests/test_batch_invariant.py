"""Zero mismatch (``rollout.batch_invariant``): the built-in engine's log-prob of every sampled
token ``torch.equal``s the trainer's replay (models/batch_invariant.py,
models/invariant_logsoftmax.py). Multi-process cases in tests/dist/batch_invariant_worker.py;
the all-layout and leak cases are ``slow`` (minutes; ``pytest -m slow tests/test_batch_invariant.py``).
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.models.batch_invariant import BLOCK_ROWS, TiledAttention, blocked_matmul
from megatron_ngrpo.models.invariant_logsoftmax import gathered_logprobs, ordered_merge, shard_stats
from megatron_ngrpo.training.job_config import load_config
from tests import test_train
from tests.harness.multiproc import check, launch

WORKER = Path(__file__).parent / "dist" / "batch_invariant_worker.py"
# One launch for the default run's cases (the packed one included: a launch costs ~10 s of start-up).
FAST = [
    "parity_tp1_float32",
    "parity_tp2_bfloat16",
    "trainer_tp1_float32",
    "trainer_one_step_off_tp1_float32",
    "packed_tp1_float32",
]
SLOW_PARITY = ["tp1_bfloat16", "tp2_float32", "pp2_bfloat16"]
# (op switched back to its default inside the mode, layout): tokens must then differ somewhere
# (tests/dist/batch_invariant_worker.py LEAKS; bf16 GEMMs and a 2-rank merge are M- and
# order-free on this CPU, so ``linear`` and ``trainer_logsoftmax`` are checked in fp32).
LEAKS = [
    ("linear", "tp1_float32"),
    ("linear", "tp2_float32"),
    ("attention", "tp1_float32"),
    ("attention", "tp2_bfloat16"),
    ("engine_logsoftmax", "tp1_float32"),
    ("engine_logsoftmax", "tp2_bfloat16"),
    ("trainer_logsoftmax", "tp1_float32"),
    ("trainer_logsoftmax", "tp2_float32"),
]
task = test_train.task  # the arithmetic task fixture (module scope)


REFUSED = [
    (
        ["rollout.engine=vllm"],
        1,
        "'rollout.batch_invariant' = True: needs rollout.engine = megatron",
    ),
    (["model.tensor_parallel=2", "model.sequence_parallel=true"], 2, "reduce-scatter"),
    (
        ["model.tensor_parallel=4"],
        4,
        "'model.tensor_parallel' = 4: rollout.batch_invariant: at most 2",
    ),
]


@pytest.mark.parametrize("overrides,world,message", REFUSED, ids=[e[0][-1] for e in REFUSED])
def test_what_the_mode_cannot_make_invariant_is_refused(
    task, monkeypatch, overrides, world, message
):
    """One line at load time, naming the field and value."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as err:
        load_config(
            [test_train.TINY, task / "paths.yaml"], ["rollout.batch_invariant=true", *overrides]
        )
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def results(task):
    return launch(WORKER, nproc=2, env={"NGRPO_TASK": str(task)}, only=FAST)


@pytest.fixture(scope="module")
def slow_results(task):
    cases = [f"parity_{x}" for x in SLOW_PARITY]
    cases += ["trainer_tp2_bfloat16", "trainer_one_step_off_tp2_bfloat16"]
    cases += [f"leak_{op}_{layout}" for op, layout in LEAKS]
    return launch(WORKER, nproc=2, timeout=1800, env={"NGRPO_TASK": str(task)}, only=cases)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_row_blocks_make_a_gemm_row_independent_of_m(dtype):
    """The CPU fp32 GEMM gives a row another summation in M = 1 than in M = 37 (why the mode
    blocks every linear); on fixed blocks of BLOCK_ROWS rows (one bmm) every row has the bits of
    its block's lone GEMM, whatever M."""
    torch.manual_seed(0)
    w, x = torch.randn(384, 128).to(dtype), torch.randn(37, 128).to(dtype)
    full = x @ w.t()
    if dtype == torch.float32:
        assert any(not torch.equal(full[i], (x[i : i + 1] @ w.t())[0]) for i in range(37))
    blocked = blocked_matmul(x, w)
    padded = F.pad(x, (0, 0, 0, (-37) % BLOCK_ROWS))
    per_block = [padded[a : a + BLOCK_ROWS] @ w.t() for a in range(0, len(padded), BLOCK_ROWS)]
    assert BLOCK_ROWS > 1 and torch.equal(blocked, torch.cat(per_block)[:37])
    for i in range(37):
        assert torch.equal(blocked[i], blocked_matmul(x[i : i + 1], w)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_attention_decode_row_is_the_prefill_row(dtype):
    """A decode step (one query against the cache), alone or in a batch, gives the bits of the
    same row of a prefill over several query tiles and 2 key blocks (and of a shorter prefill);
    the result is attention."""
    torch.manual_seed(2)
    s, b, heads, groups, hn = 40, 3, 4, 2, 8
    q = torch.randn(s, b, heads, hn).to(dtype)
    k, v = (torch.randn(s, b, groups, hn).to(dtype) for _ in range(2))
    attn = SimpleNamespace(softmax_scale=hn**-0.5)

    def run(q, k, v):
        return TiledAttention.forward(attn, q, k, v, None)

    full = run(q, k, v)
    for i in range(s):
        assert torch.equal(run(q[i : i + 1], k[: i + 1], v[: i + 1]), full[i : i + 1]), i
        one = run(q[i : i + 1, 1:2], k[: i + 1, 1:2], v[: i + 1, 1:2])
        assert torch.equal(one, full[i : i + 1, 1:2]), i
    assert torch.equal(run(q[:33], k[:33], v[:33]), full[:33])
    heads_kv = [t.permute(1, 2, 0, 3).float().repeat_interleave(heads // groups, 1) for t in (k, v)]
    ref = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3).float(), *heads_kv, is_causal=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(full.float(), ref.permute(2, 0, 1, 3).reshape(s, b, -1), atol=tol)


def test_gathered_logprobs_are_the_shards_merged_in_rank_order():
    """The engine's side (gathered logits) equals per-shard stats merged in rank order (the
    trainer's), padded columns left out, and log_softmax to rounding."""
    torch.manual_seed(1)
    z, labels = torch.randn(5, 64) * 3, torch.tensor([0, 17, 31, 32, 50])
    lp = gathered_logprobs(z, labels, 0.7, shards=2, vocab_limit=60)
    stats = []
    for r in range(2):
        local = labels - 32 * r
        owned = (local >= 0) & (local < min(32, 60 - 32 * r))
        stats.append(
            shard_stats(
                z[:, 32 * r : 32 * (r + 1)],
                1 / 0.7,
                local.clamp(0, 31),
                owned,
                min(32, 60 - 32 * r),
            )
        )
    assert torch.equal(lp, ordered_merge(torch.stack(stats))[0])
    ref = torch.log_softmax(z[:, :60] / 0.7, dim=-1).gather(1, labels[:, None]).squeeze(1)
    assert torch.allclose(lp, ref, atol=1e-5)


@pytest.mark.parametrize("layout", ["tp1_float32", "tp2_bfloat16"])
def test_engine_logprobs_equal_the_replay(results, layout):
    """Mixed (ρ = 0.3) and plain rows: every engine log-prob torch.equals the trainer's replay
    (micro-batches of 4 and of 1), and the engine decoding one row at a time gives the batch's
    bits; the default forward's gap is reported beside it (bench/results/zero_mismatch.md)."""
    value = check(results, f"parity_{layout}")
    assert value["on_unequal"] == 0 and value["on_mixed_rows"]["mixed"]["tokens"] > 5
    assert value["off_plain_rows"]["plain"]["unequal"] > 0  # the default does differ


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_PARITY)
def test_engine_logprobs_equal_the_replay_other_layouts(slow_results, layout):
    assert check(slow_results, f"parity_{layout}")["on_unequal"] == 0


def test_trainer_old_logprobs_from_the_engine_are_exact(results):
    """Through the trainer (tiny config, mixing): with the mode, the recompute pass finds every
    mismatch gap and k3 KL 0, and with ``grpo.old_logprobs: rollout`` the first mini-batch's
    log-ratio is 0 on every token (ratio ≡ 1) with one replay pass fewer; without the mode the
    first log-ratio is not 0."""
    check(results, "trainer_tp1_float32")


@pytest.mark.slow
def test_trainer_old_logprobs_exact_tp2_bf16(slow_results):
    check(slow_results, "trainer_tp2_bfloat16")


def test_trainer_one_step_off_old_logprobs_are_exact(results):
    """One step off (``train.async.max_staleness: 1``, 3 steps, mixing on): the engine samples on
    its separate weight copy with the last step's weights while the trainer updates. With
    ``recompute`` every step's replay under the generating weights' snapshot finds every mismatch
    gap 0 (mixed label columns at every step, staleness 1 logged); ``grpo.old_logprobs:
    rollout`` then computes the recompute run's every loss, ratio and KL bit for bit, its first
    |log-ratio| the policy change of one step (0 at the synchronous first step, > 0 after)."""
    check(results, "trainer_one_step_off_tp1_float32")


@pytest.mark.slow
def test_trainer_one_step_off_tp2_bf16(slow_results):
    check(slow_results, "trainer_one_step_off_tp2_bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize("op,layout", LEAKS)
def test_leak_with_one_op_reverted(slow_results, op, layout):
    """The parity checks (bs 1 vs bs N, decode vs the replay's prefill, mixed and plain rows)
    fail when one op is switched back to its default kernel."""
    assert check(slow_results, f"leak_{op}_{layout}")["unequal"] > 0


# ---- sequence packing with the mode (train.pack_sequences: THD) ------------------------------
SLOW_PACKED = ["tp1_bfloat16", "tp2_float32", "tp2_bfloat16"]
PACKED_LEAKS = ["packed_attention", "packed_rope"]
PACKED_LENGTHS = [5, 40, 1, 33, 8, 17]  # 1 to 2 key blocks, a partly filled query tile


@pytest.fixture(scope="module")
def slow_packed_results(task):
    cases = [f"packed_{x}" for x in SLOW_PACKED] + ["trainer_packed_tp1_float32"]
    cases += [f"leak_{op}_tp1_float32" for op in PACKED_LEAKS]
    return launch(WORKER, nproc=2, timeout=1800, env={"NGRPO_TASK": str(task)}, only=cases)


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_attention_packed_sequences_are_their_unpacked_rows(dtype):
    """THD form (cu_seqlens): each packed sequence's output has the bits of its row in an
    unpacked, padded batch (whatever the other rows and the padding hold) and of the row alone,
    wherever the packer put it; the result is attention within the sequence only."""
    torch.manual_seed(3)
    heads, groups, hn, s = 4, 2, 8, max(PACKED_LENGTHS)
    q = torch.randn(s, len(PACKED_LENGTHS), heads, hn).to(dtype)
    k, v = (torch.randn(s, len(PACKED_LENGTHS), groups, hn).to(dtype) for _ in range(2))
    attn = SimpleNamespace(softmax_scale=hn**-0.5)
    unpacked = TiledAttention.forward(attn, q, k, v, None)  # [s, b, heads·hn]
    for order in (range(len(PACKED_LENGTHS)), [3, 0, 5, 2, 4, 1]):
        lengths = [PACKED_LENGTHS[r] for r in order]
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=_cu_seqlens(lengths), cu_seqlens_kv=_cu_seqlens(lengths)
        )
        packed = [torch.cat([t[:n, r] for r, n in zip(order, lengths)]) for t in (q, k, v)]
        out = TiledAttention.forward(attn, *packed, None, packed_seq_params=params)
        assert out.shape == (sum(lengths), 1, heads * hn)
        rows = torch.cat([unpacked[:n, r] for r, n in zip(order, lengths)])
        assert torch.equal(out[:, 0], rows)
    for r, n in enumerate(PACKED_LENGTHS):
        alone = TiledAttention.forward(
            attn, q[:n, r : r + 1], k[:n, r : r + 1], v[:n, r : r + 1], None
        )
        assert torch.equal(alone[:, 0], unpacked[:n, r])
        kv = [
            t[:n, r].transpose(0, 1).float().repeat_interleave(heads // groups, 0) for t in (k, v)
        ]
        ref = F.scaled_dot_product_attention(q[:n, r].transpose(0, 1).float(), *kv, is_causal=True)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(alone[:, 0].float(), ref.transpose(0, 1).reshape(n, -1), atol=tol)


def test_tiled_attention_packed_gradients_are_the_unpacked_ones():
    """The update's backward through the packed path: the gradients of query, key and value
    (zero past each sequence) are the unpacked batch's."""
    torch.manual_seed(5)
    heads, groups, hn, s, b = 4, 2, 8, max(PACKED_LENGTHS), len(PACKED_LENGTHS)
    q = torch.randn(s, b, heads, hn, requires_grad=True)
    k, v = (torch.randn(s, b, groups, hn, requires_grad=True) for _ in range(2))
    valid = torch.arange(s).unsqueeze(1) < torch.tensor(PACKED_LENGTHS)  # [s, b]
    weight = torch.randn(s, b, heads * hn) * valid.unsqueeze(-1)
    attn = SimpleNamespace(softmax_scale=hn**-0.5)
    (TiledAttention.forward(attn, q, k, v, None) * weight).sum().backward()
    unpacked = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    cu = _cu_seqlens(PACKED_LENGTHS)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    packed = [t.transpose(0, 1)[valid.t()] for t in (q, k, v)]  # sequence after sequence
    out = TiledAttention.forward(attn, *packed, None, packed_seq_params=params)
    (out[:, 0] * weight.transpose(0, 1)[valid.t()]).sum().backward()
    for t, ref in zip((q, k, v), unpacked, strict=True):
        assert ref.abs().sum() > 0 and torch.allclose(t.grad, ref, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thd_rope_is_the_unpacked_rows_rope(single_rank, dtype):
    """megatron's RoPE in THD form (the local spec's, plain torch) gives each packed token the
    bits of its row unpacked (angles from the sequence's start, same elementwise ops), for any
    micro-batch length; a rotary table as long as the packed row (megatron's offset mapping:
    positions in the packed row) does not."""
    rope = RotaryEmbedding(kv_channels=32, rotary_percent=1.0, rotary_base=1000000)
    cfg = SimpleNamespace(
        apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False
    )
    torch.manual_seed(4)
    xs = [torch.randn(n, 3, 32).to(dtype) for n in PACKED_LENGTHS]
    cu = _cu_seqlens(PACKED_LENGTHS)
    packed = apply_rotary_pos_emb(
        torch.cat(xs), rope(max(PACKED_LENGTHS), packed_seq=True), cfg, cu
    )
    for s in (40, 43, 64):
        rows = torch.zeros(s, len(xs), 3, 32, dtype=dtype)
        for r, x in enumerate(xs):
            rows[: len(x), r] = x
        ref = apply_rotary_pos_emb(rows, rope(s), cfg)
        assert torch.equal(packed, torch.cat([ref[:n, r] for r, n in enumerate(PACKED_LENGTHS)]))
    whole_row = apply_rotary_pos_emb(torch.cat(xs), rope(int(cu[-1]), packed_seq=True), cfg, cu)
    assert not torch.equal(whole_row, packed)


def test_the_mode_accepts_packing(task, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = load_config(
        [test_train.TINY, task / "paths.yaml"],
        ["rollout.batch_invariant=true", "train.pack_sequences=true"],
    )
    assert cfg.rollout.batch_invariant and cfg.train.pack_sequences


def test_packed_replay_equals_the_engine_and_the_unpacked_replay(results):
    """``train.pack_sequences`` with the mode (TP 1, fp32): mixed and plain rows, replayed in packs
    of 4 sequences and in one pack of all 12, torch.equal the engine's log-probs, and the packed
    replay the unpacked one."""
    value = check(results, "packed_tp1_float32")
    assert value["unequal"] == 0 and value["mixed_rows"]["mixed"]["tokens"] > 5


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_PACKED)
def test_packed_replay_equals_the_engine_other_layouts(slow_packed_results, layout):
    assert check(slow_packed_results, f"packed_{layout}")["unequal"] == 0


@pytest.mark.slow
def test_trainer_packed_old_logprobs_are_exact(slow_packed_results):
    """Through the trainer: packed (THD) replays and update, every mismatch gap 0, first
    log-ratio 0 with ``grpo.old_logprobs: rollout``."""
    assert check(slow_packed_results, "trainer_packed_tp1_float32")["packed_micro_batches"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("op", PACKED_LEAKS)
def test_packed_leak_with_one_piece_reverted(slow_packed_results, op):
    """TiledAttention ignoring cu_seqlens, or RoPE at packed-row positions: tokens differ from
    the engine's and from the unpacked replay."""
    value = check(slow_packed_results, f"leak_{op}_tp1_float32")
    assert value["unequal"] > 0 and value["packed_vs_unpacked_unequal"] > 0
