"""Cases of the batch-invariant mode (``rollout.batch_invariant``), one 2-process torchrun launch.

One tiny random Qwen2 (GQA, padded vocabulary) is written once as a TP=1 megatron checkpoint and
loaded at TP 1 (both ranks a replica) and TP 2, in fp32 and bf16. The built-in engine generates
mixed (N-GRPO, ρ = 0.3) and plain rows; the trainer's replay (``sequence_logprobs``: the
micro-batches and padding of the log-prob pass, not the engine's batch) scores them. Each case
reports the gap with the mode off (the default kernels) and asserts ``torch.equal`` with it on.
``BI_REVERT`` (an op name) switches one op back to its default inside the mode: the leak tests.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist

from tests.harness.multiproc import case, run_cases, shared_tmpdir
from tests.harness.tiny import tiny_checkpoint

ALL_LAYOUTS = [(tp, dtype) for tp in (1, 2) for dtype in ("float32", "bfloat16")]
TRAINER_LAYOUTS = [(1, "float32"), (2, "bfloat16")]


def cases_per_layout(fn, name: str, layouts) -> None:
    """Register ``fn(tp, dtype)`` as one case per (tp, dtype) layout, named ``name`` formatted."""
    for tp, dtype in layouts:
        bound = functools.partial(fn, tp, dtype)
        bound.__name__ = name.format(tp=tp, dtype=dtype)
        case(bound)


VOCAB, NUM_REAL, K = 500, 480, 3
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [300, 12], [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87], [401]]
_STATE: dict = {}


def _model_cfg(tp: int, dtype: str, pp: int = 1):
    from megatron_ngrpo.models.config import ModelConfig

    return ModelConfig(
        hf_path=_STATE["hf"],
        tensor_parallel=tp,
        pipeline_parallel=pp,
        dtype=dtype,
        num_real_tokens=NUM_REAL,
    )


def _checkpoint() -> str:
    """The TP=1 weights as a megatron distributed checkpoint (written once)."""
    return tiny_checkpoint(_STATE, "batch_invariant_", VOCAB, lambda: _model_cfg(1, "float32"))


def model(tp: int, dtype: str, pp: int = 1) -> list:
    """Fresh model chunks at TP ``tp`` × PP ``pp`` in ``dtype``, the checkpoint's weights."""
    from megatron.core import dist_checkpointing

    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel

    ckpt = _checkpoint()
    initialize_model_parallel(tp, pp, seed=99)
    chunks = build_model(_model_cfg(tp, dtype, pp))
    state = dist_checkpointing.load({"model": chunks[0].sharded_state_dict()}, ckpt)
    chunks[0].load_state_dict(state["model"])
    return chunks


def neighbor_table() -> torch.Tensor:
    """A fixed random neighbour table [512, K] (anchor first)."""
    gen = torch.Generator().manual_seed(0)
    table = torch.arange(512).unsqueeze(1).repeat(1, K)
    table[:NUM_REAL, 1:] = torch.randint(0, NUM_REAL, (NUM_REAL, K - 1), generator=gen)
    return table


def generate(chunks, invariant: bool, rate: float, max_batch_size: int = 0, prompts=PROMPTS):
    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine
    from megatron_ngrpo.rollout.types import SamplingParams

    eng = MegatronEngine(
        chunks,
        NUM_REAL,
        neighbor_table=neighbor_table(),
        eos_token_ids=[1],
        batch_invariant=invariant,
        max_batch_size=max_batch_size,
    )
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, max_new_tokens=14, seed=5)
    mixing = MixingConfig(rate=rate, k=K) if rate else None
    return eng.generate(prompts, params, mixing, keys=list(range(10, 10 + len(prompts))))


def gap(chunks, out, micro_batch_size: int = 4, packing: str = "") -> dict:
    """Engine vs trainer replay log-probs of ``out`` (each micro-batch packed into one row with
    ``packing``): max |gap|, tokens not bitwise equal, split into mixed and plain tokens."""
    from tests.harness.records import sequence_mixes
    from tests.support.replay import sequence_logprobs

    replay = sequence_logprobs(
        chunks, out, 0.9, micro_batch_size, vocab_limit=NUM_REAL, packing=packing
    )
    res = {"mixed": [0, 0, 0.0], "plain": [0, 0, 0.0]}  # tokens, unequal, max |gap|
    for r, (lp, eng) in enumerate(zip(replay, out.logprobs)):
        eng = torch.tensor(eng, dtype=torch.float32)
        mixed_pos = {p + 1 for p, _, _ in sequence_mixes(out.mixes, r)}  # label after a mixed input
        for t in range(len(eng)):
            kind = res["mixed" if t in mixed_pos else "plain"]
            d = float((lp[t] - eng[t]).abs())
            kind[0] += 1
            kind[1] += int(not torch.equal(lp[t], eng[t]))
            kind[2] = max(kind[2], d)
    return {k: dict(tokens=v[0], unequal=v[1], max_abs=v[2]) for k, v in res.items()}


def _unequal(g: dict) -> int:
    return g["mixed"]["unequal"] + g["plain"]["unequal"]


def _invariant_run(chunks, revert: str = "") -> dict:
    """Mode on (with op ``revert`` switched back to its default): the engine's mixed and plain
    rows vs the trainer's replay in micro-batches of 4 and of 1, and the engine decoding all
    rows at once vs one row at a time (bs N vs bs 1)."""
    from megatron_ngrpo.models.batch_invariant import enable_batch_invariant

    enable_batch_invariant(chunks)
    with reverted(chunks, revert) if revert else contextlib.nullcontext():
        mixed, plain = generate(chunks, True, 0.3), generate(chunks, True, 0.0)
        alone = generate(chunks, True, 0.3, max_batch_size=1)
        res = {
            "mixed_rows": gap(chunks, mixed),
            "plain_rows": gap(chunks, plain),
            "micro_batch_1": gap(chunks, mixed, micro_batch_size=1),
        }
    assert res["mixed_rows"]["mixed"]["tokens"] > 5, res
    res["bs1_vs_bsN_unequal"] = sum(
        int(not torch.equal(torch.tensor(a), torch.tensor(b)))
        for a, b in zip(alone.logprobs, mixed.logprobs)
    )
    res["unequal"] = sum(_unequal(res[k]) for k in ("mixed_rows", "plain_rows", "micro_batch_1"))
    res["unequal"] += res["bs1_vs_bsN_unequal"]
    return res


def _parity(tp: int, dtype: str, pp: int = 1):
    """Mode off: the measured gap; mode on: every token torch.equal."""
    chunks = model(tp, dtype, pp)
    off = {
        f"off_{n}": gap(chunks, generate(chunks, False, r))
        for n, r in (("mixed_rows", 0.3), ("plain_rows", 0.0))
    }
    on = _invariant_run(chunks)
    assert on["unequal"] == 0, on
    return {**off, **{f"on_{k}": v for k, v in on.items()}}


cases_per_layout(_parity, "parity_tp{tp}_{dtype}", ALL_LAYOUTS)


@case
def parity_pp2_bfloat16():
    """Two pipeline stages (hidden states sent between them in the engine and the schedule)."""
    return _parity(1, "bfloat16", pp=2)


# ---- leak tests: one op back to its default inside the mode -------------------------------------
@contextlib.contextmanager
def reverted(chunks, op: str):
    """Switch ``op`` back to its default inside the mode: ``linear`` (megatron's GEMM on all M
    rows), ``attention`` (torch SDPA), ``engine_logsoftmax`` (the engine's logsumexp over the
    gathered vocabulary), ``trainer_logsoftmax`` (the trainer's default vocab-parallel log-prob
    function: valid-column GEMM in chunks, all-reduce merge)."""
    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.grpo import token_logprobs as tl
    from megatron_ngrpo.models.attention import SDPAttention
    from megatron_ngrpo.models.batch_invariant import TiledAttention
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine

    undo = []
    mods = [m for c in chunks for m in unwrap(c).modules()]
    if op == "linear":
        for m in mods:
            if "_forward_impl" in m.__dict__:
                impl = m.__dict__.pop("_forward_impl")
                undo.append(lambda m=m, f=impl: setattr(m, "_forward_impl", f))
    elif op == "attention":
        for m in mods:
            if isinstance(m, TiledAttention):
                m.__class__ = SDPAttention
                undo.append(lambda m=m: setattr(m, "__class__", TiledAttention))
    elif op == "engine_logsoftmax":
        undo.append(
            lambda f=MegatronEngine._token_logprobs: setattr(MegatronEngine, "_token_logprobs", f)
        )
        MegatronEngine._token_logprobs = lambda self, z, scaled, token, temp: (
            scaled.gather(1, token.unsqueeze(1)).squeeze(1) - torch.logsumexp(scaled, dim=-1)
        )
    elif op == "trainer_logsoftmax":
        undo.append(lambda f=tl._InvariantLogProbs: setattr(tl, "_InvariantLogProbs", f))
        tl._InvariantLogProbs = tl._LinearVocabParallelLogProbs
    else:
        raise ValueError(op)
    try:
        yield
    finally:
        for restore in undo:
            restore()


# (op, tp, dtype): where reverting the op changes bits on this CPU (bf16 GEMMs and a 2-rank
# merge are M- and order-free here, so ``linear`` and ``trainer_logsoftmax`` leak in fp32).
LEAKS = [
    ("linear", 1, "float32"),
    ("linear", 2, "float32"),
    ("attention", 1, "float32"),
    ("attention", 2, "bfloat16"),
    ("engine_logsoftmax", 1, "float32"),
    ("engine_logsoftmax", 2, "bfloat16"),
    ("trainer_logsoftmax", 1, "float32"),
    ("trainer_logsoftmax", 2, "float32"),
]


def _leak(tp: int, dtype: str, op: str):
    res = _invariant_run(model(tp, dtype), op)
    return {k: res[k] for k in ("unequal", "bs1_vs_bsN_unequal")}


for _op, _tp, _dtype in LEAKS:

    def _bound_leak(tp=_tp, dtype=_dtype, op=_op):
        return _leak(tp, dtype, op)

    _bound_leak.__name__ = f"leak_{_op}_tp{_tp}_{_dtype}"
    case(_bound_leak)


# ---- through the trainer ------------------------------------------------------------------------
def train_step(name: str, *overrides: str) -> dict:
    """One step of configs/tiny_test.yaml on the arithmetic task (``NGRPO_TASK``) with one
    mini-batch (its first); its metrics and the trainer's forward-only passes (no graph, not
    the engine's)."""
    from pathlib import Path

    from megatron.core.models.gpt import GPTModel

    from megatron_ngrpo.training.job_config import load_config
    from megatron_ngrpo.training.trainer import Trainer

    run_dir = Path(_STATE.setdefault("tmp", shared_tmpdir("bi_train_"))) / name
    task = Path(os.environ["NGRPO_TASK"])
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny_test.yaml"
    cfg = load_config(
        [tiny, task / "paths.yaml"],
        [
            f"train.run_dir={run_dir}",
            "train.max_steps=1",
            "train.save_every=0",
            "train.mini_batch_prompts=4",
            *overrides,
        ],
    )
    original, replays = GPTModel.forward, []

    def forward(self, *args, **kwargs):
        if kwargs.get("inference_context") is None and not torch.is_grad_enabled():
            replays.append(1)
        return original(self, *args, **kwargs)

    GPTModel.forward = forward
    try:
        trainer = Trainer(cfg)
        trainer.setup()
        trainer.run()
    finally:
        GPTModel.forward = original
    dist.barrier()
    import json

    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    keys = [k for k in row if k.startswith(("mismatch/", "first_update/", "logprob_gap/"))]
    keys.append("mixing/mixed_token_frac")
    return {"metrics": {k: row[k] for k in keys}, "replay_forwards": len(replays)}


def _trainer(tp: int, dtype: str):
    """With the mode: the engine's log-probs are the trainer's π_old bit for bit (recompute:
    every mismatch gap and k3 KL 0; rollout: the first mini-batch's log-ratio 0 on every
    token, one replay fewer); without it the first log-ratio is not 0."""
    layout = (f"model.tensor_parallel={tp}", f"model.dtype={dtype}")
    on = ("rollout.batch_invariant=true", *layout)
    recompute = train_step(f"recompute_{tp}_{dtype}", *on)
    rollout = train_step(f"rollout_{tp}_{dtype}", *on, "grpo.old_logprobs=rollout")
    default = train_step(f"default_{tp}_{dtype}", *layout, "grpo.old_logprobs=rollout")
    m = recompute["metrics"]
    assert m["mismatch/mixed/logprob_gap"] == 0 and m["mismatch/plain/logprob_gap"] == 0, m
    assert m["mismatch/mixed/kl"] == 0 and m["mismatch/plain/kl"] == 0, m
    assert m["logprob_gap/max_abs"] == 0 and m["mixing/mixed_token_frac"] > 0, m
    assert rollout["metrics"]["first_update/abs_log_ratio"] == 0, rollout
    assert rollout["replay_forwards"] < recompute["replay_forwards"], (rollout, recompute)
    assert default["metrics"]["first_update/abs_log_ratio"] > 0, default
    return {"recompute": recompute, "rollout": rollout, "default": default}


cases_per_layout(_trainer, "trainer_tp{tp}_{dtype}", TRAINER_LAYOUTS)


# ---- one step off (train.async.max_staleness: 1) ------------------------------------------------
# The first step synchronous, then two one step off (the second on a re-synced copy and snapshot).
ONE_STEP_OFF_STEPS = 3
# Row keys that timing or the recompute pass itself produce: the rest is what the steps computed.
_NOT_COMPUTED = ("time/", "async/", "mismatch/", "logprob_gap/")


def train_steps(name: str, *overrides: str) -> tuple[list[dict], list[int]]:
    """:func:`train_step` for ``ONE_STEP_OFF_STEPS`` steps: every step's metrics row, and per
    recompute pass the mixed label columns it compared (summed over DP ranks)."""
    import json
    from pathlib import Path

    from megatron_ngrpo.grpo.metrics import dp_sums
    from megatron_ngrpo.training.loss_stage import LossInputStage

    original, mixed = LossInputStage.__dict__["_mismatch_metrics"], []

    def counting(old, engine_lp, tb, keep):
        n = float((tb.mix.mask & tb.mask).sum()) if tb.mix is not None else 0.0
        mixed.append(int(dp_sums({"n": n})["n"]))  # collective: every DP rank runs this pass
        return original.__func__(old, engine_lp, tb, keep)

    LossInputStage._mismatch_metrics = staticmethod(counting)
    try:
        train_step(name, f"train.max_steps={ONE_STEP_OFF_STEPS}", *overrides)
    finally:
        LossInputStage._mismatch_metrics = original
    text = (Path(_STATE["tmp"]) / name / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()], mixed


def _one_step_off(tp: int, dtype: str):
    """The mode one step off (mixing on): the engine generates step n's batch on its separate
    weight copy with step n − 1's weights while the trainer updates. ``recompute``: every step's
    replay under the generating weights' snapshot equals the engine's log-probs (every gap 0,
    mixed label columns compared at every step, staleness 1 after the synchronous first step);
    ``rollout``: the engine's log-probs are those replays' bits, so the run computes what the
    recompute run computes, bit for bit (losses, ratios, KL, rewards, the first mini-batch's
    |log-ratio|, which is the policy change of one step: 0 at the first step, > 0 after)."""
    on = (
        "rollout.batch_invariant=true",
        "train.async.max_staleness=1",
        f"model.tensor_parallel={tp}",
        f"model.dtype={dtype}",
    )
    recompute, mixed = train_steps(f"one_step_off_recompute_{tp}_{dtype}", *on)
    rollout, _ = train_steps(f"one_step_off_rollout_{tp}_{dtype}", *on, "grpo.old_logprobs=rollout")
    gaps = [
        {k: v for k, v in r.items() if k.startswith(("mismatch/", "logprob_gap/")) and v}
        for r in recompute
    ]
    ratio = [r["first_update/abs_log_ratio"] for r in rollout]
    differ = [
        {k: (r[k], o[k]) for k in o if not k.startswith(_NOT_COMPUTED) and o[k] != r[k]}
        for r, o in zip(recompute, rollout, strict=True)
    ]
    staleness = [r["async/staleness"] for r in recompute]
    assert staleness == [0] + [1] * (ONE_STEP_OFF_STEPS - 1), staleness
    assert len(mixed) == ONE_STEP_OFF_STEPS and min(mixed) > 0, mixed
    assert "mismatch/mixed/logprob_gap" in recompute[-1] and not any(gaps), gaps
    assert ratio[0] == 0 and min(ratio[1:]) > 0, ratio
    assert len(rollout) == ONE_STEP_OFF_STEPS and not any(differ), differ
    return {"mixed_label_columns": mixed, "first_abs_log_ratio": ratio}


cases_per_layout(_one_step_off, "trainer_one_step_off_tp{tp}_{dtype}", TRAINER_LAYOUTS)


# ---- sequence packing (train.pack_sequences: THD, each sequence tiled from its own start) -------
@contextlib.contextmanager
def packing_reverted(op: str):
    """Undo one piece of the packed path: ``packed_attention`` (TiledAttention ignores
    cu_seqlens: the packed row is one causal sequence), ``packed_rope`` (the rotary table sized
    to the packed row, so megatron's THD RoPE takes each token's position in the packed row, not
    in its sequence)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_ngrpo.models import batch_invariant as bi

    if op == "packed_attention":
        owner, name = bi, "_packed"
        patched = lambda q, k, v, params, scale: bi._tiled(  # noqa: E731
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), scale
        )
    elif op == "packed_rope":
        owner, name, original = (
            RotaryEmbedding,
            "get_rotary_seq_len",
            RotaryEmbedding.get_rotary_seq_len,
        )

        def patched(self, context, block, hidden, config, packed_seq_params=None, **kw):
            if packed_seq_params is None:
                return original(self, context, block, hidden, config, packed_seq_params, **kw)
            return int(packed_seq_params.cu_seqlens_q[-1])
    else:
        raise ValueError(op)
    saved = getattr(owner, name)
    setattr(owner, name, patched)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _packed_run(chunks, revert: str = "") -> dict:
    """Mode on, the replay packed in THD form (with piece ``revert`` of the packed path undone):
    the engine's mixed and plain rows vs packs of 4 sequences and one pack of all 12, and the
    packed replay vs the unpacked replay."""
    from megatron_ngrpo.models.batch_invariant import enable_batch_invariant
    from tests.support.replay import sequence_logprobs

    enable_batch_invariant(chunks)
    mixed, plain = generate(chunks, True, 0.3), generate(chunks, True, 0.0)
    unpacked = sequence_logprobs(chunks, mixed, 0.9, 4, vocab_limit=NUM_REAL)
    with packing_reverted(revert) if revert else contextlib.nullcontext():
        res = {
            "mixed_rows": gap(chunks, mixed, packing="thd"),
            "plain_rows": gap(chunks, plain, packing="thd"),
            "one_pack": gap(chunks, mixed, micro_batch_size=len(mixed.logprobs), packing="thd"),
        }
        packed = sequence_logprobs(chunks, mixed, 0.9, 4, vocab_limit=NUM_REAL, packing="thd")
    assert res["mixed_rows"]["mixed"]["tokens"] > 5, res
    res["packed_vs_unpacked_unequal"] = sum(
        int(not torch.equal(a[i], b[i])) for a, b in zip(packed, unpacked) for i in range(len(a))
    )
    res["unequal"] = sum(_unequal(res[k]) for k in ("mixed_rows", "plain_rows", "one_pack"))
    res["unequal"] += res["packed_vs_unpacked_unequal"]
    return res


def _packed_parity(tp: int, dtype: str):
    res = _packed_run(model(tp, dtype))
    assert res["unequal"] == 0, res
    return res


cases_per_layout(_packed_parity, "packed_tp{tp}_{dtype}", ALL_LAYOUTS)


for _op in ("packed_attention", "packed_rope"):

    def _bound_packed_leak(op=_op):
        res = _packed_run(model(1, "float32"), op)
        return {k: res[k] for k in ("unequal", "packed_vs_unpacked_unequal")}

    _bound_packed_leak.__name__ = f"leak_{_op}_tp1_float32"
    case(_bound_packed_leak)


@case
def trainer_packed_tp1_float32():
    """``train.pack_sequences`` with the mode, through the trainer: every micro-batch of the
    replays and of the update packed in THD form (the reference a second model, ``copy``, in the
    second run), and still every mismatch gap, k3 KL and the first mini-batch's log-ratio 0."""
    from megatron_ngrpo.grpo import logprobs

    original, modes = logprobs.pack, []

    def pack(*args):
        modes.append(args[-1])
        return original(*args)

    logprobs.pack = pack
    try:
        on = ("rollout.batch_invariant=true", "train.pack_sequences=true")
        recompute = train_step("packed_recompute", *on)
        rollout = train_step(
            "packed_rollout", *on, "grpo.old_logprobs=rollout", "train.reference=copy"
        )
    finally:
        logprobs.pack = original
    m = recompute["metrics"]
    assert modes and set(modes) == {"thd"}, modes
    assert m["mismatch/mixed/logprob_gap"] == 0 and m["mismatch/plain/logprob_gap"] == 0, m
    assert m["mismatch/mixed/kl"] == 0 and m["mismatch/plain/kl"] == 0, m
    assert m["logprob_gap/max_abs"] == 0 and m["mixing/mixed_token_frac"] > 0, m
    assert rollout["metrics"]["first_update/abs_log_ratio"] == 0, rollout
    return {"recompute": recompute, "rollout": rollout, "packed_micro_batches": len(modes)}


if __name__ == "__main__":
    run_cases()
