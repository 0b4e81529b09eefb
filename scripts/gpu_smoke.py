"""One prepared GPU check (issue #29 item 14), run by ``scripts/gpu_smoke.sh`` the day a GPU is lent.

Stages, each in its own process so that one failing (a missing package, a CUDA error, a hang)
becomes a FAIL row and the next stage still runs:

* ``env``: Python, torch / CUDA / GPU, and which of megatron-core, transformers, Transformer Engine,
  vLLM, omegaconf, math-verify import (with versions). Transformer Engine and vLLM are what this
  check exists for: either one missing is a FAIL unless ``--allow-missing te,vllm`` names it
  (then its stages run without it and their rows say so);
* ``task``: examples/arithmetic's task (character tokenizer, problems) with a tiny Qwen2 written by
  :func:`tests.harness.tiny.write_tiny_hf` (random weights, safetensors);
* ``preflight``: ``python -m megatron_ngrpo.launch.preflight`` on the GRPO stage's config, as every
  rendered job script runs it before torchrun;
* ``grpo``: 2 GRPO steps of ``configs/tiny_test.yaml`` with neighbour mixing on the built-in Megatron
  engine, bf16, the TE layer spec when TE imports (else the local spec; the row says which), one
  checkpoint save; the ``memory`` row checks the memory plan's layout-dependent terms of that
  layout (activations, logits, KV) on their own, within :data:`MEMORY_BOUNDS` (:class:`StepWindows`);
* ``vllm``: the same 2 steps with colocated vLLM TP 1 in sleep mode (a FAIL where vLLM does not
  import, a SKIP where ``--allow-missing vllm`` says so);
* ``refused``: routes that cannot work are refused by config validation, one row each.

Prints one summary table (also ``WORK/summary.txt``, ``WORK/summary.json``; each stage's log is
``WORK/<stage>.log``) and a last line counting the rows passed and skipped; exit status 1 if any
row failed. ``--skip env`` / ``--skip vllm`` leave TE / vLLM unchecked: a FAIL row unless
``--allow-missing`` names it. ``--cpu``: float32, gloo, local spec, vLLM
without sleep mode, so the script itself is tested on a machine without GPU (tests/test_gpu_smoke.py).

    bash scripts/gpu_smoke.sh [--cpu] [--allow-missing te,vllm] [--skip STAGE ...] [--work DIR]

The same rule holds with ``--cpu``, where TE never imports: its runs name ``--allow-missing te``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("env", "task", "preflight", "grpo", "vllm", "refused")
TIMEOUT_S = {"env": 120, "task": 120, "preflight": 120, "grpo": 240, "vllm": 300, "refused": 120}
RESULT = "SMOKE_RESULT "
# Import name -> distribution name, in the env row's order.
PACKAGES = {
    "megatron.core": "megatron-core",
    "transformers": "transformers",
    "transformer_engine.pytorch": "transformer-engine",
    "vllm": None,
    "omegaconf": "omegaconf",
    "math_verify": "math-verify",
}
# The task's tokenizer allows 64 positions. On GPU ~122 M parameters, so that weights, fp32 grads
# and Adam (~2.2 GB) dominate the peak the memory row compares with the plan; on CPU a tiny one.
TASK_MODEL = {
    "gpu": dict(
        hidden_size=1024,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=4096,
        max_pos=64,
    ),
    "cpu": dict(
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        max_pos=64,
    ),
}
STEPS = 2
# The memory row checks the plan's layout-dependent terms on their own (activations, one layer's
# backward, logits, KV cache: 1.4 % of the plan at the GPU shape, so a check of the sum could not
# see them): measured = the peak allocated between optimizer steps, after the first, less what is
# allocated right after the first step (weights, grads, optimizer state: static from there on).
# PASS within these ratios of the plan's terms. Not yet run on a GPU: the bounds are the plan's
# stated accuracy, to be narrowed once a run shows where it lands.
MEMORY_BOUNDS = (0.5, 2.0)
# What --allow-missing may name: the packages this check exists for (import name).
OPTIONAL = {"te": "transformer_engine.pytorch", "vllm": "vllm"}
# A stage skipped with --skip leaves a package unchecked: that needs --allow-missing for it.
SKIP_NEEDS = {"env": "te", "vllm": "vllm"}


# ---- stages (each runs in its own process: ``--stage NAME``) ------------------------------------
def _version(module: str) -> str:
    """The module's distribution version, or ``absent (<why>)``."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a package that breaks on import (TE without its libs)
        return f"absent ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    dist = PACKAGES.get(module) or module.split(".")[0]
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules[module.split(".")[0]], "__version__", "?")


def stage_env(args) -> list[dict]:
    import torch

    cuda = torch.cuda.is_available()
    gpus = (
        f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
        if cuda
        else "no GPU"
    )
    versions = {m: _version(m) for m in PACKAGES}
    detail = f"Python {sys.version.split()[0]}, torch {torch.__version__} ({gpus}); " + ", ".join(
        f"{PACKAGES[m] or m} {v}" for m, v in versions.items()
    )
    required = ("megatron.core", "transformers", "omegaconf")
    missing = [m for m in required if versions[m].startswith("absent")]
    missing += [
        f"{OPTIONAL[name]} (allow with --allow-missing {name})"
        for name in missing_unallowed(args, versions)
    ]
    ok = not missing and (cuda or args.cpu)
    why = "" if ok else (f"missing {', '.join(missing)}; " if missing else "no GPU visible; ")
    return [{"stage": "env", "status": "PASS" if ok else "FAIL", "detail": why + detail}]


def missing_unallowed(args, versions: dict[str, str]) -> list[str]:
    """The --allow-missing names whose package does not import and that the run did not allow."""
    return [
        name
        for name, module in OPTIONAL.items()
        if versions[module].startswith("absent") and name not in args.allow_missing
    ]


def stage_task(args) -> list[dict]:
    from examples.arithmetic.task import write_task
    from tests.harness.tiny import write_tiny_hf

    root = args.work / "task"
    shape = TASK_MODEL["cpu" if args.cpu else "gpu"]
    info = write_task(root)  # its config.json is replaced by the model below (same tokenizer ids)
    cfg = json.loads((root / "model" / "config.json").read_text())
    ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    write_tiny_hf(root / "model", "qwen2", vocab_size=cfg["vocab_size"], **shape, **ids)
    (root / "paths.yaml").write_text(
        f"tokenizer: {root / 'tokenizer'}\nmodel:\n  hf_path: {root / 'model'}\n"
        f"data:\n  train:\n    - path: {root / 'train.jsonl'}\n  template:\n    kind: plain\n"
        f"    instruction: ''\n"
    )
    size = sum(f.stat().st_size for f in (root / "model").glob("*.safetensors"))
    return [
        {
            "stage": "task",
            "status": "PASS",
            "detail": f"tiny Qwen2 {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
            f"vocab {info['vocab']}, {size / 2**20:.1f} MiB safetensors; {info['train']} train problems",
        }
    ]


def grpo_overrides(args, engine: str) -> list[str]:
    """The GRPO stages' overrides of configs/tiny_test.yaml (+ the task's paths.yaml)."""
    gpu = not args.cpu
    te = gpu and _te_imports()
    out = [
        f"train.run_dir={args.work / engine}",
        f"train.max_steps={STEPS}",
        f"train.save_every={STEPS}",
        "train.resume=false",
        f"model.dtype={'bfloat16' if gpu else 'float32'}",
        f"model.layer_spec={'te' if te else 'local'}",
        f"rollout.engine={engine}",
    ]
    if engine == "vllm":
        out += [
            "rollout.vllm.max_model_len=64",
            f"rollout.vllm.sleep_level={1 if gpu else 0}",
            "rollout.vllm.gpu_memory_utilization=0.3",
        ]
    return out


def _te_imports() -> bool:
    return not _version("transformer_engine.pytorch").startswith("absent")


def _config_files(args) -> list[Path]:
    return [REPO / "configs" / "tiny_test.yaml", args.work / "task" / "paths.yaml"]


def stage_preflight(args) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "megatron_ngrpo.launch.preflight",
        "--gpus",
        "0" if args.cpu else "1",
        *(a for f in _config_files(args) for a in ("--config", str(f))),
        *grpo_overrides(args, "megatron"),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S["preflight"] - 10)
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("preflight ")]
    detail = lines[-1] if lines else f"exit status {p.returncode}, no report line"
    return [
        {"stage": "preflight", "status": "PASS" if p.returncode == 0 else "FAIL", "detail": detail}
    ]


def _train(args, engine: str) -> dict:
    """STEPS GRPO steps in this process (world size 1); metrics, peak memory, layer spec."""
    import resource

    import torch

    from megatron_ngrpo.models.config import use_te
    from megatron_ngrpo.training.job_config import load_config
    from megatron_ngrpo.training.trainer import Trainer

    cfg = load_config(_config_files(args), grpo_overrides(args, engine))
    cuda = torch.cuda.is_available()
    t0 = time.time()
    trainer = Trainer(cfg)
    trainer.setup()
    with StepWindows(cuda) as windows:
        trainer.run()
    seconds = time.time() - t0
    rows = [
        json.loads(line)
        for line in (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    return {
        "cfg": cfg,
        "rows": rows,
        "seconds": seconds,
        "spec": "te" if use_te(cfg.model) else "local",
        "peak": torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_kind": "torch max_memory_allocated" if cuda else "process max RSS",
        "static": windows.static,
        "window_peak": windows.peak,
        "optimizer_steps": windows.steps,
    }


class StepWindows:
    """Allocated memory around optimizer steps (torch's global step hooks, which every
    ``torch.optim.Optimizer`` runs, megatron-core's wrapped ones included): ``static`` is what is
    allocated right after the first step; ``peak`` the highest peak within a window between two
    later steps (rollout, log-prob passes, forward and backward; not the step itself, not the
    checkpoint save after the last). Both 0 without CUDA."""

    def __init__(self, cuda: bool):
        self.cuda, self.static, self.peak, self.steps = cuda, 0, 0, 0

    def __enter__(self):
        from torch.optim import optimizer

        self._hooks = [
            optimizer.register_optimizer_step_pre_hook(self._before),
            optimizer.register_optimizer_step_post_hook(self._after),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()

    def _before(self, *_) -> None:
        import torch

        if self.cuda and self.steps:
            self.peak = max(self.peak, torch.cuda.max_memory_allocated())

    def _after(self, *_) -> None:
        import torch

        self.steps += 1
        if self.cuda:
            if self.steps == 1:
                self.static = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()


def _steps_detail(run: dict) -> tuple[bool, str]:
    rows = run["rows"]
    mixed = [r.get("mixing/mixed_token_frac", 0.0) for r in rows]
    ok = (
        len(rows) == STEPS
        and all(r["step"] == i + 1 for i, r in enumerate(rows))
        and max(mixed) > 0
    )
    return ok, (
        f"{len(rows)} steps in {run['seconds']:.0f} s, {run['cfg'].model.dtype}, {run['spec']} layer spec; "
        f"mixed token fraction {', '.join(f'{m:.3f}' for m in mixed)}; "
        f"reward {rows[-1]['reward/mean']:.3f}"
        if rows
        else "no metrics rows"
    )


def stage_grpo(args) -> list[dict]:
    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.launch import memory
    from megatron_ngrpo.launch.plan import train_layout

    run = _train(args, "megatron")
    ok, detail = _steps_detail(run)
    cfg = run["cfg"]
    layout = train_layout(cfg, dp=1)
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    layout = type(layout)(
        **{
            **layout.__dict__,
            "param_bytes": memory.BF16 if not args.cpu else memory.FP32,
            "unfused_seq_len": 0 if run["spec"] == "te" else longest,
        }
    )
    plan = memory.train_memory(ArchSpec.from_hf(cfg.model.hf_path), layout)
    static = plan.weights + plan.grads + plan.optimizer + plan.reference + plan.engine_copy
    mem = memory_row(run, static, plan.total - plan.overhead - static, cpu=args.cpu)
    return [{"stage": "grpo", "status": "PASS" if ok else "FAIL", "detail": detail}, mem]


def memory_row(run: dict, static: int, layout_terms: int, cpu: bool) -> dict:
    """The memory row: the measured layout-dependent memory (``run``'s ``window_peak`` less its
    ``static``, :class:`StepWindows`) against the plan's ``layout_terms``, within
    :data:`MEMORY_BOUNDS`; the static part and the whole peak shown beside it."""
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    if cpu:  # RSS holds the libraries too, no allocator statistics: information only
        return {
            "stage": "memory",
            "status": "INFO",
            "detail": f"{run['peak_kind']} {mib(run['peak'])}; plan {mib(static + layout_terms)}; "
            f"{run['optimizer_steps']} optimizer steps seen",
        }
    measured = run["window_peak"] - run["static"]
    ratio = measured / layout_terms
    low, high = MEMORY_BOUNDS
    return {
        "stage": "memory",
        "status": "PASS" if low <= ratio <= high else "FAIL",
        "detail": f"layout-dependent {mib(measured)} vs the plan's activations, logits and KV "
        f"{mib(layout_terms)}: ratio {ratio:.2f} (PASS within {low}-{high}); static after the "
        f"first step {mib(run['static'])} vs {mib(static)}; {run['peak_kind']} {mib(run['peak'])}",
    }


def stage_vllm(args) -> list[dict]:
    if _version("vllm").startswith("absent"):
        allowed = "vllm" in args.allow_missing
        return [
            {
                "stage": "vllm",
                "status": "SKIP" if allowed else "FAIL",
                "detail": "not run: vllm absent"
                + (" (--allow-missing vllm)" if allowed else " (allow with --allow-missing vllm)"),
            }
        ]
    run = _train(args, "vllm")
    ok, detail = _steps_detail(run)
    sleep = "sleep mode level 1" if not args.cpu else "no sleep mode (CPU)"
    return [
        {
            "stage": "vllm",
            "status": "PASS" if ok else "FAIL",
            "detail": f"colocated vLLM {_version('vllm')} TP 1, {sleep}; {detail}; peak {run['peak'] / 2**20:.0f} MiB",
        }
    ]


def refusals(args) -> list[tuple[str, list[str]]]:
    """(what, overrides) of routes config validation must refuse here."""
    cases = [
        (
            "colocated vLLM weight route ipc",
            ["rollout.engine=vllm", "rollout.vllm.weight_transfer=ipc"],
        ),
        (
            "colocated vLLM weight route nccl",
            ["rollout.engine=vllm", "rollout.vllm.weight_transfer=nccl"],
        ),
    ]
    cases += [
        ("context parallelism (not run by the trainer)", ["model.context_parallel=2"]),
        (
            "FP8 rollouts (weight sync unverified)",
            ["rollout.engine=vllm", "rollout.vllm.quantization=fp8"],
        ),
    ]
    if not args.cpu:
        if not _te_imports():
            cases += [
                (f"layer_spec {s} on a GPU without Transformer Engine", [f"model.layer_spec={s}"])
                for s in ("auto", "te")
            ]
        cases.append(("async Megatron engine on GPU", ["train.async.max_staleness=1"]))
    return cases


def stage_refused(args) -> list[dict]:
    from megatron_ngrpo.config_loader import ConfigError
    from megatron_ngrpo.training.job_config import load_config

    rows = []
    base = grpo_overrides(args, "megatron")
    for what, overrides in refusals(args):
        try:
            load_config(_config_files(args), [*base, *overrides])
        except ConfigError as e:
            rows.append({"stage": "refused", "status": "PASS", "detail": f"{what}: {e}"})
        else:
            rows.append(
                {
                    "stage": "refused",
                    "status": "FAIL",
                    "detail": f"{what}: accepted ({' '.join(overrides)})",
                }
            )
    return rows


# ---- orchestration -----------------------------------------------------------------------------
def run_stage(args, stage: str) -> list[dict]:
    """``stage`` in a child process; its rows, or one FAIL row with the log's last line."""
    log = args.work / f"{stage}.log"
    cmd = [
        sys.executable,
        __file__,
        "--stage",
        stage,
        "--work",
        str(args.work),
        *(["--cpu"] if args.cpu else []),
        *(["--allow-missing", ",".join(args.allow_missing)] if args.allow_missing else []),
    ]
    t0 = time.time()
    try:
        with open(log, "w") as f:
            p = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S[stage], cwd=REPO
            )
        failed = f"exit status {p.returncode}" if p.returncode else ""
    except subprocess.TimeoutExpired:
        failed = f"timed out after {TIMEOUT_S[stage]} s"
    lines = log.read_text(errors="replace").splitlines()
    results = [json.loads(line[len(RESULT) :]) for line in lines if line.startswith(RESULT)]
    seconds = time.time() - t0
    if results and not failed:
        rows = results[-1]
    else:
        last = next((line.strip() for line in reversed(lines) if line.strip()), "(no output)")
        rows = [{"stage": stage, "status": "FAIL", "detail": f"{failed}: {last[:300]}"}]
    for row in rows:
        row.setdefault("seconds", seconds)
    return rows


def table(rows: list[dict]) -> str:
    width = max(len(r["stage"]) for r in rows)
    lines = [f"{'stage':<{width}}  status  time   detail", "-" * 100]
    lines += [
        f"{r['stage']:<{width}}  {r['status']:<6}  {r['seconds']:>4.0f}s  {r['detail']}"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cpu", action="store_true", help="float32, gloo, no GPU (tests the script itself)"
    )
    ap.add_argument(
        "--allow-missing",
        type=lambda text: [n for n in text.split(",") if n],
        default=[],
        metavar="te,vllm",
        help="packages this run may lack without failing (te, vllm); their stages say so",
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=STAGES, metavar="STAGE")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ngrpo_gpu_smoke"))
    ap.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # a child process's stage
    args = ap.parse_args(argv)
    if unknown := set(args.allow_missing) - set(OPTIONAL):
        ap.error(f"--allow-missing {','.join(sorted(unknown))}: expected te and/or vllm")
    args.work = args.work.resolve()
    if args.stage:
        rows = globals()[f"stage_{args.stage}"](args)
        print(RESULT + json.dumps(rows), flush=True)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for stage in STAGES:
        task_failed = any(r["stage"] == "task" and r["status"] == "FAIL" for r in rows)
        if stage in args.skip or task_failed:  # every stage after it needs the task
            rows.append(skip_row(args, stage, task_failed))
            continue
        print(f"[gpu_smoke] {stage} ...", flush=True)
        rows += run_stage(args, stage)
    text = table(rows)
    print(text)
    (args.work / "summary.txt").write_text(text + "\n")
    (args.work / "summary.json").write_text(json.dumps(rows, indent=1))
    failed = [r["stage"] for r in rows if r["status"] == "FAIL"]
    print(f"[gpu_smoke] {verdict(rows)} (logs: {args.work})")
    return 1 if failed else 0


def skip_row(args, stage: str, task_failed: bool) -> dict:
    """A stage not run: SKIP, or FAIL where ``--skip`` leaves a package this check exists for
    unchecked without ``--allow-missing`` naming it."""
    need = SKIP_NEEDS.get(stage)
    if stage in args.skip and need and need not in args.allow_missing:
        status = "FAIL"
        why = f"skipped (--skip) without --allow-missing {need}: {OPTIONAL[need]} unchecked"
    else:
        status = "SKIP"
        why = "skipped (--skip)" if stage in args.skip else "not run: the task stage failed"
    return {"stage": stage, "status": status, "detail": why, "seconds": 0.0}


def verdict(rows: list[dict]) -> str:
    """The last line's verdict: the failed stages, and how many rows passed and were skipped
    ("all stages passed" only when none was skipped)."""
    count = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "SKIP", "INFO")}
    counts = f"{count['PASS']} passed, {count['SKIP']} skipped" + (
        f", {count['INFO']} information only" if count["INFO"] else ""
    )
    failed = [r["stage"] for r in rows if r["status"] == "FAIL"]
    if failed:
        return f"FAILED: {', '.join(failed)}; {counts}"
    return f"all stages passed: {counts}" if not count["SKIP"] else counts


if __name__ == "__main__":
    sys.exit(main())
