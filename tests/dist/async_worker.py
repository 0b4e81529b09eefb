"""One-step-off rollouts at TP=2 (2 processes): the producer generates on its second thread, with
duplicated process groups, while the trainer's thread runs an update; the stale batch's
replayed log-probs under the generating weights equal the engine's, and the loss on it equals a
float64 reference (the GRPO objective of tests/dist/grpo_worker.py) with π_old = the generating
weights and π_θ = the updated ones.

Run by tests/test_async.py under torchrun with 2 processes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from grpo_worker import (
    MAX_RESPONSE,
    N_PROMPTS,
    TEMP,
    VOCAB,
    G,
    K,
    grpo_cfg,
    make_rollout,
    reference_advantages,
    reference_logprobs,
    reference_objective,
)

from tests.harness.multiproc import case, run_cases, shared_tmpdir

VARIANT = dict(
    mixes=True, loss_mode="token", agg="seq-mean-token-mean", adv="grpo", kl="k3", tis_cap=1.5
)


def model_cfg(root: str, tp: int):
    from megatron_ngrpo.models.config import ModelConfig

    return ModelConfig(hf_path=f"{root}/hf", tensor_parallel=tp, make_vocab_size_divisible_by=64)


def build_trainer_side(root: str):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.grpo.update import wrap_for_training
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel

    initialize_model_parallel(2, 1, None, seed=7)
    chunks = wrap_for_training(build_model(model_cfg(root, 2)))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0), chunks
    )
    unwrap(chunks[0]).config.grad_scale_func = optimizer.scale_loss
    return chunks, optimizer


def token_batch(rollout):
    from megatron_ngrpo.grpo.batches import TokenBatch

    return TokenBatch.from_rollout(rollout)


def parallel_side(root: str) -> dict:
    from megatron_ngrpo.conversion.checkpoint import checkpoint_meta, save_megatron_checkpoint
    from megatron_ngrpo.grpo.advantages import compute_advantages, group_ids
    from megatron_ngrpo.grpo.logprobs import batch_logprobs
    from megatron_ngrpo.grpo.loss_inputs import LossInputs
    from megatron_ngrpo.grpo.update import UpdateSettings, loss_and_grads
    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.mixing.neighbors import neighbor_table_for_model
    from megatron_ngrpo.parallel import duplicate_model_parallel_groups
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine
    from megatron_ngrpo.rollout.types import SamplingParams
    from megatron_ngrpo.training.async_rollout import RolloutProducer
    from megatron_ngrpo.training.neighbor_source import NeighborSource

    chunks, optimizer = build_trainer_side(root)
    cfg2 = model_cfg(root, 2)
    save_megatron_checkpoint(chunks, f"{root}/w0", checkpoint_meta(cfg2))
    engine = MegatronEngine(
        chunks, VOCAB, separate_copy=True, model_cfg=cfg2, groups=duplicate_model_parallel_groups()
    )
    producer = RolloutProducer(engine, max_staleness=1, on_stale="error", keep_weights=True)
    mixing = MixingConfig(rate=0.5, k=K)
    neighbors = NeighborSource(
        mixing, "table", lambda: neighbor_table_for_model(chunks, mixing, VOCAB)
    )
    neighbors.refresh(0)
    g = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(
            2, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(N_PROMPTS)
    ]
    params = SamplingParams(n=G, temperature=TEMP, max_new_tokens=MAX_RESPONSE, seed=11)
    producer.launch(
        0,
        chunks,
        neighbors,
        prompts,
        params,
        examples=prompts,
        keys=list(range(N_PROMPTS)),
        data_before={},
    )

    # Meanwhile, on this thread, step 0's update (on another batch): weights W0 -> W1.
    settings = UpdateSettings(
        temperature=TEMP, micro_batch_size=4, vocab_limit=VOCAB, max_response_len=MAX_RESPONSE
    )
    other, rewards = make_rollout(seed=3)
    groups = group_ids(other.prompt_index)
    tb = token_batch(other)
    cfg = grpo_cfg(VARIANT)
    with torch.no_grad():
        old0 = batch_logprobs(chunks, tb, TEMP, 4, VOCAB)
    loss_and_grads(
        chunks,
        tb.with_inputs(
            LossInputs(
                old_logprobs=old0,
                ref_logprobs=old0,
                active=torch.ones(len(other), dtype=torch.bool),
                advantages=compute_advantages(rewards, groups, "grpo", 1e-6),
            )
        ),
        cfg,
        settings,
        optimizer,
    )
    optimizer.step()
    overlapped = producer._job.thread is not None and producer._job.thread.is_alive()
    save_megatron_checkpoint(chunks, f"{root}/w1", checkpoint_meta(cfg2))

    job = producer.take(1)
    stale = job.rollout
    assert (
        stale.policy_version == 0
        and producer.metrics(1, stale.policy_version)["async/staleness"] == 1
    )
    engine_lp = token_batch(stale).label_aligned(stale.logprobs)
    tb = token_batch(stale)
    with torch.no_grad(), job.snapshot.active(chunks):
        old = batch_logprobs(chunks, tb, TEMP, 4, VOCAB)
    with torch.no_grad():
        current = batch_logprobs(chunks, tb, TEMP, 4, VOCAB)
    gap = float(((old - engine_lp).abs() * tb.mask).max())
    moved = float(((current - engine_lp).abs() * tb.mask).max())
    assert len(stale.mixes) > 0, "no mixed positions in the stale batch"
    assert gap < 1e-5, f"replay under the generating weights vs engine log-probs: {gap}"
    assert moved > 1e-4, (
        f"the update did not move the policy ({moved}): the check above cannot fail"
    )

    rewards = torch.tensor([float(len(r) % 2) for r in stale.response_ids], dtype=torch.float64)
    adv = compute_advantages(rewards, group_ids(stale.prompt_index), "grpo", 1e-6)
    inputs = LossInputs(
        old_logprobs=old,
        ref_logprobs=engine_lp,
        advantages=adv,
        active=torch.ones(len(stale), dtype=torch.bool),
        tis_weight=torch.exp(old - engine_lp).clamp(max=VARIANT["tis_cap"]) * tb.mask,
    )
    stats = loss_and_grads(chunks, tb.with_inputs(inputs), cfg, settings, optimizer)
    producer.close()
    return {
        "loss": stats["loss"],
        "gap": gap,
        "moved": moved,
        "rollout": stale,
        "rewards": rewards,
        "overlapped": overlapped,
        "mixed": len(stale.mixes),
    }


@case
def stale_batch_tp2():
    from megatron_ngrpo.conversion.checkpoint import load_megatron_checkpoint
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.tiny import write_tiny_hf

    start = time.time()
    root = shared_tmpdir("async_worker_")
    if dist.get_rank() == 0:
        write_tiny_hf(f"{root}/hf", weights=False, vocab_size=VOCAB, num_layers=4)
    dist.barrier()
    side = parallel_side(root)

    # float64 reference at TP=1 on rank 0: π_θ = W1, π_old = W0 (the generating weights).
    initialize_model_parallel(1, 1, None, seed=7)
    models = {}
    for name in ("w0", "w1"):
        m = build_model(model_cfg(root, 1))[0]
        load_megatron_checkpoint([m], f"{root}/{name}")  # collective
        models[name] = m.double()
    report = {k: side[k] for k in ("gap", "moved", "overlapped", "mixed")}
    if dist.get_rank() == 0:
        stale = side["rollout"]
        with torch.no_grad():
            lps = reference_logprobs(models["w1"], stale, mixes=True)
            old = reference_logprobs(models["w0"], stale, mixes=True)
        engine = [torch.tensor(x, dtype=torch.float64) for x in stale.logprobs]
        adv = reference_advantages(side["rewards"], "grpo")
        ref = reference_objective(lps, old, engine, engine, adv, [True] * len(lps), VARIANT)
        report["old_vs_float64"] = max(
            float((torch.tensor(a, dtype=torch.float64) - b).abs().max())
            for a, b in zip(stale.logprobs, old)
        )
        report["loss"], report["reference"] = side["loss"], float(ref)
        report["loss_rel_err"] = abs(side["loss"] - float(ref)) / max(abs(float(ref)), 1e-3)
        assert report["loss_rel_err"] < 1e-5, report
        assert report["old_vs_float64"] < 1e-5, report
    report["seconds"] = time.time() - start
    return report


if __name__ == "__main__":
    run_cases()
