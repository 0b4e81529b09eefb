"""The N-GRPO training loop on megatron-core.

One rollout step (``Trainer.train_step``):

1. prompts: the step's global batch (resumable :class:`~megatron_ngrpo.data.batches.PromptBatches`),
   split over data-parallel ranks by prompt, so every group stays on one rank;
2. neighbour table: computed at start and every ``mixing.refresh_every`` updates
   (:func:`~megatron_ngrpo.mixing.neighbors.neighbor_table_for_model`), checkpointed;
3. rollout through the engine (``rollout.factory.build_engine``), seeded by (seed, step) and
   keyed by the prompt's position in the step, so a resumed run regenerates the same responses
   (``train.async.max_staleness: 1``: made one step ahead, training/async_rollout.py);
4. rewards (grader + shaping), optional DRA adjustment, group advantages, zero-variance filter;
5. old log-probs (recomputed on the replayed history, or the engine's), reference log-probs
   (frozen initial weights), the rollout/trainer log-prob gap and optional TIS weights;
6. ``epochs_per_rollout`` passes over mini-batches of ``mini_batch_prompts`` prompts: globally
   normalised loss, gradients through megatron's schedule, clipped megatron optimizer step, LR
   schedule;
7. metrics (JSONL, TensorBoard), checkpoints (atomic, keep-last-N), optional validation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
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
from megatron_ngrpo.data.templates import TRAIN_INSTRUCTION, encode_prompt, math_message
from megatron_ngrpo.data.tokenizer import load_tokenizer, special_token_ids
from megatron_ngrpo.eval.runner import eval_mixing, evaluate, load_benchmarks
from megatron_ngrpo.grpo.advantages import (
    compute_advantages,
    group_ids,
    zero_variance_groups,
)
from megatron_ngrpo.grpo.batches import TokenBatch
from megatron_ngrpo.grpo.dra import ResponseHiddenMeans, dra_rewards, similarity, text_embedder
from megatron_ngrpo.grpo.dynamic_sampling import (
    DynamicSamplingExhausted,
    choose_groups,
    exhausted_message,
)
from megatron_ngrpo.grpo.logprobs import batch_logprobs
from megatron_ngrpo.grpo.metrics import MetricsWriter, PhaseTimer, dp_max, dp_sums
from megatron_ngrpo.grpo.mismatch import correction, mismatch_metrics, mismatch_sums
from megatron_ngrpo.grpo.update import UpdateSettings, loss_and_grads, wrap_for_training
from megatron_ngrpo.mixing.embedding import mixing_embedding
from megatron_ngrpo.mixing.neighbors import neighbor_table_for_model
from megatron_ngrpo.models.config import real_token_count, use_te
from megatron_ngrpo.models.provider import build_model, params_dtype
from megatron_ngrpo.parallel import (
    broadcast_from_rank0,
    init_distributed,
    initialize_model_parallel,
    model_parallel_seed,
)
from megatron_ngrpo.rewards.graders import build_grader
from megatron_ngrpo.rewards.registry import build_reward
from megatron_ngrpo.rollout.types import RolloutBatch, SamplingParams, active_mixing
from megatron_ngrpo.training.async_rollout import build_rollouts
from megatron_ngrpo.training.checkpoint import (
    checkpoint_meta,
    iter_dir,
    latest_checkpoint,
    load_training_checkpoint,
    save_training_checkpoint,
)
from megatron_ngrpo.training.job_config import NGRPOConfig
from megatron_ngrpo.training.reference import ReferencePolicy
from megatron_ngrpo.training.snapshot import WeightSnapshot
from megatron_ngrpo.training.warmstart import load_pairs, warmstart

logger = logging.getLogger(__name__)
BEST_FILE = "best"
WARMSTART_DIR = "warmstart"


class Trainer:
    """Builds everything from one validated :class:`NGRPOConfig` and runs the loop.

    Call :meth:`setup` (initialises torch.distributed and megatron's parallel state) then
    :meth:`run`. Every rank runs the same code.
    """

    def __init__(self, cfg: NGRPOConfig):
        self.cfg = cfg
        self.step = 0
        self.updates = 0
        self.table: torch.Tensor | None = None
        self.table_updates = -1  # self.updates when the table was computed
        self.best: dict | None = None
        self.async_saves = None  # megatron AsyncCallsQueue with train.async_save

    # ---- set-up ----------------------------------------------------------------------------
    def setup(self) -> None:

        cfg = self.cfg
        # The data first: a bad row or prompt is one line (DataError) before any process group
        # starts, and no run starts on a partial data set (the held-out files included).
        self.spec = ArchSpec.from_hf(cfg.model.hf_path)
        self.tokenizer = load_tokenizer(cfg.tokenizer, cfg.model.hf_path)
        self.num_real_tokens = real_token_count(
            cfg.model.num_real_tokens, self.spec.vocab_size, self.tokenizer
        )
        self.examples = load_train_set(cfg.data, self.tokenizer)
        v = cfg.validation
        self.val_benchmarks = load_benchmarks(v.benchmarks, v.limit) if v.every else []
        init_distributed(
            cfg.train.dist_timeout_s, trace_dir=str(Path(cfg.train.run_dir) / "nccl_traces")
        )
        initialize_model_parallel(
            cfg.model.tensor_parallel,
            cfg.model.pipeline_parallel,
            cfg.model.virtual_pipeline,
            seed=cfg.train.seed,
        )
        self.device = device()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.run_dir = Path(cfg.train.run_dir)
        if dist.get_rank() == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)

            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.prompts = PromptBatches(
            self.examples, cfg.train.prompts_per_step, seed=cfg.data.seed, shuffle=cfg.data.shuffle
        )
        self.total_steps = (
            cfg.train.max_steps or cfg.train.num_epochs * self.prompts.batches_per_epoch
        )
        self.updates_per_step = cfg.train.epochs_per_rollout * (
            cfg.train.prompts_per_step // cfg.train.mini_batch_prompts
        )

        # Re-seed right before building: the random initialisation ("random" load) must not depend
        # on what consumed the generators before (e.g. the datasets cache being cold or warm).
        model_parallel_seed(cfg.train.seed)
        chunks = build_model(cfg.model)
        load_weights(chunks, cfg.model, cfg.train.load)
        warm_dir = self.run_dir / WARMSTART_DIR
        warm_done = (warm_dir / META_FILE).is_file()
        if cfg.train.warmstart.steps and warm_done:
            load_megatron_checkpoint(chunks, warm_dir)  # the RL starting point = the reference
        self._set_embedding_grad(chunks)
        self.chunks = wrap_for_training(chunks, self._ddp_config())
        self.optimizer, self.scheduler = self._build_optimizer()
        if cfg.train.warmstart.steps and not warm_done:
            self._warmstart(warm_dir)
        # The reference policy is the policy RL starts from (after any warm-start).
        self.reference = (
            ReferencePolicy(self.chunks, cfg.train.reference, cfg.model)
            if cfg.grpo.needs_reference
            else None
        )
        self.reward_fn = build_reward(cfg.reward, cfg.rollout.max_new_tokens)
        self.engine, self.rollouts = build_rollouts(
            cfg, self.chunks, self.tokenizer, cfg.train.seed
        )
        self.settings = UpdateSettings(
            temperature=cfg.rollout.temperature,
            micro_batch_size=cfg.train.micro_batch_size,
            max_tokens=cfg.train.max_tokens_per_micro_batch,
            vocab_limit=self.num_real_tokens,
            max_response_len=cfg.rollout.max_new_tokens,
            packing=("thd" if use_te(cfg.model) else "mask") if cfg.train.pack_sequences else "",
        )
        self.metrics = MetricsWriter(
            self.run_dir, cfg.train.tensorboard, cfg.train.trackers, dataclasses.asdict(cfg)
        )
        if cfg.train.async_save:
            # lazy: megatron's async-save machinery, only with train.async_save
            from megatron.core.dist_checkpointing.strategies.async_utils import (
                AsyncCallsQueue,
            )

            self.async_saves = AsyncCallsQueue()
        latest = latest_checkpoint(self.run_dir) if cfg.train.resume else None
        if latest is not None:
            self._resume(latest)

    def _warmstart(self, warm_dir: Path) -> None:
        """Supervised warm-start (train.warmstart), then a model checkpoint of its result in
        ``run_dir/warmstart`` so a resumed run rebuilds the same reference policy."""

        cfg, w = self.cfg, self.cfg.train.warmstart
        template = cfg.data.template
        instruction = template.instruction_or(TRAIN_INSTRUCTION)
        pairs = load_pairs(
            w.path,
            lambda problem: encode_prompt(
                math_message(problem, instruction), self.tokenizer, template
            ),
            self.tokenizer,
        )
        losses = warmstart(
            self.chunks,
            self.optimizer,
            pairs,
            w,
            cfg.train.micro_batch_size,
            self._pad_id(),
            cfg.train.seed,
            self.num_real_tokens,
            cfg.train.progress and dist.get_rank() == 0,
        )
        # RL starts like from a pretrained model: fresh Adam moments (also what a run resumed right
        # after the warm-start has) and the schedule's learning rate.
        for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            o.optimizer.state.clear()
        self.scheduler.step(0)
        logger.info("warm-start: %d steps, NLL %.4f -> %.4f", w.steps, losses[0], losses[-1])
        save_megatron_checkpoint(
            self.chunks, warm_dir, checkpoint_meta(cfg.model, warmstart_nll=losses), overwrite=True
        )

    def _set_embedding_grad(self, chunks: list) -> None:
        for c in chunks:
            emb = mixing_embedding(c)
            if emb is not None:
                emb.embedding_grad = self.cfg.mixing.embedding_grad

    def _ddp_config(self):
        return DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.cfg.optim.distributed_optimizer,
        )

    def _build_optimizer(self):

        o = self.cfg.optim
        dtype = params_dtype(self.cfg.model)
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
            self.chunks,
        )
        unwrap(self.chunks[0]).config.grad_scale_func = optimizer.scale_loss
        total = max(self.total_steps * self.updates_per_step, 1)
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

    # ---- checkpoints -------------------------------------------------------------------------
    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "updates": self.updates,
            "data": self.prompts.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "neighbor_table": self.table,
            "table_updates": self.table_updates,
            "best": self.best,
        }

    def save(self) -> Path:
        meta = checkpoint_meta(self.cfg.model, config=dataclasses.asdict(self.cfg))
        protect = (self.best["checkpoint"],) if self.best else ()
        if (
            self.async_saves is not None
        ):  # one save in flight at a time: keep_last counts complete ones
            self.async_saves.maybe_finalize_async_calls(blocking=True)
        path = save_training_checkpoint(
            self.run_dir,
            self.step,
            self.chunks,
            meta,
            self.optimizer,
            self._trainer_state(),
            self.cfg.train.keep_last,
            protect,
            rank_state=self.rollouts.state_dict() if self.rollouts else None,
            async_queue=self.async_saves,
        )
        if self.async_saves is not None:
            logger.info("checkpoint %s: written in the background", path.name)
        return path

    def _resume(self, path: Path) -> None:
        state = load_training_checkpoint(path, self.chunks, self.optimizer)
        self.step, self.updates = int(state["step"]), int(state["updates"])
        self.prompts.load_state_dict(state["data"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.table, self.table_updates = state["neighbor_table"], int(state["table_updates"])
        self.best = state.get("best")
        if state.get("rank_state") is not None:  # the one-step-off rollout in flight at the save
            in_flight = state["rank_state"]
            self.prompts.load_state_dict(in_flight["data_before"])
            if (
                self.rollouts is not None
            ):  # else (resumed synchronous) its prompts are generated again
                self.rollouts.load_state_dict(in_flight, self._draw_prompts()[0])
        self.metrics.truncate(self.step)
        logger.info("resumed from %s at step %d", path, self.step)

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
            while self.step < self.total_steps:
                metrics = self.train_step()
                self.step += 1
                validating = self.cfg.validation.every and (
                    self.step % self.cfg.validation.every == 0 or self.step == self.total_steps
                )
                if validating:
                    metrics.update(self.validate())
                # The row goes out before the checkpoint: a run killed after the save resumes past
                # this step and truncates the metrics file to it, so the row must already be there.
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    self.metrics.write(self.step, metrics)
                saved = bool(validating) and self._keep_if_best(metrics)
                if (
                    not saved
                    and cfg.save_every
                    and (self.step % cfg.save_every == 0 or self.step == self.total_steps)
                ):
                    self.save()
                bar.set_postfix(
                    reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics.get('kl', 0):.4f}"
                )
                bar.update()
                if (
                    self.async_saves is not None
                ):  # publish a background save once every writer is done
                    self.async_saves.maybe_finalize_async_calls(blocking=False)
            if self.async_saves is not None:
                self.async_saves.maybe_finalize_async_calls(blocking=True)
                self.async_saves.close()
        finally:
            bar.close()
            self.metrics.close()
            self.reward_fn.close()
            self.engine.close()

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        timer = PhaseTimer()
        out: dict[str, float] = {}
        generating = None  # the generating weights of a one-step-off batch
        if self.rollouts is None:
            mine, keys = self._draw_prompts()
            with timer("neighbor_table"):
                out["mixing/table_refreshed"] = float(self._refresh_table())
            with timer("rollout"):
                rollout = self._generate([ex.prompt_ids for ex in mine], keys=keys)
        else:
            mine, rollout, generating = self._one_step_off(timer, out)
        with timer("reward"):
            scored = self._score(mine, rollout)
        if cfg.train.dynamic_sampling.enabled:
            scored = self._refill(scored, keys, timer, out)
        mine, rollout, texts, rewards, scores = scored
        groups = group_ids(rollout.prompt_index)
        tb = TokenBatch.from_rollout(rollout, pad_id=self._pad_id(), device=self.device)
        hidden = self._dra_hidden(tb)
        extras = self._logprob_extras(tb, rollout, timer, out, hidden, generating)
        with timer("reward"):
            if cfg.grpo.dra.enabled:
                scores = self._dra(scores, groups, texts, hidden)
            advantages = compute_advantages(scores, groups, cfg.grpo.advantage, cfg.grpo.adv_eps)
            filtering = cfg.grpo.filter_zero_variance or cfg.train.dynamic_sampling.enabled
            active = (
                ~zero_variance_groups(scores, groups)
                if filtering
                else torch.ones(len(scores), dtype=torch.bool)
            )
        tb = tb.with_extras(
            advantages=advantages.to(self.device), active=active.to(self.device), **extras
        )
        if cfg.train.dump_generations:
            self._dump(rollout, texts, rewards, advantages)

        with timer("update"):
            out.update(self._update(tb))
        out.update(self._rollout_metrics(rollout, rewards, scores, active))
        out.update({f"weight_sync/{k}": float(v) for k, v in self.engine.last_sync.items()})
        out.update(dp_max(timer.report()))
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        return out

    # ---- rollout pieces ----------------------------------------------------------------------
    def _draw_prompts(self) -> tuple[list, list[int]]:
        """The next step's prompts of this DP rank and their global indices (the sequence keys)."""
        batch = next(self.prompts)
        per_rank = len(batch) // self.dp_size
        start = self.dp_rank * per_rank
        return batch[start : start + per_rank], list(range(start, start + per_rank))

    def _one_step_off(self, timer: PhaseTimer, out: dict):
        """train.async.max_staleness 1 (training/async_rollout.py): this step's rollouts, made
        with the last step's weights while it trained (or now, at the first step or after a
        drop), then the next step's launched with the current weights and table. Returns the
        prompts, the batch and its generating weights (None: the current ones)."""
        with timer("rollout_wait"):
            job = self.rollouts.take(self.step)
        with timer("neighbor_table"):
            out["mixing/table_refreshed"] = float(self._refresh_table())
        mine, keys = (job.examples, job.keys) if job is not None else self._draw_prompts()
        if job is None or job.rollout is None:
            with timer("rollout"):
                rollout, generating = (
                    self._generate([ex.prompt_ids for ex in mine], keys=keys),
                    None,
                )
        else:
            rollout, generating = job.rollout, job.snapshot
            rollout.validate(self.num_real_tokens)
        if self.step + 1 < self.total_steps:
            before = self.prompts.state_dict()
            ahead, ahead_keys = self._draw_prompts()
            self.rollouts.launch(
                self.step,
                self.chunks,
                self.table,
                [ex.prompt_ids for ex in ahead],
                self._sampling(self.step + 1),
                self._mixing(),
                examples=ahead,
                keys=ahead_keys,
                data_before=before,
            )
        out.update(self.rollouts.metrics(self.step, rollout.policy_version))
        return mine, rollout, generating

    def _score(self, mine: list, rollout) -> tuple:
        """(prompts, rollout, texts, rewards, scores [N] float64) of one generated batch."""
        texts = rollout.texts or [
            self.tokenizer.decode(r, skip_special_tokens=True) for r in rollout.response_ids
        ]
        rewards = self.reward_fn(
            texts,
            [mine[i].problem.answers for i in rollout.prompt_index],
            rollout.response_lengths,
            rollout.finish_reasons,
        )
        return mine, rollout, texts, rewards, torch.tensor(rewards.total, dtype=torch.float64)

    def _refill(self, first: tuple, keys: list[int], timer: PhaseTimer, out: dict) -> tuple:
        """Dynamic sampling (grpo/dynamic_sampling.py): more rounds of prompts until every DP rank
        holds its share of groups whose rewards differ, then this rank's share in draw order.
        Rounds after the first reuse the synced weights and table; their sequence keys are
        offset by ``round × prompts_per_step`` (distinct gates and sampling streams)."""
        ds, t = self.cfg.train.dynamic_sampling, self.cfg.train
        need = t.prompts_per_step // self.dp_size
        rounds = [first]
        informative = [self._informative(first)]
        while True:
            found = sum(map(sum, informative))
            fewest = -dp_max({"f": -float(found)})["f"]
            if fewest >= need or len(rounds) == ds.max_gen_batches:
                break
            mine, _ = self._draw_prompts()
            offset = len(rounds) * t.prompts_per_step
            with timer("rollout"):
                rollout = self._generate(
                    [ex.prompt_ids for ex in mine], keys=[k + offset for k in keys], sync=False
                )
            with timer("reward"):
                rounds.append(self._score(mine, rollout))
            informative.append(self._informative(rounds[-1]))
        out["dynamic_sampling/gen_batches"] = float(len(rounds))
        out["dynamic_sampling/partial"] = float(fewest < need)
        if fewest < need:
            if ds.on_exhausted == "error":
                raise DynamicSamplingExhausted(exhausted_message(int(fewest), need, len(rounds)))
            logger.warning(
                "step %d: partial batch, %d of %d groups per rank with differing rewards "
                "after %d rounds",
                self.step + 1,
                int(fewest),
                need,
                len(rounds),
            )
        picks = choose_groups(informative, need)
        parts = []
        for (mine, rollout, texts, rewards, _scores), chosen in zip(rounds, picks, strict=True):
            rows = [r for i in chosen for r, p in enumerate(rollout.prompt_index) if p == i]
            parts.append(
                (
                    [mine[i] for i in chosen],
                    rollout.select_prompts(chosen),
                    [texts[r] for r in rows],
                    [rewards.total[r] for r in rows],
                    [rewards.correct[r] for r in rows],
                    {k: [v[r] for r in rows] for k, v in rewards.terms.items()},
                )
            )
        terms = {k: [x for p in parts for x in p[5][k]] for k in rounds[0][3].terms}
        rewards = dataclasses.replace(
            rounds[0][3],
            total=[x for p in parts for x in p[3]],
            correct=[x for p in parts for x in p[4]],
            terms=terms,
        )
        return (
            [ex for p in parts for ex in p[0]],
            RolloutBatch.cat([p[1] for p in parts]),
            [x for p in parts for x in p[2]],
            rewards,
            torch.tensor(rewards.total, dtype=torch.float64),
        )

    @staticmethod
    def _informative(scored: tuple) -> list[bool]:
        """Per prompt of a scored round: its group's rewards differ."""
        mine, rollout, _, _, scores = scored
        uniform = zero_variance_groups(scores, group_ids(rollout.prompt_index))
        flags = [True] * len(mine)
        for r, i in enumerate(rollout.prompt_index):
            flags[i] = not bool(uniform[r])
        return flags

    def _refresh_table(self) -> bool:
        """(Re)compute the neighbour table when due; hand it to the engine. True if recomputed."""

        mixing = self.cfg.mixing
        if not (mixing.enabled and mixing.strategy == "neighbor"):
            return False
        if self._mixing().neighbor_lookup == "on_demand":  # the engine searches the rows it mixes
            self.table = None
            return False
        due = self.table is None or (
            mixing.refresh_every and self.updates - self.table_updates >= mixing.refresh_every
        )
        if due:
            self.table = neighbor_table_for_model(
                self.chunks, mixing, self.num_real_tokens, special_token_ids(self.tokenizer)
            ).cpu()
            self.table_updates = self.updates
        return bool(due)

    def _generate(self, prompts: list[list[int]], keys: list[int], sync: bool = True):
        """One rollout with the current weights; ``sync`` False: the engine has them already."""
        self.engine.wake_up()
        if sync:
            self.engine.sync_weights(self.chunks)
            if self.table is not None:
                self.engine.set_neighbor_table(self.table)
        rollout = self.engine.generate(
            prompts, self._sampling(self.step), mixing=self._mixing(), keys=keys
        )
        self.engine.sleep()
        rollout.policy_version = self.step
        rollout.validate(self.num_real_tokens)
        return rollout

    def _sampling(self, step: int):
        """Sampling settings of ``step``'s rollouts (seeded by (seed, step): a resumed run
        regenerates the same responses)."""
        return SamplingParams.from_config(
            self.cfg.rollout,
            self.tokenizer.eos_token_id,
            seed=(self.cfg.train.seed * 1_000_003 + step) % 2**31,
        )

    def _mixing(self):
        return active_mixing(self.cfg.mixing)

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id or 0)

    def _dra_hidden(self, tb: TokenBatch):
        """The DRA capture of the policy's pooled hidden states (grpo.dra.embedder = policy_hidden)."""

        d = self.cfg.grpo.dra
        if not (d.enabled and d.embedder == "policy_hidden"):
            return None
        return ResponseHiddenMeans(
            self.chunks, tb, self.settings.micro_batch_size, self.settings.max_tokens
        )

    @functools.cached_property
    def _dra_text_embedder(self):
        return text_embedder(self.cfg.grpo.dra)  # a local model loads once

    def _dra(self, scores, groups, texts, hidden) -> torch.Tensor:
        d = self.cfg.grpo.dra
        emb = hidden.means() if hidden is not None else self._dra_text_embedder(texts)
        return dra_rewards(scores, similarity(emb), groups if d.scope == "group" else None).double()

    def _logprob_extras(
        self,
        tb: TokenBatch,
        rollout,
        timer: PhaseTimer,
        out: dict,
        hidden=None,
        generating: WeightSnapshot | None = None,
    ) -> dict:
        """Old / reference log-probs, mismatch-correction weights and keep mask (grpo/mismatch.py),
        the rollout-vs-trainer mismatch metrics (label-aligned);
        ``hidden`` (DRA's ResponseHiddenMeans) captures the policy's hidden states in the replay;
        old log-probs under ``generating`` (a one-step-off batch's weights) when given."""
        g, s = self.cfg.grpo, self.settings
        engine_lp = tb.label_aligned(rollout.logprobs)
        extras = {}
        mask = tb.mask
        corr = g.correction
        with timer("old_logprobs"):
            if g.old_logprobs == "recompute":
                weights = (
                    generating.active(self.chunks)
                    if generating
                    else contextlib.nullcontext(self.chunks)
                )
                with hidden or contextlib.nullcontext(), weights as chunks:
                    old = batch_logprobs(
                        chunks,
                        tb,
                        s.temperature,
                        s.micro_batch_size,
                        s.vocab_limit,
                        s.max_tokens,
                        packing=s.packing,
                    )
                keep = None
                if corr.mode != "off":
                    extras["tis_weight"], keep = correction(old, engine_lp, mask, corr)
                    extras["keep"] = keep
                mixed = tb.mix.mask if tb.mix is not None else None
                out.update(
                    mismatch_metrics(dp_sums(mismatch_sums(old, engine_lp, mask, mixed, keep)))
                )
                gap = (old - engine_lp).abs() * mask
                out["logprob_gap/max_abs"] = dp_max(
                    {"m": float(gap.max()) if gap.numel() else 0.0}
                )["m"]
            else:
                old = engine_lp
        extras["old_logprobs"] = old
        if self.reference is not None:
            with timer("ref_logprobs"), self.reference.active(self.chunks) as ref_chunks:
                extras["ref_logprobs"] = batch_logprobs(
                    ref_chunks,
                    tb,
                    s.temperature,
                    s.micro_batch_size,
                    s.vocab_limit,
                    s.max_tokens,
                    packing=s.packing,
                )
        return extras

    # ---- the update --------------------------------------------------------------------------
    def _update(self, tb: TokenBatch) -> dict[str, float]:
        t = self.cfg.train
        rows_per_mini = t.mini_batch_prompts // self.dp_size * self.cfg.rollout.n
        totals: dict[str, float] = {}
        n = skipped = 0
        first = None
        for _ in range(t.epochs_per_rollout):
            for start in range(0, tb.num_rows, rows_per_mini):
                mini = tb.micro_batch(list(range(start, min(start + rows_per_mini, tb.num_rows))))
                stats = loss_and_grads(
                    self.chunks,
                    mini,
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

    # ---- metrics -----------------------------------------------------------------------------
    def _rollout_metrics(self, rollout, rewards, scores, active) -> dict[str, float]:
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
            "filtered": float((~active).sum()),
        }
        s = dp_sums(local)
        n = max(s["n"], 1.0)
        mean = s["r"] / n
        out = {
            "reward/mean": mean,
            "reward/std": max(s["r2"] / n - mean * mean, 0.0) ** 0.5,
            "reward/raw_mean": s["raw"] / n,
            "accuracy": s["correct"] / n,
            "response_length/mean": s["len"] / n,
            "response_length/truncated_frac": s["truncated"] / n,
            "mixing/mixed_token_frac": s["mixed"] / max(s["len"], 1.0),
            "filtered_frac": s["filtered"] / n,
        }
        out["response_length/max"] = dp_max({"m": float(lengths.max()) if len(lengths) else 0.0})[
            "m"
        ]
        return out

    def _dump(self, rollout, texts, rewards, advantages) -> None:
        if ps.get_tensor_model_parallel_rank() or not ps.is_pipeline_first_stage(
            ignore_virtual=True
        ):
            return
        path = self.run_dir / "generations" / f"step{self.step:07d}_dp{self.dp_rank:03d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for i, text in enumerate(texts):
                f.write(
                    json.dumps(
                        {
                            "prompt_index": rollout.prompt_index[i],
                            "text": text,
                            "reward": rewards.total[i],
                            "correct": rewards.correct[i],
                            "advantage": float(advantages[i]),
                            "finish": rollout.finish_reasons[i],
                            "mixes": rollout.mixes.select([i]).to_json(),
                        }
                    )
                    + "\n"
                )

    # ---- validation --------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """The validation benchmarks split over the data-parallel ranks; every rank returns the
        same metrics."""

        v = self.cfg.validation
        benchmarks = self.val_benchmarks
        if self.rollouts is not None:
            self.rollouts.settle()  # the engine is free: the in-flight batch is kept
        self.engine.wake_up()
        self.engine.sync_weights(self.chunks)
        out_dir = (
            self.run_dir / "validation" / f"step{self.step:07d}" if dist.get_rank() == 0 else None
        )
        grader = build_grader(self.cfg.reward)
        try:
            params = SamplingParams.from_config(v.sampling, self.tokenizer.eos_token_id)
            mixing = eval_mixing(
                self.cfg.mixing,
                self.engine,
                self.chunks,
                self.num_real_tokens,
                special_token_ids(self.tokenizer),
            )
            result = evaluate(
                self.engine,
                self.tokenizer,
                benchmarks,
                params,
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
