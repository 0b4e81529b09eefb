"""In-training validation (``validation.every``): the held-out benchmarks on the rollout engine
with the current weights, split over data-parallel ranks, and the keep-best decision.

Mixing at validation (``mixing.at_eval``, the inference-time ablation) uses the run's neighbour
source of the evaluated weight version, set by its owner like a rollout's.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ngrpo.eval.runner import evaluate
from megatron_ngrpo.parallel import broadcast_from_rank0
from megatron_ngrpo.rewards.graders import build_grader
from megatron_ngrpo.rollout.types import RolloutEngine, SamplingParams
from megatron_ngrpo.training.job_config import NGRPOConfig
from megatron_ngrpo.training.neighbor_source import NeighborSource

BEST_FILE = "best"


class Validator:
    """Runs the validation benchmarks (every rank, same calls).

    Args:
        cfg: the run's config (``validation``, ``reward``, ``mixing``, ``data.template``).
        benchmarks: the loaded validation benchmarks.
        engine: the rollout engine.
        neighbors: the owner of the neighbour source.
        tokenizer: the policy's tokenizer.
        run_dir: records go to ``run_dir/validation/step<N>`` (rank 0).
    """

    def __init__(
        self,
        cfg: NGRPOConfig,
        benchmarks: list,
        engine: RolloutEngine,
        neighbors: NeighborSource,
        tokenizer,
        run_dir: Path,
    ):
        self.cfg, self.benchmarks, self.engine = cfg, benchmarks, engine
        self.neighbors, self.tokenizer, self.run_dir = neighbors, tokenizer, run_dir

    def due(self, step: int, total_steps: int) -> bool:
        every = self.cfg.validation.every
        return bool(every) and (step % every == 0 or step == total_steps)

    def run(self, chunks: list, step: int, updates: int) -> dict[str, float]:
        """``val/*`` metrics of the weights ``chunks`` (after ``updates`` optimizer updates) at
        ``step``; every rank returns the same metrics."""
        v = self.cfg.validation
        self.engine.wake_up()
        self.engine.sync_weights(chunks)
        mixing = None
        if self.cfg.mixing.at_eval and self.neighbors.mixing is not None:
            self.neighbors.refresh(updates)
            mixing = self.neighbors.mixing
        self.neighbors.apply(self.engine)
        out_dir = self.run_dir / "validation" / f"step{step:07d}" if dist.get_rank() == 0 else None
        grader = build_grader(self.cfg.reward)
        try:
            result = evaluate(
                self.engine,
                self.tokenizer,
                self.benchmarks,
                SamplingParams.from_config(v.sampling, self.tokenizer.eos_token_id),
                grader,
                template=self.cfg.data.template,
                out_dir=out_dir,
                max_tokens_per_call=v.max_tokens_per_call,
                dp_group=ps.get_data_parallel_group(),
                progress=False,
                mixing=mixing,
            )
        finally:
            grader.close()
            self.engine.sleep()
        return {f"val/{k}": float(x) for k, x in result.average.items()}


def best_decision(metrics: dict, best: dict | None, step: int, checkpoint: str) -> dict | None:
    """The new best record (step, metric, value, checkpoint) when ``metrics``' mean@n improved on
    ``best``, else None: global rank 0's decision on every rank (collective). Ranks deciding from
    their own numbers (different metrics after a partial failure, float noise) would disagree and
    the collective save that follows would hang."""

    key = next((k for k in metrics if k.startswith("val/mean@")), None)
    decision = None
    if key is not None and (best is None or metrics[key] > best["value"]):
        decision = {
            "step": step,
            "metric": key,
            "value": float(metrics[key]),
            "checkpoint": checkpoint,
        }
    return broadcast_from_rank0(decision)
