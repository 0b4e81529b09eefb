"""What a training step reports about its rollouts: reward, accuracy, length and mixing figures
reduced over data-parallel ranks, and the optional per-response dump (``train.dump_generations``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from megatron.core import parallel_state as ps

from megatron_ngrpo.grpo.loss_inputs import LossInputs
from megatron_ngrpo.grpo.metrics import dp_max, dp_sums
from megatron_ngrpo.training.rollout_stage import ScoredRollout


def rollout_metrics(
    scored: ScoredRollout, scores: torch.Tensor, active: torch.Tensor
) -> dict[str, float]:
    """The step's rollout figures over every DP rank (collective of the DP group); ``scores``
    [N]: the rewards the advantages used (``reward/*``); ``active`` [N] bool: rows not filtered
    out."""
    rollout, rewards = scored.rollout, scored.rewards
    lengths = torch.tensor(rollout.response_lengths, dtype=torch.float64)
    local = {
        "n": float(len(lengths)),
        "r": float(scores.sum()),
        "r2": float((scores**2).sum()),
        "raw": float(sum(rewards.total)),
        "correct": float(sum(rewards.correct)),
        "len": float(lengths.sum()),
        "truncated": float(sum(f == "length" for f in rollout.finish_reasons)),
        "mixed": float(len(rollout.mixes)),
        "filtered": float((~active.cpu()).sum()),
        "rows": float(scored.neighbor_rows),
    }
    s = dp_sums(local)
    n = max(s["n"], 1.0)
    mean = s["r"] / n
    longest = dp_max({"m": float(lengths.max()) if len(lengths) else 0.0})["m"]
    return {
        "reward/mean": mean,
        "reward/std": max(s["r2"] / n - mean * mean, 0.0) ** 0.5,
        "reward/raw_mean": s["raw"] / n,
        "accuracy": s["correct"] / n,
        "response_length/mean": s["len"] / n,
        "response_length/truncated_frac": s["truncated"] / n,
        "mixing/mixed_token_frac": s["mixed"] / max(s["len"], 1.0),
        "filtered_frac": s["filtered"] / n,
        # Summed over DP ranks (each searches its own anchors; TP ranks search together).
        "mixing/neighbor_rows_searched": s["rows"],
        "response_length/max": longest,
    }


def dump_generations(run_dir: Path, step: int, scored: ScoredRollout, inputs: LossInputs) -> None:
    """``run_dir/generations/step<step>_dp<rank>.jsonl``: one row per response of this DP rank
    (text, reward, advantage, finish reason, mixes), written by its first TP rank of the first
    pipeline stage."""
    if ps.get_tensor_model_parallel_rank() or not ps.is_pipeline_first_stage(ignore_virtual=True):
        return
    dp_rank = ps.get_data_parallel_rank()
    path = run_dir / "generations" / f"step{step:07d}_dp{dp_rank:03d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rollout, rewards = scored.rollout, scored.rewards
    with path.open("w") as f:
        for i, text in enumerate(scored.texts):
            row = {
                "prompt_index": rollout.prompt_index[i],
                "text": text,
                "reward": rewards.total[i],
                "correct": rewards.correct[i],
                "advantage": float(inputs.advantages[i]),
                "finish": rollout.finish_reasons[i],
                "mixes": rollout.mixes.select([i]).to_json(),
            }
            f.write(json.dumps(row) + "\n")
