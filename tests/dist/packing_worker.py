"""Sequence packing (grpo/packing.py) at 2 ranks: log-probs of a batch with mixing records and
the GRPO gradients equal the unpacked ones, at TP 1 (DP 2) and TP 2 with sequence parallelism;
and the local spec's two attention paths (models/attention.py: torch SDPA, megatron's unfused)
give the same log-probs and gradients at TP 2, unpacked (causal) and packed (block-diagonal mask).
Run by tests/test_packing.py."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from tests.harness.multiproc import case, run_cases
from tests.harness.records import mix_record

VOCAB, TEMP = 300, 0.8
STATE: dict = {}


def _setup(tp: int, sp: bool, attention: str = "sdpa"):
    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.grpo.update import wrap_for_training
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.tiny import write_tiny_hf

    if "hf" not in STATE:
        path = [tempfile.mkdtemp(prefix="packing_worker_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(path, src=0)
        STATE["hf"] = f"{path[0]}/hf"
        if dist.get_rank() == 0:
            write_tiny_hf(STATE["hf"], weights=False, vocab_size=VOCAB, num_layers=2)
        dist.barrier()
    initialize_model_parallel(tp, 1, None, seed=7)
    cfg = ModelConfig(
        hf_path=STATE["hf"],
        tensor_parallel=tp,
        make_vocab_size_divisible_by=64,
        sequence_parallel=sp,
        layer_spec="local",
        attention=attention,
    )
    chunks = wrap_for_training(build_model(cfg))
    shapes = []
    unwrap(chunks[0]).register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return chunks, shapes


def _batch():
    """Eight responses of 1-9 tokens after 2-6 prompt tokens (this DP rank's half when DP 2),
    mixes at ~30 % of positions."""
    from megatron.core import parallel_state as ps

    from megatron_ngrpo.grpo.logprobs import TokenBatch
    from megatron_ngrpo.rollout.types import RolloutBatch

    g = torch.Generator().manual_seed(5)
    prompts, responses, mixes = [], [], []
    for _ in range(8):
        prompts.append(
            torch.randint(
                2, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g
            ).tolist()
        )
        n = int(torch.randint(1, 10, (1,), generator=g))
        responses.append(torch.randint(2, VOCAB, (n,), generator=g).tolist())
        mixes.append(
            [
                (
                    t,
                    torch.randperm(VOCAB, generator=g)[:3].tolist(),
                    torch.softmax(torch.randn(3, generator=g), 0).tolist(),
                )
                for t in range(n)
                if torch.rand((), generator=g) < 0.3
            ]
        )
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = list(range(rank, 8, dp))
    batch = RolloutBatch(
        [prompts[i] for i in rows],
        [responses[i] for i in rows],
        [[0.0] * len(responses[i]) for i in rows],
        ["stop"] * len(rows),
        mix_record([mixes[i] for i in rows], 3),
        list(range(len(rows))),
    )
    return TokenBatch.from_rollout(batch)


def _compare(tp: int, sp: bool) -> dict:
    from megatron_ngrpo.grpo.logprobs import batch_logprobs
    from megatron_ngrpo.grpo.loss_inputs import LossInputs

    chunks, shapes = _setup(tp, sp)
    tb = _batch()
    assert tb.mix is not None
    plain = batch_logprobs(chunks, tb, TEMP, 3, VOCAB)
    shapes.clear()
    packed = batch_logprobs(chunks, tb, TEMP, 3, VOCAB, packing="mask")
    # The packed path ran: one row per micro-batch, no padding beyond the SP multiple.
    assert shapes and all(s[0] == 1 for s in shapes), shapes
    lp_err = float((plain - packed).abs().max())
    assert lp_err < 1e-5 and float(plain.abs().sum()) > 0, lp_err

    g = torch.Generator().manual_seed(9)
    tb = tb.with_inputs(
        LossInputs(
            old_logprobs=plain + 0.05 * torch.randn(plain.shape, generator=g) * tb.mask,
            advantages=torch.randn(tb.num_rows, generator=g),
            active=torch.ones(tb.num_rows, dtype=torch.bool),
        )
    )
    (l0, g0), (l1, g1) = (_grads(chunks, tb, packing) for packing in ("", "mask"))
    grad_err = float((g0 - g1).abs().max() / g0.abs().max())
    assert abs(l0 - l1) < 1e-6 and grad_err < 1e-5 and float(g0.abs().max()) > 0, (l0, l1, grad_err)
    return {"logprob_err": lp_err, "grad_rel_err": grad_err}


def _grads(chunks, tb, packing: str) -> tuple[float, torch.Tensor]:
    from megatron_ngrpo.grpo.config import GRPOConfig
    from megatron_ngrpo.grpo.update import UpdateSettings, loss_and_grads

    settings = UpdateSettings(
        temperature=TEMP, micro_batch_size=3, vocab_limit=VOCAB, max_response_len=9, packing=packing
    )
    stats = loss_and_grads(chunks, tb, GRPOConfig(kl_mode="off"), settings)
    return stats["loss"], torch.cat([p.main_grad.flatten().clone() for p in chunks[0].parameters()])


@case
def attention_sdpa_equals_unfused_tp2():
    """TP 2, fp32: the same weights with SDPA and with megatron's unfused attention give the same
    log-probs and GRPO gradients, causal (no mask) and packed (the block-diagonal mask)."""
    from megatron_ngrpo.grpo.logprobs import batch_logprobs
    from megatron_ngrpo.grpo.loss_inputs import LossInputs

    models = {a: _setup(2, False, a)[0] for a in ("sdpa", "unfused")}
    types = {
        a: type(m[0].module.decoder.layers[0].self_attention.core_attention).__name__
        for a, m in models.items()
    }
    assert types == {"sdpa": "SDPAttention", "unfused": "DotProductAttention"}, types
    first = [next(m[0].parameters()) for m in models.values()]
    assert torch.equal(*first)  # same seed, same weights
    tb = _batch()
    out = {}
    for packing in ("", "mask"):
        lps = [batch_logprobs(m, tb, TEMP, 3, VOCAB, packing=packing) for m in models.values()]
        g = torch.Generator().manual_seed(9)
        mb = tb.with_inputs(
            LossInputs(
                old_logprobs=lps[1] + 0.05 * torch.randn(lps[1].shape, generator=g) * tb.mask,
                advantages=torch.randn(tb.num_rows, generator=g),
                active=torch.ones(tb.num_rows, dtype=torch.bool),
            )
        )
        (l0, g0), (l1, g1) = (_grads(m, mb, packing) for m in models.values())
        lp_err = float((lps[0] - lps[1]).abs().max())
        grad_err = float((g0 - g1).abs().max() / g1.abs().max())
        assert lp_err < 1e-5 and abs(l0 - l1) < 1e-6 and grad_err < 1e-5, (
            packing,
            lp_err,
            l0,
            l1,
            grad_err,
        )
        out[packing or "causal"] = {"logprob_err": lp_err, "grad_rel_err": grad_err}
    return out


@case
def packed_tp1_dp2():
    return _compare(1, False)


@case
def packed_tp2_sequence_parallel():
    return _compare(2, True)


if __name__ == "__main__":
    run_cases()
