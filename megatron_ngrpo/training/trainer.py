"""The N-GRPO training loop on megatron-core: a thin loop over typed stages.

One step (:meth:`Trainer.train_step`), one typed object per hop:

1. :class:`~megatron_ngrpo.training.rollout_stage.RolloutStage` → :class:`ScoredRollout`: the
   step's prompts (DP shard), the neighbour source of the weight version
   (training/neighbor_source.py), weight sync and generation (one step ahead with
   ``train.async.max_staleness: 1``), rewards, dynamic-sampling refill;
2. :class:`~megatron_ngrpo.grpo.batches.TokenBatch`: the replay batch of its records;
3. :class:`~megatron_ngrpo.training.loss_stage.LossInputStage` →
   :class:`~megatron_ngrpo.grpo.loss_inputs.LossInputs`: old / reference log-probs, the mismatch
   correction, advantages;
4. the update: ``epochs_per_rollout`` passes over mini-batches of ``mini_batch_prompts``
   prompts through :func:`~megatron_ngrpo.grpo.update.loss_and_grads` (globally normalised loss,
   megatron's schedule, clipped optimizer step, LR schedule);
5. the report: step metrics (training/step_metrics.py), validation (training/validation.py),
   checkpoints (atomic, keep-last-N, optionally in the background).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from tqdm import tqdm

from megatron_ngrpo.architecture import ArchSpec, unwrap
from megatron_ngrpo.compat.cpu import device
from megatron_ngrpo.config_loader import to_yaml
from megatron_ngrpo.conversion.checkpoint import (
    META_FILE,
    load_megatron_checkpoint,
    save_megatron_checkpoint,
)
from megatron_ngrpo.conversion.loading import load_weights
from megatron_ngrpo.data.batches import PromptBatches
from megatron_ngrpo.data.datasets import load_train_set
from megatron_ngrpo.data.tokenizer import load_tokenizer, special_token_ids
from megatron_ngrpo.eval.runner import load_benchmarks
from megatron_ngrpo.grpo.batches import TokenBatch
from megatron_ngrpo.grpo.metrics import MetricsWriter, PhaseTimer, dp_max
from megatron_ngrpo.grpo.packing import packing_mode
from megatron_ngrpo.grpo.update import UpdateSettings, loss_and_grads, wrap_for_training
from megatron_ngrpo.mixing.embedding import mixing_embedding
from megatron_ngrpo.mixing.neighbor_mode import resolve_mode
from megatron_ngrpo.mixing.neighbors import neighbor_table_for_model
from megatron_ngrpo.models.config import real_token_count, use_te
from megatron_ngrpo.models.provider import build_model
from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel, model_parallel_seed
from megatron_ngrpo.rewards.registry import build_reward
from megatron_ngrpo.training.async_rollout import build_rollouts
from megatron_ngrpo.training.checkpoint import (
    checkpoint_meta,
    iter_dir,
    load_training_checkpoint,
    resume_point,
    save_training_checkpoint,
)
from megatron_ngrpo.training.job_config import NGRPOConfig
from megatron_ngrpo.training.loss_stage import LossInputStage
from megatron_ngrpo.training.neighbor_source import NeighborSource
from megatron_ngrpo.training.optimizer import build_optimizer, ddp_config
from megatron_ngrpo.training.reference import ReferencePolicy
from megatron_ngrpo.training.rollout_stage import RolloutStage
from megatron_ngrpo.training.step_metrics import dump_generations, rollout_metrics
from megatron_ngrpo.training.stop import StopControl
from megatron_ngrpo.training.validation import BEST_FILE, Validator, best_decision
from megatron_ngrpo.training.warmstart import warm_start_policy
from megatron_ngrpo.training.watchdog import Watchdog

logger = logging.getLogger(__name__)
WARMSTART_DIR = "warmstart"


class Trainer:
    """Builds everything from one validated :class:`NGRPOConfig` and runs the loop.

    Call :meth:`setup` (initialises torch.distributed and megatron's parallel state) then
    :meth:`run`. Every rank runs the same code.
    """

    # The parts :meth:`setup` builds.
    tokenizer: object
    chunks: list  # this rank's megatron model chunks, wrapped in megatron DDP
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    reference: ReferencePolicy | None
    neighbors: NeighborSource
    rollouts: RolloutStage
    loss_inputs: LossInputStage
    settings: UpdateSettings
    validator: Validator
    metrics: MetricsWriter

    def __init__(self, cfg: NGRPOConfig):
        self.cfg = cfg
        self.step = 0
        self.updates = 0
        self.best: dict | None = None
        self.async_saves = None  # megatron AsyncCallsQueue with train.async_save
        self.timer = PhaseTimer()
        self.stop = StopControl(cfg.train.stop)  # signal handlers from here on
        self.stopped: str | None = None  # the reason of a planned stop
        self.saved_step = 0  # the step of the newest checkpoint (published or in the queue)

    # ---- set-up ----------------------------------------------------------------------------
    def setup(self) -> None:
        self._load_inputs()
        self._init_parallel()
        self._build_policy()
        self._build_stages()
        if self.resume_from is not None:
            self._resume(self.resume_from)

    def _load_inputs(self) -> None:
        """The tokenizer and data first: a bad row or prompt is one line (DataError) before any
        process group starts, and no run starts on a partial data set (held-out files included)."""
        cfg = self.cfg
        self.spec = ArchSpec.from_hf(cfg.model.hf_path)
        self.tokenizer = load_tokenizer(cfg.tokenizer, cfg.model.hf_path)
        self.num_real_tokens = real_token_count(
            cfg.model.num_real_tokens, self.spec.vocab_size, self.tokenizer
        )
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)
        self.examples = load_train_set(cfg.data, self.tokenizer)
        v = cfg.validation
        self.val_benchmarks = load_benchmarks(v.benchmarks, v.limit) if v.every else []
        self.resume_from = resume_point(cfg.train.run_dir, cfg.train.resume)

    def _init_parallel(self) -> None:
        cfg = self.cfg
        self.run_dir = Path(cfg.train.run_dir)
        init_distributed(cfg.train.dist_timeout_s, trace_dir=str(self.run_dir / "nccl_traces"))
        initialize_model_parallel(
            cfg.model.tensor_parallel,
            cfg.model.pipeline_parallel,
            cfg.model.virtual_pipeline,
            seed=cfg.train.seed,
        )
        self.device = device()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        if dist.get_rank() == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.watchdog = Watchdog.for_job(cfg.train.watchdog, cfg.train.dist_timeout_s, self.run_dir)
        self.prompts = PromptBatches(
            self.examples, cfg.train.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle
        )
        t = cfg.train
        self.total_steps = t.max_steps or t.num_epochs * self.prompts.batches_per_epoch
        self.updates_per_step = t.epochs_per_rollout * (t.prompts_per_step // t.mini_batch_prompts)

    def _build_policy(self) -> None:
        """The policy (weights loaded, warm-started once), its optimizer and the reference."""
        cfg = self.cfg
        # Re-seed right before building: the random initialisation ("random" load) must not depend
        # on what consumed the generators before (e.g. the datasets cache being cold or warm).
        model_parallel_seed(cfg.train.seed)
        chunks = build_model(cfg.model)
        load_weights(chunks, cfg.model, cfg.train.load)
        warm_dir = self.run_dir / WARMSTART_DIR
        warm_done = (warm_dir / META_FILE).is_file()
        if cfg.train.warmstart.steps and warm_done:
            load_megatron_checkpoint(chunks, warm_dir)  # the RL starting point = the reference
        for c in chunks:
            emb = mixing_embedding(c)
            if emb is not None:
                emb.embedding_grad = cfg.mixing.embedding_grad
        self.chunks = wrap_for_training(chunks, ddp_config(cfg.optim))
        self.optimizer, self.scheduler = build_optimizer(
            cfg.optim, cfg.model, self.chunks, self.total_steps * self.updates_per_step
        )
        if cfg.train.warmstart.steps and not warm_done:
            losses = warm_start_policy(
                cfg,
                self.chunks,
                self.optimizer,
                self.scheduler,
                self.tokenizer,
                self.pad_id,
                self.num_real_tokens,
            )
            logger.info(
                "warm-start: %d steps, NLL %.4f -> %.4f", len(losses), losses[0], losses[-1]
            )
            meta = checkpoint_meta(cfg.model, warmstart_nll=losses)
            save_megatron_checkpoint(self.chunks, warm_dir, meta, overwrite=True)
        # The reference policy is the policy RL starts from (after any warm-start).
        self.reference = None
        if cfg.grpo.needs_reference:
            self.reference = ReferencePolicy(
                self.chunks, cfg.train.reference, cfg.model, cfg.rollout.batch_invariant
            )

    def _build_stages(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        engine, producer = build_rollouts(cfg, self.chunks, self.tokenizer, t.seed)
        # Every weight sync (rollout, one-step-off launch, validation) is a watchdog stage.
        engine.sync_weights = self.watchdog.watched("weight_sync", engine.sync_weights)
        # The most decode positions one weight version serves on a DP rank: auto's cost rule.
        positions = t.prompts_per_step // self.dp_size * cfg.rollout.n * cfg.rollout.max_new_tokens
        mode = resolve_mode(
            cfg.mixing,
            engine.neighbors_on_demand,
            positions,
            unwrap(self.chunks[0]).vocab_size,
            torch.device(self.device).type,
        )
        special = special_token_ids(self.tokenizer)
        self.neighbors = NeighborSource(
            cfg.mixing,
            mode,
            lambda: neighbor_table_for_model(
                self.chunks, cfg.mixing, self.num_real_tokens, special
            ),
        )
        logger.info("neighbour source: %s", mode)
        self.rollouts = RolloutStage(
            cfg,
            self.chunks,
            engine,
            producer,
            self.prompts,
            build_reward(cfg.reward, cfg.rollout.max_new_tokens),
            self.neighbors,
            self.tokenizer,
            self.dp_rank,
            self.dp_size,
            self.num_real_tokens,
            self.timer,
        )
        self.settings = UpdateSettings(
            temperature=cfg.rollout.temperature,
            micro_batch_size=t.micro_batch_size,
            max_tokens=t.max_tokens_per_micro_batch,
            vocab_limit=self.num_real_tokens,
            max_response_len=cfg.rollout.max_new_tokens,
            packing=packing_mode(t.pack_sequences, use_te(cfg.model), cfg.rollout.batch_invariant),
        )
        filtering = cfg.grpo.filter_zero_variance or t.dynamic_sampling.enabled
        self.loss_inputs = LossInputStage(
            cfg.grpo, self.chunks, self.settings, self.reference, filtering, self.timer
        )
        self.validator = Validator(
            cfg, self.val_benchmarks, engine, self.neighbors, self.tokenizer, self.run_dir
        )
        self.metrics = MetricsWriter(
            self.run_dir, t.tensorboard, t.trackers, dataclasses.asdict(cfg)
        )
        if t.async_save:
            # lazy: megatron's async-save machinery, only with train.async_save
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.async_saves = AsyncCallsQueue()

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg.train
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=not (cfg.progress and dist.get_rank() == 0),
        )
        try:
            if self.step == 0 and self.cfg.validation.every and self.cfg.validation.at_start:
                self.metrics.write(0, self.validate())
            while self.step < self.total_steps:
                self.stopped = self.stop.agreed()  # the step boundary: every rank, one collective
                if self.stopped:
                    self._planned_stop()
                    break
                started = time.perf_counter()
                metrics = self.train_step()
                self.step += 1
                validating = self.validator.due(self.step, self.total_steps)
                if validating:
                    metrics.update(self.validate())
                # The row goes out before the checkpoint: a run killed after the save resumes past
                # this step and truncates the metrics file to it, so the row must already be there.
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    self.metrics.write(self.step, metrics)
                saved = validating and self._keep_if_best(metrics)
                last = self.step == self.total_steps
                if not saved and cfg.save_every and (self.step % cfg.save_every == 0 or last):
                    self.save()
                bar.set_postfix(
                    reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics.get('kl', 0):.4f}"
                )
                bar.update()
                if self.async_saves is not None:  # publish a background save once it is written
                    self.async_saves.maybe_finalize_async_calls(blocking=False)
                self.stop.step_done(self.step, time.perf_counter() - started)
            if self.async_saves is not None:
                self.async_saves.maybe_finalize_async_calls(blocking=True)
                self.async_saves.close()
        finally:
            bar.close()
            self.metrics.close(self.stopped)
            self.rollouts.close()
            self.watchdog.close()

    def train_step(self) -> dict[str, float]:
        """One GRPO step: roll out and score, build the loss inputs, update, report."""
        self.timer.reset()
        with self.watchdog.stage("rollout", self.step + 1):
            scored = self.rollouts.next(self.step, self.updates, self.total_steps)
        with self.watchdog.stage("update", self.step + 1):  # the loss inputs and the update
            batch = TokenBatch.from_rollout(scored.rollout, pad_id=self.pad_id, device=self.device)
            built = self.loss_inputs.build(scored, batch)
            if self.cfg.train.dump_generations:
                dump_generations(self.run_dir, self.step, scored, built.inputs)
            with self.timer("update"):
                update_metrics = self._update(batch.with_inputs(built.inputs))
        return {
            **scored.metrics,
            **built.metrics,
            **update_metrics,
            **rollout_metrics(scored, built.scores, built.inputs.active),
            **{f"weight_sync/{k}": float(v) for k, v in self.rollouts.engine.last_sync.items()},
            **dp_max(self.timer.report()),
            "lr": self.optimizer.param_groups[0]["lr"],
        }

    def _update(self, batch: TokenBatch) -> dict[str, float]:
        """``epochs_per_rollout`` passes of optimizer steps over mini-batches of the batch;
        per-mini-batch statistics averaged (``ratio_max``: the max)."""
        t = self.cfg.train
        rows_per_mini = t.mini_batch_prompts // self.dp_size * self.cfg.rollout.n
        totals: dict[str, float] = {}
        n = skipped = 0
        first = None
        for _ in range(t.epochs_per_rollout):
            for start in range(0, batch.num_rows, rows_per_mini):
                rows = list(range(start, min(start + rows_per_mini, batch.num_rows)))
                stats = loss_and_grads(
                    self.chunks,
                    batch.micro_batch(rows),
                    self.cfg.grpo,
                    self.settings,
                    self.optimizer,
                    scheduler=self.scheduler,
                    step=True,
                )
                first = first or stats
                skipped += stats["normaliser"] == 0  # nothing active anywhere: no signal, no step
                self.updates += 1
                n += 1
                for k, v in stats.items():
                    totals[k] = (
                        max(totals.get(k, v), v) if k == "ratio_max" else totals.get(k, 0.0) + v
                    )
        out = {
            k: (v if k == "ratio_max" else v / n)
            for k, v in totals.items()
            if k not in ("tokens", "normaliser")
        }
        # On the first mini-batch the policy is still the rollout policy: with engine old
        # log-probs, |log-ratio| there is the rollout/trainer gap.
        out["first_update/abs_log_ratio"] = first["abs_log_ratio"]
        out["skipped_updates"] = float(skipped)
        return out

    def validate(self) -> dict[str, float]:
        """The validation benchmarks on the current weights (every rank: same metrics)."""
        with self.watchdog.stage("validation", self.step):
            self.rollouts.settle()  # the engine is free: an in-flight batch is kept
            return self.validator.run(self.chunks, self.step, self.updates)

    def _keep_if_best(self, metrics: dict) -> bool:
        """Save and remember the checkpoint when mean@n improved; True if it saved. The save is
        collective, so rank 0 decides for everyone (:func:`best_decision`)."""
        if not self.cfg.validation.keep_best:
            return False
        best = best_decision(metrics, self.best, self.step, iter_dir(self.run_dir, self.step).name)
        if best is None:
            return False
        self.best = best
        self.save()
        if dist.get_rank() == 0:
            (self.run_dir / BEST_FILE).write_text(json.dumps(self.best) + "\n")
        return True

    # ---- checkpoints -------------------------------------------------------------------------
    def _planned_stop(self) -> None:
        """Publish a checkpoint of the step reached (written now, whatever train.async_save)."""
        logger.warning("planned stop (%s) at step %d: saving", self.stopped, self.step)
        if self.async_saves is not None:  # the queued save is published first
            self.async_saves.maybe_finalize_async_calls(blocking=True)
        if self.step > self.saved_step:
            self.save(sync=True)

    def save(self, sync: bool = False) -> Path:
        """Checkpoint the step reached (``sync``: written before returning even with
        train.async_save); its time is the stop margin's save time."""
        started = time.perf_counter()
        meta = checkpoint_meta(self.cfg.model, config=dataclasses.asdict(self.cfg))
        protect = (self.best["checkpoint"],) if self.best else ()
        if self.async_saves is not None:  # one save in flight: keep_last counts complete ones
            self.async_saves.maybe_finalize_async_calls(blocking=True)
        state = {
            "step": self.step,
            "updates": self.updates,
            "data": self.prompts.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            **self.neighbors.state_dict(),
            "best": self.best,
        }
        with self.watchdog.stage("save", self.step), self.stop.signals_held():
            path = save_training_checkpoint(
                self.run_dir,
                self.step,
                self.chunks,
                meta,
                self.optimizer,
                state,
                self.cfg.train.keep_last,
                protect,
                rank_state=self.rollouts.state_dict(),
                async_queue=None if sync else self.async_saves,
            )
        if self.async_saves is not None and not sync:
            logger.info("checkpoint %s: written in the background", path.name)
        self.saved_step = self.step
        self.stop.save_s = time.perf_counter() - started
        return path

    def _resume(self, path: Path) -> None:
        state = load_training_checkpoint(path, self.chunks, self.optimizer)
        self.step, self.updates = int(state["step"]), int(state["updates"])
        self.saved_step = self.step
        self.prompts.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.neighbors.load_state_dict(state)
        self.best = state.get("best")
        if state.get("rank_state") is not None:  # the one-step-off rollout in flight at the save
            self.rollouts.load_state_dict(state["rank_state"])
        self.metrics.truncate(self.step)
        logger.info("resumed from %s at step %d", path, self.step)
