"""Multi-process cases of DRA's policy_hidden embedder: the final hidden states mean-pooled over
each response, captured in a replay pass under TP / TP+SP / PP, equal a float64 single-process
reference (a TP=1 model cast to float64, one unpadded sequence at a time).

Run by tests/test_dra.py under torchrun with 2 processes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ngrpo.parallel import broadcast_from_rank0
from tests.harness.multiproc import case, run_cases, shared_tmpdir
from tests.harness.records import mix_record

VOCAB, HIDDEN = 300, 128
STATE: dict = {}


def model_cfg(tp=1, pp=1, sp=False):
    from megatron_ngrpo.models.config import ModelConfig

    return ModelConfig(
        hf_path=STATE["hf"],
        tensor_parallel=tp,
        pipeline_parallel=pp,
        make_vocab_size_divisible_by=64,
        sequence_parallel=sp,
    )


def make_rollout():
    from megatron_ngrpo.rollout.types import RolloutBatch

    g = torch.Generator().manual_seed(5)
    prompts, responses = [], []
    for _ in range(7):
        prompts.append(
            torch.randint(
                2, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g
            ).tolist()
        )
        responses.append(
            torch.randint(
                2, VOCAB, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g
            ).tolist()
        )
    return RolloutBatch(
        prompts,
        responses,
        [[0.0] * len(r) for r in responses],
        ["stop"] * 7,
        mix_record([[] for _ in responses], 1),
        list(range(7)),
    )


def setup_reference():
    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.conversion.checkpoint import (
        checkpoint_meta,
        load_megatron_checkpoint,
        save_megatron_checkpoint,
    )
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.tiny import write_tiny_hf

    if STATE:
        return
    root = shared_tmpdir("dra_worker_")
    STATE["hf"] = f"{root}/hf"
    if dist.get_rank() == 0:
        write_tiny_hf(
            STATE["hf"], weights=False, vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2
        )
    dist.barrier()
    initialize_model_parallel(1, 1, None, seed=7)
    chunks = build_model(model_cfg())
    with torch.no_grad():  # non-trivial final norm
        for name, p in chunks[0].named_parameters():
            if "layernorm" in name:
                p.add_(
                    0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
                )
    STATE["ckpt"] = str(
        save_megatron_checkpoint(chunks, f"{root}/weights", checkpoint_meta(model_cfg()))
    )
    model64 = build_model(model_cfg())[0]
    load_megatron_checkpoint([model64], STATE["ckpt"])
    batch = make_rollout()
    refs = None
    if dist.get_rank() == 0:
        model64 = unwrap(model64).double()
        seen = []
        handle = model64.output_layer.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        refs = []
        with torch.no_grad():
            for prompt, resp in zip(batch.prompt_ids, batch.response_ids):
                tokens = torch.tensor([prompt + resp])
                model64(
                    input_ids=tokens,
                    position_ids=torch.arange(tokens.shape[1])[None],
                    attention_mask=None,
                )
                refs.append(seen.pop()[len(prompt) :, 0].mean(0))  # [s, 1, h] → response columns
        handle.remove()
        refs = torch.stack(refs)
    STATE["refs"], STATE["batch"] = broadcast_from_rank0(refs), batch


def run_layout(tp, pp, sp=False, replay=True):
    from megatron_ngrpo.conversion.checkpoint import load_megatron_checkpoint
    from megatron_ngrpo.grpo.batches import TokenBatch
    from megatron_ngrpo.grpo.dra import ResponseHiddenMeans
    from megatron_ngrpo.grpo.logprobs import batch_logprobs
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel

    setup_reference()
    initialize_model_parallel(tp, pp, None, seed=7)
    chunks = build_model(model_cfg(tp, pp, sp))
    load_megatron_checkpoint(chunks, STATE["ckpt"])
    tb = TokenBatch.from_rollout(STATE["batch"])
    hidden = ResponseHiddenMeans(chunks, tb, micro_batch_size=3)
    if replay:  # the trainer's old-log-prob pass; a second pass inside the context is ignored
        with hidden:
            batch_logprobs(chunks, tb, 1.0, 3)
            batch_logprobs(chunks, tb, 1.0, 2)
    got = hidden.means()
    assert got.shape == (len(STATE["refs"]), HIDDEN) and got.dtype == torch.float32
    err = float((got.double() - STATE["refs"]).abs().max())
    assert err < 1e-4, f"pooled hidden states off by {err}"
    return err


@case
def hidden_means_tp2():
    return run_layout(2, 1)


@case
def hidden_means_tp2_sequence_parallel():
    return run_layout(2, 1, sp=True)


@case
def hidden_means_pp2():
    return run_layout(1, 2)


@case
def hidden_means_own_pass_without_replay():
    return run_layout(2, 1, replay=False)


if __name__ == "__main__":
    run_cases()
