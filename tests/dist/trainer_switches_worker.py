"""Trainer runs that flip config switches and report what changed (tests/test_live_switches.py).

Each run builds configs/tiny_test.yaml + the arithmetic task (``NGRPO_TASK``: the folder of its
``paths.yaml`` overlay) with overrides and runs ``Trainer(cfg).setup(); .run()``, the trainer's
public surface (what ``python -m megatron_ngrpo.train`` runs), for one step unless overridden.
Many short runs share one 2-process launch; each case returns what rank 0 saw.

What a run reports (:func:`observed`), from its outputs and from test-side instruments (no
product hook):
- ``rows``: its metrics.jsonl; ``files``: the names in its run dir; ``generations``: the dumped
  generations; ``stderr``: what it wrote there (the progress bar);
- ``forwards``: every GPTModel forward: input rows and columns, whether it is the engine's
  generation (an ``inference_context``) or the trainer's (old / reference log-probs, updates)
  and builds a graph, the chunk's decoder layers, embedding rows, parameter dtype and model
  config flags, which model object;
- ``steps``: every torch optimizer step (megatron wraps torch's AdamW on CPU): the
  hyperparameters, the elements it updates and the norm of the (clipped) gradient it applies;
- ``calls``: each engine call's prompts, sampling settings and response lengths.
The mismatch runs also shift the built-in engine's log-probs (:func:`_shift`), a known
rollout/trainer gap. Runs with the same data settings share one tokenised training set
(:func:`train_set_memo`).

Run under torchrun with 2 processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.harness.multiproc import case, run_cases, shared_tmpdir

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_test.yaml"
STATE: dict = {}
TRAIN_SETS: dict = {}  # (data settings, tokenizer) → the training prompts (train_set_memo)


def tmp() -> Path:
    if "tmp" not in STATE:
        STATE["tmp"] = Path(shared_tmpdir("switches_"))
    return STATE["tmp"]


def config(run_dir: Path, *overrides: str):
    from megatron_ngrpo.training.job_config import load_config

    task = Path(os.environ["NGRPO_TASK"])
    return load_config(
        [TINY, task / "paths.yaml"],
        [f"train.run_dir={run_dir}", "train.max_steps=1", "train.save_every=0", *overrides],
    )


def observed(name: str, *overrides: str, shift: bool = False, run: str | None = None) -> dict:
    """A trainer run in ``tmp()/(run or name)`` with ``overrides``, under the instruments
    (``shift``: the engine's log-probs shifted); what rank 0 saw."""
    from megatron_ngrpo.training.trainer import Trainer

    run_dir = tmp() / (run or name)
    cfg = config(run_dir, *overrides)
    seen = {"forwards": [], "steps": [], "calls": [], "shifted": {"up": 0, "down": 0, "same": 0}}
    err = io.StringIO()
    with (
        model_forwards(seen["forwards"]),
        optimizer_steps(seen["steps"]),
        engine_calls(seen["calls"], seen["shifted"] if shift else None),
        train_set_memo(),
        contextlib.redirect_stderr(err),
    ):
        trainer = Trainer(cfg)
        trainer.setup()
        trainer.run()
    dist.barrier()
    dumped = sorted((run_dir / "generations").glob("*.jsonl"))
    return {
        **seen,
        "shifted": _global_counts(seen["shifted"]),
        "rows": [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()],
        "files": sorted(p.name for p in run_dir.iterdir()),
        "generations": {
            f.name: [json.loads(x) for x in f.read_text().splitlines()] for f in dumped
        },
        "stderr": err.getvalue(),
    }


# ---- instruments -------------------------------------------------------------------------------
def _shift(r: int, t: int) -> float:
    """The log-prob shift of response ``r``'s token ``t``: ρ = π_old/π_rollout ≈ e, 1/e or 1."""
    return (-1.0, 1.0, 0.0)[(r + t) % 3]


@contextlib.contextmanager
def engine_calls(calls: list, shifted: dict | None):
    """The built-in engine's calls appended to ``calls``: the prompts, the sampling settings and
    per response (prompt length, response length, finish reason), the largest token id sampled or
    mixed, the mixed positions and those whose anchor is a special id; with ``shifted``, the returned
    log-probs moved by :func:`_shift` and the tokens of each shift counted there."""
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine

    original = MegatronEngine.generate

    def generate(self, call_prompts, params, *args, **kwargs):
        batch = original(self, call_prompts, params, *args, **kwargs)
        calls.append(
            {
                "prompts": [list(p) for p in call_prompts],
                "params": dataclasses.asdict(params),
                "responses": [
                    (len(p), len(r), f)
                    for p, r, f in zip(batch.prompt_ids, batch.response_ids, batch.finish_reasons)
                ],
                "largest_id": max(
                    [t for r in batch.response_ids for t in r] + batch.mixes.ids.flatten().tolist()
                ),
                "mixed": len(batch.mixes),
                "special_anchors_mixed": sum(
                    a in self.special_ids for a in batch.mixes.ids[:, 0].tolist()
                ),
            }
        )
        for r, lps in enumerate(batch.logprobs if shifted is not None else []):
            for t in range(len(lps)):
                lps[t] += _shift(r, t)
                shifted[{-1.0: "up", 1.0: "down", 0.0: "same"}[_shift(r, t)]] += 1
        return batch

    MegatronEngine.generate = generate
    try:
        yield
    finally:
        MegatronEngine.generate = original


@contextlib.contextmanager
def model_forwards(seen: list):
    from megatron.core.models.gpt import GPTModel

    original = GPTModel.forward
    ids: dict[int, int] = {}  # model object → its number in order of first use

    def forward(self, *args, **kwargs):
        tokens = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        emb = getattr(self, "embedding", None)
        seen.append(
            {
                "rows": tokens.shape[0],
                "columns": tokens.shape[1],
                "generation": kwargs.get("inference_context") is not None,
                "graph": torch.is_grad_enabled(),
                "layers": len(self.decoder.layers),
                "embedding_rows": emb.word_embeddings.weight.shape[0] if emb is not None else None,
                "model": ids.setdefault(id(self), len(ids)),
                "sequence_parallel": self.config.sequence_parallel,
                "recompute": self.config.recompute_granularity,
                "dtype": str(next(self.parameters()).dtype),
            }
        )
        return original(self, *args, **kwargs)

    GPTModel.forward = forward
    try:
        yield
    finally:
        GPTModel.forward = original


# More optimizer steps than any case here takes: a run past it ignored its step limit
# (train.max_steps, train.num_epochs), and fails here instead of training on for an hour.
MAX_UPDATES = 64


@contextlib.contextmanager
def optimizer_steps(seen: list):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def hook(opt, args, kwargs):
        if len(seen) >= MAX_UPDATES:
            raise RuntimeError(
                f"more than {MAX_UPDATES} optimizer steps: the step limit is ignored"
            )
        params = [p for g in opt.param_groups for p in g["params"]]
        grads = [p.grad.double().pow(2).sum() for p in params if p.grad is not None]
        seen.append(
            {
                "lr": sorted({g["lr"] for g in opt.param_groups}),
                "betas": sorted({tuple(g["betas"]) for g in opt.param_groups}),
                "eps": sorted({g["eps"] for g in opt.param_groups}),
                "weight_decay": sorted({g["weight_decay"] for g in opt.param_groups}),
                "numel": sum(p.numel() for p in params),
                "grad_norm": float(torch.stack(grads).sum().sqrt()) if grads else 0.0,
            }
        )

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def train_set_memo():
    """The trainer's ``load_train_set`` run once per data settings and tokenizer in this process:
    reading and tokenising the task's 17,904 prompts, ~1 s of CPU per run and rank, was repeated
    unchanged by the ~38 runs (test time, not coverage: a run with other ``data.*`` settings loads
    its own)."""
    from megatron_ngrpo.training import trainer

    original = trainer.load_train_set

    def load_train_set(cfg, tokenizer):
        key = (repr(cfg), tokenizer.name_or_path)
        if key not in TRAIN_SETS:
            TRAIN_SETS[key] = original(cfg, tokenizer)
        return list(TRAIN_SETS[key])  # a run's own list of the (frozen) examples

    trainer.load_train_set = load_train_set
    try:
        yield
    finally:
        trainer.load_train_set = original


def _global_counts(counts: dict) -> dict:
    t = torch.tensor([float(counts[k]) for k in ("up", "down", "same")], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(("up", "down", "same"), t.tolist()))


def small_file(n: int) -> Path:
    """The task's first ``n`` training problems as a file of their own."""
    path = tmp() / f"train{n}.jsonl"
    if dist.get_rank() == 0 and not path.exists():
        source = Path(os.environ["NGRPO_TASK"]) / "train.jsonl"
        path.write_text("".join(source.read_text().splitlines(True)[:n]))
    dist.barrier()
    return path


def baseline() -> dict:
    """configs/tiny_test.yaml's first step, unchanged."""
    if "baseline" not in STATE:
        STATE["baseline"] = observed("baseline")
    return STATE["baseline"]


# ---- cases -------------------------------------------------------------------------------------
@case
def mismatch_corrections():
    """One step per correction setting, all on the same shifted rollouts."""
    runs = {
        "off": (),
        "icepop": ("grpo.mismatch.mode=icepop",),
        "icepop_lower": ("grpo.mismatch.mode=icepop", "grpo.mismatch.lower=0.3"),
        "icepop_clamp": ("grpo.mismatch.mode=icepop", "grpo.mismatch.log_ratio_clamp=0.5"),
        "token_mask_upper": ("grpo.mismatch.mode=token-mask", "grpo.mismatch.upper=3"),
        "token_tis": ("grpo.mismatch.mode=token-tis",),
        "token_tis_cap3": ("grpo.mismatch.mode=token-tis", "grpo.mismatch.cap=3"),
        "tis_cap": ("grpo.tis_cap=2",),
        "engine_old": ("grpo.old_logprobs=rollout",),
    }
    return {name: observed(f"mismatch_{name}", *o, shift=True) for name, o in runs.items()}


@case
def micro_batches():
    """The baseline step, packed (one row per micro-batch) and with a token budget."""
    return {
        "unpacked": baseline(),
        "packed": observed("packed", "train.pack_sequences=true"),
        "budget": observed("budget", "train.max_tokens_per_micro_batch=40"),
    }


@case
def batch_arithmetic():
    """Batch arithmetic, sampling, the engine's own weight copy and batch size, the model's
    sequence limit, the prompt filter and the dump of generations flipped together: each changes
    a different count or setting of what the engine and the updates get."""
    return observed(
        "batches",
        "train.prompts_per_step=8",
        "train.mini_batch_prompts=4",
        "train.epochs_per_rollout=3",
        "train.micro_batch_size=4",
        "rollout.n=2",
        "rollout.max_new_tokens=5",
        "rollout.temperature=0.7",
        "rollout.top_p=0.9",
        "rollout.top_k=20",
        "rollout.stop=[QQ]",
        "rollout.separate_copy=true",
        "rollout.max_batch_size=3",
        "model.max_seq_len=19",
        "model.num_real_tokens=30",  # of 31
        "data.max_prompt_tokens=18",
        "train.dump_generations=true",
    )


@case
def optimizer_settings():
    """The optimizer's hyperparameters, clipping and the distributed optimizer; the learning-rate
    schedule over three steps (warm-up, then linear decay towards min_lr)."""
    return {
        "baseline": baseline(),
        "optimizer": observed(
            "optimizer",
            "optim.weight_decay=0.05",
            "optim.adam_beta1=0.8",
            "optim.adam_beta2=0.99",
            "optim.adam_eps=1e-6",
            "optim.clip_grad=0.01",
            "optim.distributed_optimizer=true",
        ),
        "schedule": observed(
            "schedule",
            "train.max_steps=3",
            "optim.lr=2e-3",
            "optim.warmup_steps=2",
            "optim.lr_schedule=linear",
            "optim.min_lr=1e-4",
        ),
    }


@case
def model_layouts():
    """The step at TP 2 with sequence parallelism and at PP 2 with recomputation in bf16 (the
    two ranks as one model-parallel group)."""
    return {
        "baseline": baseline(),
        "tp2": observed("tp2", "model.tensor_parallel=2", "model.sequence_parallel=true"),
        "pp2": observed(
            "pp2", "model.pipeline_parallel=2", "model.recompute=true", "model.dtype=bfloat16"
        ),
    }


@case
def objective():
    """Advantages, KL and filtering: each run's dumped rewards and advantages and its metrics.
    ``eps_seed`` also draws other rollouts (train.seed), compared with the baseline's."""
    dump = "train.dump_generations=true"
    return {
        "baseline": baseline(),
        "eps_seed": observed("eps_seed", dump, "grpo.adv_eps=1.0", "train.seed=7"),
        "drgrpo_klmetric": observed(
            "drgrpo_klmetric", dump, "grpo.advantage=dr_grpo", "grpo.kl_mode=metric"
        ),
        "filter_kloff": observed(
            "filter_kloff",
            "grpo.filter_zero_variance=true",
            "grpo.kl_mode='off'",  # quoted: YAML reads a bare off as false
            "reward.overlong=none",  # a random model is never right: every group is uniform
        ),
    }


@case
def embedding_gradient_and_table_refresh():
    """Two steps without the gradient into embedding rows through mixed inputs and with the
    neighbour table computed only at the start."""
    return {
        "baseline": baseline(),
        "mixing": observed(
            "mixing",
            "train.max_steps=2",
            "mixing.embedding_grad=false",
            "mixing.refresh_every=0",
        ),
    }


@case
def mixing_defaults():
    """Two steps at MixingConfig's defaults of the fields configs/tiny_test.yaml overrides
    (``refresh_every``, ``skip_special_anchors``; ``neighbor_lookup`` is ``auto`` there too), the
    vocabulary padded to 1024 rows, where ``auto``'s cost rule picks on-demand rows; and the same
    run mixing special anchors (tiny_test's setting), where the policy mixes some."""
    from megatron_ngrpo.mixing.config import MixingConfig

    d = MixingConfig()
    defaults = (
        "train.max_steps=2",
        "model.make_vocab_size_divisible_by=1024",
        f"mixing.neighbor_lookup={d.neighbor_lookup}",
        f"mixing.refresh_every={d.refresh_every}",
        f"mixing.skip_special_anchors={str(d.skip_special_anchors).lower()}",
    )
    return {
        "defaults": observed("mixing_defaults", *defaults),
        "special": observed(
            "mixing_special", *defaults, f"mixing.skip_special_anchors={not d.skip_special_anchors}"
        ),
    }


@case
def dra():
    """DRA through the trainer: text (TF-IDF) similarities within groups and, with other n-grams
    and hash width, over the batch; the policy's pooled hidden states."""
    on = ("train.dump_generations=true", "grpo.dra.enabled=true")
    return {
        "group": observed("dra_group", *on),
        "batch": observed(
            "dra_batch", *on, "grpo.dra.scope=batch", "grpo.dra.ngram=1", "grpo.dra.hash_dim=64"
        ),
        "hidden": observed("dra_hidden", *on, "grpo.dra.embedder=policy_hidden"),
    }


@case
def outputs_and_starts():
    """A step with the reference as a second model, TensorBoard, the progress bar and a
    checkpoint; the same run dir started again without resuming; a run starting from that
    checkpoint."""
    first = observed(
        "outputs",
        "train.reference=copy",
        "train.tensorboard=true",
        "train.progress=true",
        "train.save_every=1",
    )
    return {
        "baseline": baseline(),
        "outputs": first,
        "fresh": observed("fresh", "train.resume=false", run="outputs"),
        "loaded": observed("loaded", f"train.load={tmp() / 'outputs'}"),
    }


@case
def validation_and_evaluation():
    """In-training validation on a file of 8 problems (its settings all flipped), with and
    without keeping the best checkpoint; then the evaluation CLI on the checkpoint of
    ``outputs_and_starts`` with extra benchmark files."""
    from megatron_ngrpo.eval.__main__ import main as eval_main

    bench = small_file(8)
    settings = (
        "validation.every=1",
        f"validation.benchmarks=[{bench}]",
        "validation.limit=3",
        "validation.sampling.n=2",
        "validation.sampling.temperature=0.5",
        "validation.sampling.top_p=0.8",
        "validation.sampling.top_k=7",
        "validation.sampling.max_new_tokens=3",
        "validation.sampling.seed=11",
        "validation.max_tokens_per_call=1",
    )
    out = {
        "validation": observed("validation", *settings),
        # also another KL coefficient: the step is the baseline's but for the KL term's weight
        "no_best": observed("no_best", *settings, "validation.keep_best=false", "grpo.kl_coef=0.5"),
    }
    task, eval_dir = Path(os.environ["NGRPO_TASK"]), tmp() / "eval"
    calls: list = []
    with engine_calls(calls, None):
        status = eval_main(
            [
                f"model.hf_path={task / 'model'}",
                "model.make_vocab_size_divisible_by=8",
                f"tokenizer={task / 'tokenizer'}",
                f"checkpoint={tmp() / 'outputs'}",
                "benchmarks=[]",
                f"extra_benchmarks=[{{path: {bench}, kind: math}}]",
                "limit=3",
                "sampling.n=2",
                "sampling.max_new_tokens=3",
                "template.kind=plain",
                "template.instruction=''",
                "ks=[1,2]",
                "max_tokens_per_call=1",
                f"output_dir={eval_dir}",
            ]
        )
    dist.barrier()
    out["eval"] = {
        "status": status,
        "calls": calls,
        "files": sorted(str(p.relative_to(eval_dir)) for p in eval_dir.rglob("*") if p.is_file()),
        "results": json.loads((eval_dir / "results.json").read_text()),
    }
    return out


@case
def warm_start():
    """Two supervised steps of 8 worked solutions at lr 1e-2 before RL; the warm-start
    checkpoint's losses."""
    task = Path(os.environ["NGRPO_TASK"])
    run = observed(
        "warmstart",
        f"train.warmstart.path={task / 'sft.jsonl'}",
        "train.warmstart.steps=2",
        "train.warmstart.batch_size=8",
        "train.warmstart.lr=1e-2",
    )
    meta = json.loads((tmp() / "warmstart" / "warmstart" / "megatron_ngrpo.json").read_text())
    return {**run, "warmstart_nll": meta["warmstart_nll"]}


@case
def stale_rollouts():
    """train.async.on_stale as the trainer's producer gets it (build_rollouts): a rollout two
    versions old is dropped or refused."""
    from megatron_ngrpo.data.tokenizer import load_tokenizer
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from megatron_ngrpo.training.async_rollout import InFlight, StaleRolloutError, build_rollouts

    out = {}
    for on_stale in ("drop", "error"):
        cfg = config(
            tmp() / "stale", "train.async.max_staleness=1", f"train.async.on_stale={on_stale}"
        )
        initialize_model_parallel(1, 1, seed=1)
        engine, producer = build_rollouts(
            cfg, build_model(cfg.model), load_tokenizer(cfg.tokenizer, cfg.model.hf_path), 1
        )
        producer._job = InFlight(
            version=3, examples=["p"], keys=[7], data_before={}, snapshot=None, rollout=object()
        )
        try:
            out[on_stale] = "dropped" if producer.take(5).rollout is None else "kept"
        except StaleRolloutError as e:
            out[on_stale] = str(e)
        engine.close()
    return out


@case
def prompt_order_and_epochs():
    """A 4-problem file for 2 epochs (max_steps 0) logging every 2nd step; an 8-problem file in
    file order and shuffled with another data seed, with the orders the product's own batcher
    gives for comparison."""
    from megatron_ngrpo.data.batches import PromptBatches
    from megatron_ngrpo.data.datasets import load_train_set
    from megatron_ngrpo.data.tokenizer import load_tokenizer

    small = lambda n: f"data.train=[{{path: {small_file(n)}}}]"  # noqa: E731
    out = {
        "epochs": observed(
            "epochs", small(4), "train.max_steps=0", "train.num_epochs=2", "train.log_every=2"
        ),
        "ordered": observed("ordered", small(8), "data.shuffle=false"),
        "reseeded": observed("reseeded", small(8), "data.seed=7"),
    }
    cfg = config(tmp() / "ordered", small(8))
    examples = load_train_set(cfg.data, load_tokenizer(cfg.tokenizer, cfg.model.hf_path))
    out["first_batch"] = {
        name: [ex.prompt_ids for ex in next(PromptBatches(examples, 4, seed=seed, shuffle=shuffle))]
        for name, seed, shuffle in (
            ("file", 0, False),
            ("seed7", 7, True),
            ("seed1234", 1234, True),
        )
    }
    return out


if __name__ == "__main__":
    run_cases()
