"""Distributed-optimizer checkpoints across layouts, for tests/test_checkpoint.py.

Run at 2 ranks (``NGRPO_CKPT_PHASE=save``) and then at 4 (``resume``) on one checkpoint folder
(``NGRPO_CKPT_DIR``). A run trains a tiny Qwen2 with megatron DDP + the distributed optimizer
(Adam) for two steps on a fixed global batch, saves a training checkpoint, then "continues":
one more update and the loss of the updated model. Each case returns that loss, every updated
parameter (assembled whole) and a digest of the optimizer state it continued from; the test
compares a resharded continuation with the saving layout's own one. ``bf16`` cases keep bf16
parameters with fp32 main weights (megatron's GPU optimizer path); ``old`` cases resume from a
checkpoint in the format written before the parallel one (megatron's ``fully_reshardable``,
gathered onto DP rank 0).

The global batch is the same at every DP size (DP rank r takes rows r·B/DP ...), and the loss is
the global token mean: each rank's token sum / all tokens, summed over DP by the DDP gradient
reduction (``wrap_for_training`` sets ``calculate_per_token_loss``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.harness.multiproc import case, run_cases

ROWS, SEQ, VOCAB = 8, 16, 256
ROOT = Path(os.environ.get("NGRPO_CKPT_DIR", "/tmp"))


def _build(tp: int, dtype: torch.dtype = torch.float32):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.grpo.update import wrap_for_training
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.tiny import write_tiny_hf

    hf = ROOT / "hf"
    if dist.get_rank() == 0 and not (hf / "config.json").is_file():
        write_tiny_hf(
            hf,
            weights=False,
            vocab_size=VOCAB,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
        )
    dist.barrier()
    initialize_model_parallel(tp, 1)
    # padded vocab 256 at TP 1 and 2: the same tensors in every layout
    cfg = ModelConfig(
        hf_path=str(hf),
        tensor_parallel=tp,
        make_vocab_size_divisible_by=128,
        dtype=str(dtype).removeprefix("torch."),
    )
    chunks = wrap_for_training(
        build_model(cfg),
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.1,
            clip_grad=1.0,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            use_distributed_optimizer=True,
        ),
        chunks,
    )
    unwrap(chunks[0]).config.grad_scale_func = optimizer.scale_loss
    assert {p.dtype for c in chunks for p in c.parameters()} == {dtype}
    return cfg, chunks, optimizer


def _loss(chunks, step: int, backward: bool) -> float:
    """The global token-mean cross-entropy of step ``step``'s batch (and its gradients)."""
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)[
        r * ROWS // dp : (r + 1) * ROWS // dp
    ]
    pos = torch.arange(SEQ).expand(tokens.shape[0], -1)
    token_loss = chunks[0](tokens[:, :-1], pos, None, labels=tokens[:, 1:])
    local = token_loss.sum() / (ROWS * SEQ)
    if backward:
        local.backward()
        for c in chunks:
            c.finish_grad_sync()
    total = local.detach().clone()
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    return float(total)


def _update(chunks, optimizer, step: int) -> float:
    for c in chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    loss = _loss(chunks, step, backward=True)
    ok, _, _ = optimizer.step()
    assert ok
    return loss


@torch.no_grad()
def _assemble(sharded: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded state dict (factories built), assembled whole on every rank
    from the ranks' shards (the ShardedTensors' global offsets; main replicas)."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from megatron_ngrpo.conversion.checkpoint import _flat_sharded_tensors

    mine = [
        (
            sh.key,
            sh.global_shape,
            sh.global_offset,  # with the layer axes megatron prepends
            sh.data.reshape((1,) * (len(sh.global_shape) - sh.data.dim()) + tuple(sh.data.shape)),
        )
        for _, _, sh in _flat_sharded_tensors(sharded)
        if is_main_replica(sh.replica_id)
    ]
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, mine)
    full = {}
    for key, shape, offset, data in (t for rank in shards for t in rank):
        whole = full.setdefault(key, torch.full(shape, float("nan"), dtype=data.dtype))
        whole[tuple(slice(o, o + n) for o, n in zip(offset, data.shape, strict=True))] = data
    return dict(sorted(full.items()))


def _parameters(chunks) -> dict[str, list[float]]:
    """Every parameter of the global model, flattened."""
    from megatron_ngrpo.architecture import unwrap

    full = _assemble(unwrap(chunks[0]).sharded_state_dict())
    return {
        k: v.float().flatten().tolist() for k, v in full.items() if k.endswith(("weight", "bias"))
    }


def _optimizer_digest(chunks, optimizer) -> dict[str, str]:
    """sha256 of every optimizer tensor of the global model (fp32 main weights, exp_avg,
    exp_avg_sq), assembled through megatron's own model-space representation (its
    ``fully_reshardable`` state, all-gathered: independent of training.checkpoint), and of
    Adam's steps."""
    from megatron_ngrpo.conversion.checkpoint import _sharded_state_dict
    from megatron_ngrpo.training.checkpoint import _allocate_adam_state

    _allocate_adam_state(optimizer)  # a fresh Adam's (the control's): zero moments, step 0
    model = _sharded_state_dict(chunks)
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    full = _assemble(
        {
            i: o.sharded_param_state_fully_reshardable(model, False, metadata)
            for i, o in enumerate(optimizer.chained_optimizers)
        }
    )
    assert len(full) == 3 * 10 and not any(t.isnan().any() for t in full.values())
    assert {t.dtype for t in full.values()} == {torch.float32}  # main weights too (bf16 runs)
    steps = sorted(
        {
            float(st["step"])
            for o in optimizer.chained_optimizers
            for st in o.optimizer.state.values()
        }
    )
    return {
        "steps": str(steps),
        **{k: hashlib.sha256(t.numpy().tobytes()).hexdigest() for k, t in full.items()},
    }


def _continue(chunks, optimizer) -> dict:
    """Step 3 from a step-2 state: the digest of the optimizer state it starts from, the loss
    before its update, Adam's step counts after it, the updated model's loss and parameters."""
    state = _optimizer_digest(chunks, optimizer)
    before = _update(chunks, optimizer, 3)
    steps = sorted(
        {
            float(st["step"])
            for o in optimizer.chained_optimizers
            for st in o.optimizer.state.values()
        }
    )
    return {
        "state": state,
        "before": before,
        "steps": steps,
        "loss": _loss(chunks, 4, backward=False),
        "params": _parameters(chunks),
    }


def _save_after_two_steps(tp: int, name: str, dtype: torch.dtype = torch.float32) -> dict:
    from megatron_ngrpo.training.checkpoint import checkpoint_meta, save_training_checkpoint

    cfg, chunks, optimizer = _build(tp, dtype)
    for step in (1, 2):
        _update(chunks, optimizer, step)
    save_training_checkpoint(ROOT / name, 2, chunks, checkpoint_meta(cfg), optimizer, {"step": 2})
    return _continue(chunks, optimizer)


def _save_old_format(name: str) -> None:
    """dp2's checkpoint as save_training_checkpoint wrote it before the parallel format: the
    distributed optimizer's ``fully_reshardable`` state, gathered (gloo) onto DP rank 0, and the
    model written by DP rank 0 alone."""
    from megatron_ngrpo.conversion.checkpoint import (
        _sharded_state_dict,
        save_megatron_checkpoint,
        write_latest,
    )
    from megatron_ngrpo.training.checkpoint import _allocate_adam_state, checkpoint_meta, iter_dir

    cfg, chunks, optimizer = _build(1)
    for step in (1, 2):
        _update(chunks, optimizer, step)
    _allocate_adam_state(optimizer)
    old = {
        "distrib_optim_sharding_type": "fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient": True,
    }
    extra = {
        "trainer": {"step": 2},
        "optimizer": optimizer.sharded_state_dict(
            _sharded_state_dict(chunks), is_loading=False, metadata=old
        ),
    }
    meta = {
        **checkpoint_meta(cfg),
        "step": 2,
        "world_size": dist.get_world_size(),
        "distributed_optimizer": True,
        "rank_state": False,
    }
    save_megatron_checkpoint(
        chunks, iter_dir(ROOT / name, 2), meta, extra=extra, overwrite=True, parallel_save=False
    )
    if dist.get_rank() == 0:
        write_latest(ROOT / name, iter_dir(ROOT / name, 2).name)
    dist.barrier()


def _resume(
    tp: int, name: str, optimizer_state: bool = True, dtype: torch.dtype = torch.float32
) -> dict:
    from megatron_ngrpo.conversion.checkpoint import load_megatron_checkpoint
    from megatron_ngrpo.training.checkpoint import latest_checkpoint, load_training_checkpoint

    _, chunks, optimizer = _build(tp, dtype)
    path = latest_checkpoint(ROOT / name)
    if optimizer_state:
        assert load_training_checkpoint(path, chunks, optimizer) == {"step": 2}
    else:  # what resuming lost before: the model only, a fresh Adam
        load_megatron_checkpoint(chunks, path)
    return _continue(chunks, optimizer)


SAVE = os.environ.get("NGRPO_CKPT_PHASE", "save") == "save"
if SAVE:  # 2 ranks

    @case
    def dp2_save():
        return _save_after_two_steps(1, "dp2")

    @case
    def dp2_resume_dp2():
        return _resume(1, "dp2")

    @case
    def tp2_save():
        return _save_after_two_steps(2, "tp2")

    @case
    def tp2_resume_tp1_dp2():
        return _resume(1, "tp2")

    @case
    def bf16_dp2_save():
        return _save_after_two_steps(1, "bf16", torch.bfloat16)

    @case
    def bf16_dp2_resume_dp2():
        return _resume(1, "bf16", dtype=torch.bfloat16)

    @case
    def old_dp2_save():
        _save_old_format("old")
else:  # 4 ranks

    @case
    def dp2_resume_dp4():
        return _resume(1, "dp2")

    @case
    def dp2_resume_tp2_dp2():
        return _resume(2, "dp2")

    @case
    def bf16_dp2_resume_dp4():
        return _resume(1, "bf16", dtype=torch.bfloat16)

    @case
    def old_dp2_resume_dp4():
        return _resume(1, "old")

    @case
    def dp2_resume_dp4_without_optimizer_state():
        return _resume(1, "dp2", optimizer_state=False)


if __name__ == "__main__":
    run_cases()
