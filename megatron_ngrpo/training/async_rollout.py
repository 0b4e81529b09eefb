"""One-step-off-policy rollouts (``train.async.max_staleness: 1``): while the trainer updates on
step n's rollouts, the engine generates step n+1's with the weights of step n.

::

    trainer  | take(n) | table, launch(n+1) | old/ref log-probs, update W_n -> W_{n+1} | take(n+1) ...
    engine   |         | generate step n+1 with W_n (second thread) ......|  idle    |

* The engine is either the built-in Megatron engine on a separate copy of the weights whose
  layers and collectives use duplicates of megatron's model-parallel groups
  (:func:`~megatron_ngrpo.parallel.duplicate_model_parallel_groups`): its TP/PP collectives on
  the second thread never pair with the trainer's. torch ops release the GIL, so the two threads
  compute at once; the engine's per-token Python between ops does not.
* Or the client of rollout servers on other nodes (``rollout.engine: remote``, vLLM with the
  mixing hook): the natural home of one-step-off, as generation runs on devices of its own. The
  weights of step n are pushed at launch, on the trainer's thread, while the servers are idle
  (no request is in flight during a sync); the second thread waits on HTTP, and the client's
  collectives use a gloo group of its own.
* Colocated vLLM (``rollout.engine: vllm``) is refused: its workers adopt the trainer's process
  groups and devices (``external_launcher``), so generating on a second thread would interleave
  its collectives with training's on the same groups; the peers' one-step-off (verl) likewise
  puts generation on devices of its own.
* Every :class:`~megatron_ngrpo.rollout.types.RolloutBatch` carries ``policy_version``, the step
  whose weights generated it; :func:`check_staleness` refuses (one line) or drops older ones.
* Old log-probs (``grpo.old_logprobs: recompute``) are the trainer's replay under the weights
  that generated the batch: a CPU :class:`~megatron_ngrpo.training.snapshot.WeightSnapshot`
  taken at launch and swapped in for that pass. The ratio π_θ/π_old then carries the version
  gap through the usual clipping (and TIS, if on). The neighbour table shipped with a launch is
  the trainer's table of that weight version; the records replay exactly whichever table made
  them.
* Checkpoints: :meth:`RolloutProducer.state_dict` waits for the in-flight batch and returns it
  with its weight snapshot and the prompt position before its prompts, as this rank's object; a
  resumed run starts from it, so kill + resume reproduces the uninterrupted run.
* Metrics (per step): ``async/staleness``, ``async/training_waits_generation_s`` (the trainer
  blocked on the engine), ``async/generation_waits_training_s`` (the engine idle between its
  batch and the next launch), ``async/generation_s``, ``async/dropped``.

Costs: one more copy of the weights on the device (the engine's) plus, with recomputed old
log-probs, one device-to-host copy of this rank's weights per step, held in host memory and
written into every checkpoint with the in-flight batch (``grpo.old_logprobs: rollout`` needs
neither).

On GPU the two threads share one device (the producer on a CUDA stream of its own): the speedup
is bounded by the generation/training split. No GPU run has been made: that path, and
megatron's CUDA RNG tracker forks on the producer thread (only the CPU shim's are kept off the
process-wide generator), are not measured. On the 2-core CPU machine each rank's two threads share its core with the
other rank, so little overlap is possible there (bench/bench_async.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass, field

import torch

from megatron_ngrpo.compat.cpu import background_thread
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.rollout.factory import build_engine
from megatron_ngrpo.rollout.types import RolloutBatch, RolloutEngine
from megatron_ngrpo.training.neighbor_source import NeighborSource
from megatron_ngrpo.training.snapshot import WeightSnapshot


class StaleRolloutError(RuntimeError):
    """A rollout older than ``train.async.max_staleness`` with ``on_stale: error``."""


def check_staleness(step: int, version: int, max_staleness: int, on_stale: str) -> bool:
    """True when step ``step`` may train on a rollout of policy ``version``; False when it is
    too old and ``on_stale`` is "drop"; :class:`StaleRolloutError` (one line) for "error"."""
    if step - version <= max_staleness:
        return True
    if on_stale == "drop":
        return False
    raise StaleRolloutError(
        f"rollout of policy version {version} at step {step}: staleness "
        f"{step - version} > train.async.max_staleness = {max_staleness}"
    )


@dataclass
class InFlight:
    """One step's rollouts, generated (or being generated) by the producer.

    ``examples``/``keys``: the step's prompts on this rank (the trainer's objects) and their
    global indices; ``data_before``: the prompt iterator's position before they were drawn;
    ``snapshot``: the generating weights (None when old log-probs are the engine's); ``rollout``
    None while generating or after a drop."""

    version: int
    examples: list
    keys: list[int]
    data_before: dict
    snapshot: WeightSnapshot | None
    rollout: RolloutBatch | None = None
    seconds: float = 0.0
    finished_at: float | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = field(default=None, repr=False)


class RolloutProducer:
    """Owns the engine's weight copy and the in-flight generation (at most one batch ahead).

    Args:
        engine: a :class:`~megatron_ngrpo.rollout.megatron_engine.MegatronEngine` on a separate
            copy with process groups of its own (:func:`build_rollouts`).
        max_staleness, on_stale: ``train.async``.
        keep_weights: snapshot the generating weights at each launch (old log-probs recomputed).
    """

    def __init__(
        self, engine: RolloutEngine, max_staleness: int, on_stale: str, keep_weights: bool
    ):
        self.engine = engine
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self.keep_weights = keep_weights
        self._job: InFlight | None = None
        self._idle_since: float | None = None
        self._stats = _zero_stats()

    def launch(
        self,
        version: int,
        chunks: list,
        neighbors: NeighborSource,
        prompts: list[list[int]],
        params,
        examples: list,
        keys: list[int],
        data_before: dict,
    ) -> None:
        """Load ``chunks``' weights (policy ``version``) and their neighbour source into the
        engine, then generate ``prompts`` on the second thread. Collective (every rank, same
        point)."""
        if self._job is not None:
            raise RuntimeError("a rollout is already in flight: take() it first")
        now = time.perf_counter()
        if self._idle_since is not None:
            self._stats["generation_waits_training_s"] += now - self._idle_since
        self.engine.wake_up()
        self.engine.sync_weights(chunks)
        neighbors.apply(self.engine)
        mixing = neighbors.mixing
        job = InFlight(
            version,
            examples,
            keys,
            data_before,
            WeightSnapshot(chunks) if self.keep_weights else None,
        )
        stream = None
        if torch.cuda.is_available():
            # NCCL collectives of two communicators queued on one stream in different orders
            # on two ranks would deadlock: the producer gets its own stream, after the copy.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
        job.thread = threading.Thread(
            target=self._generate,
            args=(job, prompts, params, mixing, stream),
            name="rollout-producer",
            daemon=True,
        )
        self._job = job
        job.thread.start()

    def _generate(self, job: InFlight, prompts, params, mixing, stream) -> None:
        start = time.perf_counter()
        try:
            with (
                background_thread(),
                torch.cuda.stream(stream) if stream else contextlib.nullcontext(),
            ):
                job.rollout = self.engine.generate(prompts, params, mixing=mixing, keys=job.keys)
            job.rollout.policy_version = job.version
        except BaseException as e:  # re-raised on the trainer's thread by take()
            job.error = e
        job.finished_at = time.perf_counter()
        job.seconds = job.finished_at - start

    def settle(self) -> None:
        """Wait for the in-flight generation (kept for :meth:`take`); the engine is free after."""
        job = self._job
        if job is None or job.thread is None:
            return
        start = time.perf_counter()
        job.thread.join()
        job.thread = None
        self._stats["training_waits_generation_s"] += time.perf_counter() - start
        self._stats["generation_s"] += job.seconds
        self._idle_since = job.finished_at
        if job.error is not None:
            raise RuntimeError(
                f"rollout of policy version {job.version} failed: "
                f"{type(job.error).__name__}: {job.error}"
            ) from job.error

    def take(self, step: int) -> InFlight | None:
        """Step ``step``'s rollouts: None when nothing is in flight (the first step); a job with
        ``rollout`` None when it was too old and dropped (``on_stale: drop``; regenerate its
        prompts); raises :class:`StaleRolloutError` with ``on_stale: error``."""
        self.settle()
        job, self._job = self._job, None
        if job is not None and not check_staleness(
            step, job.version, self.max_staleness, self.on_stale
        ):
            self._stats["dropped"] += 1
            job.rollout = job.snapshot = None
        return job

    def metrics(self, step: int, version: int) -> dict[str, float]:
        """This step's ``async/*`` figures (the waits since the last call)."""
        out = {f"async/{k}": float(v) for k, v in self._stats.items()}
        out["async/staleness"] = float(step - version)
        self._stats = _zero_stats()
        return out

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict | None:
        """This rank's in-flight rollout (waited for), or None: its policy version, prompt
        position before its prompts, the batch and the generating weights."""
        if self._job is None:
            return None
        self.settle()
        job = self._job
        return {
            "version": job.version,
            "keys": job.keys,
            "data_before": job.data_before,
            "rollout": dataclasses.asdict(job.rollout),
            "weights": job.snapshot.saved if job.snapshot is not None else None,
        }

    def load_state_dict(self, state: dict, examples: list) -> None:
        """Make ``state`` (from :meth:`state_dict`) the in-flight rollout; ``examples``: its
        prompts, drawn again from ``state["data_before"]`` by the trainer."""
        saved = dict(state["rollout"])
        saved["mixes"] = MixRecord(**saved["mixes"])
        weights = state["weights"]
        self._job = InFlight(
            int(state["version"]),
            examples,
            list(state["keys"]),
            state["data_before"],
            WeightSnapshot(saved=weights) if weights is not None else None,
            rollout=RolloutBatch(**saved),
        )

    def close(self) -> None:
        self.engine.close()


def _zero_stats() -> dict[str, float]:
    return {
        "training_waits_generation_s": 0.0,
        "generation_waits_training_s": 0.0,
        "generation_s": 0.0,
        "dropped": 0.0,
    }


def build_rollouts(
    cfg, chunks: list, tokenizer, seed: int
) -> tuple[RolloutEngine, RolloutProducer | None]:
    """The trainer's engine and, for ``train.async.max_staleness`` > 0, the producer that owns
    it: a built-in engine on a separate weight copy with duplicated model-parallel groups, or
    the client of the rollout servers (collective). Synchronous training gets
    ``rollout.factory.build_engine``'s engine."""
    a = cfg.train.async_
    engine = build_engine(
        cfg, chunks, tokenizer=tokenizer, seed=seed, beside_trainer=bool(a.max_staleness)
    )
    if not a.max_staleness:
        return engine, None
    producer = RolloutProducer(
        engine, a.max_staleness, a.on_stale, keep_weights=cfg.grpo.old_logprobs == "recompute"
    )
    return engine, producer
