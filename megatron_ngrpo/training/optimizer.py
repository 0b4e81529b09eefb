"""The trainer's megatron-core optimizer, learning-rate schedule and DDP settings (``optim``)."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.models.provider import params_dtype
from megatron_ngrpo.training.config import OptimConfig


def ddp_config(o: OptimConfig) -> DistributedDataParallelConfig:
    """Gradients reduced in fp32, after the last micro-batch (the loss is summed, not averaged:
    grpo/update.py), sharded with the distributed optimizer when ``o.distributed_optimizer``."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=o.distributed_optimizer,
    )


def build_optimizer(o: OptimConfig, model: ModelConfig, chunks: list, total_updates: int):
    """AdamW over ``chunks`` (wrapped for training) in the model's precision (fp32 main weights
    for bf16/fp16) and its schedule over ``total_updates`` optimizer steps; returns both."""
    dtype = params_dtype(model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=o.distributed_optimizer,
        ),
        chunks,
    )
    unwrap(chunks[0]).config.grad_scale_func = optimizer.scale_loss
    total = max(total_updates, 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=total,
        lr_decay_style=o.lr_schedule,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
    return optimizer, scheduler
