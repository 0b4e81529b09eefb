"""Distributed-optimizer checkpoints across layouts, for tests/test_checkpoint.py.

Run at 2 ranks (``NGRPO_CKPT_PHASE=save``) and then at 4 (``resume``) on one checkpoint folder
(``NGRPO_CKPT_DIR``). A run trains a tiny Qwen2 with megatron DDP + the distributed optimizer
(Adam) for two steps on a fixed global batch, saves a training checkpoint, then "continues":
one more update and the loss of the updated model. Each case returns that loss and every updated
parameter (assembled whole); the test compares a resharded continuation with the saving layout's
own one.

The global batch is the same at every DP size (DP rank r takes rows r·B/DP ...), and the loss is
the global token mean: each rank's token sum / all tokens, summed over DP by the DDP gradient
reduction (``wrap_for_training`` sets ``calculate_per_token_loss``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ngrpo.testing.multiproc import case, run_cases

ROWS, SEQ, VOCAB = 8, 16, 256
ROOT = Path(os.environ.get("NGRPO_CKPT_DIR", "/tmp"))


def _build(tp: int):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.grpo.update import wrap_for_training
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from megatron_ngrpo.testing.tiny import write_tiny_hf

    hf = ROOT / "hf"
    if dist.get_rank() == 0 and not (hf / "config.json").is_file():
        write_tiny_hf(hf, weights=False, vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, intermediate_size=128)
    dist.barrier()
    initialize_model_parallel(tp, 1)
    # padded vocab 256 at TP 1 and 2: the same tensors in every layout
    cfg = ModelConfig(hf_path=str(hf), tensor_parallel=tp, make_vocab_size_divisible_by=128)
    chunks = wrap_for_training(build_model(cfg), DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1.0, params_dtype=torch.float32,
        use_distributed_optimizer=True), chunks)
    unwrap(chunks[0]).config.grad_scale_func = optimizer.scale_loss
    return cfg, chunks, optimizer


def _loss(chunks, step: int, backward: bool) -> float:
    """The global token-mean cross-entropy of step ``step``'s batch (and its gradients)."""
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)[r * ROWS // dp:(r + 1) * ROWS // dp]
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
def _parameters(chunks) -> dict[str, list[float]]:
    """Every parameter of the global model, assembled on rank 0 from the ranks' shards (the
    ShardedTensors' global offsets), flattened."""
    from megatron_ngrpo.architecture import unwrap
    from megatron_ngrpo.conversion.checkpoint import _flat_sharded_tensors

    mine = [(sh.key, sh.global_shape, sh.global_offset,  # with the layer axes megatron prepends
             sh.data.reshape((1,) * (len(sh.global_shape) - sh.data.dim()) + tuple(sh.data.shape)))
            for _, _, sh in _flat_sharded_tensors(unwrap(chunks[0]).sharded_state_dict())
            if sh.key.endswith(("weight", "bias"))]
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, mine)
    full = {}
    for key, shape, offset, data in (t for rank in shards for t in rank):
        whole = full.setdefault(key, torch.full(shape, float("nan")))
        whole[tuple(slice(o, o + n) for o, n in zip(offset, data.shape, strict=True))] = data
    return {k: v.flatten().tolist() for k, v in sorted(full.items())}


def _continue(chunks, optimizer) -> dict:
    """Step 3 from a step-2 state: the loss before its update, Adam's step counts after it, the
    updated model's loss and parameters."""
    before = _update(chunks, optimizer, 3)
    steps = sorted({float(st["step"]) for o in optimizer.chained_optimizers for st in o.optimizer.state.values()})
    return {"before": before, "steps": steps, "loss": _loss(chunks, 4, backward=False),
            "params": _parameters(chunks)}


def _save_after_two_steps(tp: int, name: str) -> dict:
    from megatron_ngrpo.training.checkpoint import checkpoint_meta, save_training_checkpoint

    cfg, chunks, optimizer = _build(tp)
    for step in (1, 2):
        _update(chunks, optimizer, step)
    save_training_checkpoint(ROOT / name, 2, chunks, checkpoint_meta(cfg), optimizer, {"step": 2})
    return _continue(chunks, optimizer)


def _resume(tp: int, name: str, optimizer_state: bool = True) -> dict:
    from megatron_ngrpo.conversion.checkpoint import load_megatron_checkpoint
    from megatron_ngrpo.training.checkpoint import latest_checkpoint, load_training_checkpoint

    _, chunks, optimizer = _build(tp)
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
else:  # 4 ranks
    @case
    def dp2_resume_dp4():
        return _resume(1, "dp2")

    @case
    def dp2_resume_tp2_dp2():
        return _resume(2, "dp2")

    @case
    def dp2_resume_dp4_without_optimizer_state():
        return _resume(1, "dp2", optimizer_state=False)


if __name__ == "__main__":
    run_cases()
