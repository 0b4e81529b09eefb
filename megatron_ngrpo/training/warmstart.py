"""Supervised warm-start: a few steps of next-token NLL on gold responses before RL.

Tiny models created from scratch (the CPU demo, the study) never write a gradeable answer, so
GRPO has no reward signal to work with; a brief supervised phase on worked solutions teaches the
answer format. It uses the trainer's own pieces — ``TokenBatch`` replay batches, the GRPO update
step (``grpo.update.update_step``: megatron's schedule and optimizer) and vocab-parallel
log-probs — with the token-mean NLL as the loss, so it runs at any TP/PP/DP layout. Real runs start from a pretrained model and skip it
(``train.warmstart.steps = 0``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from tqdm import tqdm

from megatron_ngrpo.compat.cpu import device
from megatron_ngrpo.data.templates import TRAIN_INSTRUCTION, encode_prompt, math_message
from megatron_ngrpo.grpo.batches import RowTensors, TokenBatch
from megatron_ngrpo.grpo.logprobs import token_logprobs
from megatron_ngrpo.grpo.loss import aggregation_weights
from megatron_ngrpo.grpo.update import update_step
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.rollout.types import RolloutBatch
from megatron_ngrpo.training.config import WarmstartConfig


@dataclass
class TokenWeights(RowTensors):
    """The NLL's per-token weights [B, L] (token-mean over the batch on every DP rank)."""

    token_weight: torch.Tensor


def load_pairs(path: str | Path, render_prompt, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + EOS) of every row of a JSONL file of problem/response pairs."""
    pairs = []
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("problem"), str) or not isinstance(row.get("response"), str):
            raise ValueError(f"{path}:{i}: expected string fields 'problem' and 'response'")
        response = tokenizer(row["response"], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            response = response + [tokenizer.eos_token_id]
        pairs.append((render_prompt(row["problem"]), response))
    return pairs


def warmstart(
    model_chunks: list,
    optimizer,
    pairs: list[tuple[list[int], list[int]]],
    cfg: WarmstartConfig,
    micro_batch_size: int,
    pad_id: int,
    seed: int,
    vocab_limit: int | None = None,
    progress: bool = False,
) -> list[float]:
    """``cfg.steps`` optimizer steps of token-mean NLL on batches of ``pairs`` drawn with
    ``seed`` (same batches on every rank; each DP rank takes its share). Returns the losses.

    ``model_chunks`` must be wrapped for training (``grpo.update.wrap_for_training``) so the
    per-micro-batch losses add up to the batch mean and DP gradients are reduced.
    """

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    gen = torch.Generator().manual_seed(seed)
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr
    losses = []
    for _ in tqdm(range(cfg.steps), desc="warm-start", disable=not progress):
        pick = torch.randint(len(pairs), (cfg.batch_size,), generator=gen).tolist()
        mine = [pairs[i] for i in pick[dp_rank::dp_size]]
        rollout = RolloutBatch(
            prompt_ids=[p for p, _ in mine],
            response_ids=[r for _, r in mine],
            logprobs=[[0.0] * len(r) for _, r in mine],
            finish_reasons=["stop"] * len(mine),
            mixes=MixRecord.empty(len(mine), 1),
            prompt_index=list(range(len(mine))),
        )
        batch = TokenBatch.from_rollout(rollout, pad_id=pad_id, device=device())
        weights, _ = aggregation_weights(
            batch.mask,
            torch.ones(len(mine), dtype=torch.bool, device=batch.mask.device),
            "token-mean",
            1,
            ps.get_data_parallel_group(),
        )
        batch = batch.with_inputs(TokenWeights(weights))

        def loss_fn(mb: TokenBatch, logits: torch.Tensor):
            lp, _ = token_logprobs(logits, mb.labels, 1.0, vocab_limit)
            loss = -(lp * mb.inputs.token_weight).sum()
            return (
                loss,
                torch.zeros((), dtype=torch.int, device=loss.device),
                {"nll": loss.detach()},
            )

        store, _ = update_step(model_chunks, batch, loss_fn, micro_batch_size, optimizer=optimizer)
        losses.append(float(sum(s["nll"] for s in store)) if store else float("nan"))
    return losses


def warm_start_policy(
    cfg, chunks: list, optimizer, scheduler, tokenizer, pad_id: int, num_real_tokens: int
) -> list[float]:
    """``train.warmstart`` of the run ``cfg`` on its policy ``chunks``, then RL's starting
    optimizer state: fresh Adam moments (what a run resumed right after the warm-start has too)
    and the schedule's learning rate. Returns the NLL per step."""
    w, template = cfg.train.warmstart, cfg.data.template
    instruction = template.instruction_or(TRAIN_INSTRUCTION)
    pairs = load_pairs(
        w.path,
        lambda problem: encode_prompt(math_message(problem, instruction), tokenizer, template),
        tokenizer,
    )
    losses = warmstart(
        chunks,
        optimizer,
        pairs,
        w,
        cfg.train.micro_batch_size,
        pad_id,
        cfg.train.seed,
        num_real_tokens,
        cfg.train.progress and dist.get_rank() == 0,
    )
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        o.optimizer.state.clear()
    scheduler.step(0)
    return losses
