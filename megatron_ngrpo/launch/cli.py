"""``ngrpo-launch`` / ``python -m megatron_ngrpo.launch``: run recipes locally (torchrun) or on Slurm.

    ngrpo-launch recipes                                  the recipe table
    ngrpo-launch memory r1-7b [--nodes 4]                 expected GPU memory per rank
    ngrpo-launch plan r1-7b [--nodes 4] [a.b=c ...]       the layout built and checked without GPUs
    ngrpo-launch run r1-7b --executor slurm --config configs/ngrpo_r1_7b.yaml --account A --partition P \\
        --container-image IMG --mount /lustre:/lustre [--dryrun | --detach] [a.b=c ...]
    ngrpo-launch status EXPERIMENT [--wait]
    ngrpo-launch logs EXPERIMENT [--job NAME]
    ngrpo-launch cancel EXPERIMENT

``run`` waits for the jobs (unless ``--detach``) and exits 1 when one did not succeed; a local
job's output follows in the terminal meanwhile (torchrun's INFO lines stay in its log files); ``status``
exits 1 when a job failed (or, with ``--wait``, did not succeed); ``plan`` exits 1 with a
one-line reason when the layout cannot be built or does not fit an 80 GB H100. Bad input exits 2
with a one-line error. Experiments live under $NEMORUN_HOME (default ~/.nemo_run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from pathlib import Path

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.launch import job_files, passthrough, plan, recipes, time_limit, until_done
from megatron_ngrpo.launch.memory import GIB
from megatron_ngrpo.rollout.config import EngineName


def _env_item(text: str) -> tuple[str, str | None]:
    """``NAME=VALUE``, or ``NAME`` (passed through: launch/passthrough.py)."""
    key, eq, value = text.partition("=")
    return key, value if eq else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ngrpo-launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("recipes", help="list the recipes")
    _add_memory_and_plan(sub)
    r = sub.add_parser("run", help="run a recipe's task (train, eval, conversion)")
    _add_run_options(r)
    _add_slurm_options(r.add_argument_group("slurm"))
    until_done.add_options(r.add_argument_group("runs longer than one allocation (slurm)"))
    _add_experiment_commands(sub)
    return p


def _add_memory_and_plan(sub) -> None:
    """``memory`` and ``plan``: a recipe's expected memory and its layout, without GPUs."""
    m = sub.add_parser("memory", help="expected GPU memory per rank of a recipe")
    m.add_argument("recipe")
    m.add_argument("--nodes", type=int)
    pl = sub.add_parser(
        "plan",
        help="build a recipe's model on meta under a simulated process group "
        "of its world size; counts, stages, memory (exit 1: cannot fit/build)",
    )
    pl.add_argument("recipe")
    pl.add_argument("overrides", nargs="*", metavar="a.b=c", help="training config overrides")
    pl.add_argument("--nodes", type=int)
    pl.add_argument("--config", help="training config (default: the recipe's)")
    pl.add_argument("--partition", help="Slurm partition whose MaxTime --time must fit")
    pl.add_argument("--time", help="time limit per allocation (default: the recipe's)")
    until_done.add_step_time(pl)


def _add_run_options(r: argparse.ArgumentParser) -> None:
    """``run``: the task, its configs and inputs, the layout, the rollout group, the submission."""
    r.add_argument("recipe")
    r.add_argument(
        "overrides",
        nargs="*",
        metavar="a.b=c",
        help="config overrides (last wins); for conversions, extra tool arguments after --",
    )
    r.add_argument("--task", choices=recipes.TASKS, default="train")
    r.add_argument("--executor", choices=("local", "slurm"), default="local")
    r.add_argument(
        "--config",
        action="append",
        default=[],
        help="YAML config of the train/eval entry point (repeatable, later files win)",
    )
    r.add_argument(
        "--hf-path", help="HF checkpoint directory (default: MODELS_DIR/<recipe's hf_name>)"
    )
    r.add_argument(
        "--models-dir",
        default=os.environ.get("NGRPO_MODELS_DIR", "/models"),
        help="directory holding the HF checkpoints (env NGRPO_MODELS_DIR; default /models)",
    )
    r.add_argument("--checkpoint", help="megatron checkpoint (convert-megatron)")
    r.add_argument("--output", help="output directory (conversions)")
    r.add_argument("--nodes", type=int, help="nodes (within the recipe's range)")
    r.add_argument("--procs-per-node", type=int, help="ranks per node (default: the recipe's)")
    r.add_argument(
        "--gpus-per-node", type=int, help="GPUs requested per node (default: the recipe's)"
    )
    r.add_argument("--module", help="entry module replacing megatron_ngrpo.train / .eval")
    r.add_argument(
        "--disaggregated",
        action="store_true",
        help="heterogeneous Slurm job: a rollout group (vLLM servers) + the training group",
    )
    r.add_argument("--rollout-nodes", type=int, help="nodes of the rollout group")
    r.add_argument(
        "--rollout-args",
        default="",
        help="more options of the rollout servers (python -m megatron_ngrpo.rollout.remote.server)",
    )
    r.add_argument("--title", help="experiment title (default ngrpo-<recipe>-<task>)")
    r.add_argument("--dryrun", action="store_true", help="print the job scripts, submit nothing")
    r.add_argument("--detach", action="store_true", help="return after submission (Slurm)")


def _add_slurm_options(s) -> None:
    """``run``'s Slurm options (account, container, environment, packaging, node use)."""
    s.add_argument("--account", default=os.environ.get("NGRPO_SLURM_ACCOUNT", "ngrpo"))
    s.add_argument("--partition", default=os.environ.get("NGRPO_SLURM_PARTITION"))
    s.add_argument("--time", help="time limit (default: the recipe's)")
    s.add_argument("--container-image", help="container image (pyxis/enroot)")
    s.add_argument(
        "--mount", action="append", default=[], metavar="SRC:DST", help="container mount"
    )
    s.add_argument(
        "--env",
        action="append",
        default=[],
        type=_env_item,
        metavar="KEY[=VALUE]",
        help="environment variable of the job (e.g. NCCL_SOCKET_IFNAME=ib0); KEY alone passes "
        "this environment's value without writing it into the job script (credentials: "
        "an inline value of a *KEY*/*TOKEN*/*SECRET*/*PASSWORD* name is refused)",
    )
    s.add_argument(
        "--packager",
        choices=("git", "none"),
        default=None,
        help="git: archive the committed HEAD into the job (Slurm default); "
        "none: run this checkout in place (local default)",
    )
    s.add_argument(
        "--rdzv-port", type=int, default=29500, help="torchrun c10d port on the head node"
    )
    s.add_argument(
        "--exclusive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whole nodes (default: yes for GPU jobs)",
    )
    s.add_argument("--mem", help="memory per node (e.g. 0 = all)")
    s.add_argument(
        "--group-start-wait", type=int, default=None, help="hetjob: seconds between group starts"
    )
    s.add_argument(
        "--group-monitor-wait",
        type=int,
        default=None,
        help="hetjob: seconds between the monitor's checks of the groups",
    )


def _add_experiment_commands(sub) -> None:
    """``status``, ``logs`` and ``cancel`` of a submitted experiment."""
    for name in ("status", "logs", "cancel"):
        q = sub.add_parser(name, help=f"{name} of a submitted experiment")
        q.add_argument("experiment", help="experiment id (or title: its latest run)")
        if name == "status":
            q.add_argument("--wait", action="store_true", help="wait until every job has ended")
        if name == "logs":
            q.add_argument("--job", help="job name (default: all)")


def cmd_recipes() -> int:
    print(
        f"{'recipe':10} {'nodes':>7} {'GPUs':>5} {'TP':>3} {'PP':>3} {'DP':>3} {'vLLM TP':>7} "
        f"{'train GiB':>9} {'vLLM GiB':>8}  summary"
    )
    for r in recipes.RECIPES.values():
        gpu = r.gpus_per_node > 0  # memory figures are for H100 ranks
        train = f"{r.train_memory().total / GIB:.1f}" if gpu else "-"
        vllm = (
            f"{r.vllm_memory().reserved / GIB:.1f}"
            if gpu and r.rollout_engine == EngineName.vllm
            else "-"
        )
        print(
            f"{r.name:10} {f'{r.min_nodes}-{r.max_nodes}':>7} {r.gpus_per_node:>5} {r.tensor_parallel:>3} "
            f"{r.pipeline_parallel:>3} {r.data_parallel(r.nodes):>3} {r.vllm_tensor_parallel:>7} "
            f"{train:>9} {vllm:>8}  {r.summary}"
        )
    return 0


def memory_table(recipe: recipes.Recipe, nodes: int | None = None) -> str:
    """Markdown breakdown of the expected memory per GPU (docs/LAUNCHING.md shows these)."""
    nodes = nodes or recipe.nodes
    recipe.validate(nodes)
    t, v = recipe.train_memory(nodes), recipe.vllm_memory()
    gib = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    rows = [
        (
            "layout",
            f"{nodes} node(s) × {recipe.procs_per_node}: TP {recipe.tensor_parallel}, "
            f"PP {recipe.pipeline_parallel}, DP {recipe.data_parallel(nodes)}, "
            f"SP {'on' if recipe.sequence_parallel else 'off'}, "
            f"recompute {'full' if recipe.recompute else 'off'}, "
            f"{recipe.train_layout(nodes).tokens} tokens/micro-batch",
        ),
        ("parameters on the busiest rank", f"{t.params / 1e9:.3f} B"),
        ("weights (bf16)", gib(t.weights)),
        ("grads (fp32 main grads)", gib(t.grads)),
        ("Adam + master (fp32, ÷DP)", gib(t.optimizer)),
        ("activations kept (layer inputs)", gib(t.activations)),
        ("one layer's backward (recomputed, MLP gradients)", gib(t.working)),
        ("log-prob pass (chunks of logits)", gib(t.logits)),
        ("CUDA context, NCCL, slack", gib(t.overhead)),
        ("**training total**", f"**{gib(t.total)}**"),
        (
            "vLLM reserved (gpu_memory_utilization)",
            f"{gib(v.reserved)} ({recipe.vllm_gpu_memory_utilization}, vLLM TP {recipe.vllm_tensor_parallel})",
        ),
        ("vLLM weights / KV cache", f"{gib(v.weights)} / {gib(v.kv_cache)}"),
        (
            "KV capacity",
            f"{v.kv_tokens:,} tokens = {v.kv_tokens // recipe.seq_len} sequences of {recipe.seq_len}",
        ),
        ("**training + vLLM reserved**", f"**{gib(t.total + v.reserved)}**"),
    ]
    lines = [f"| {recipe.name} | GiB per GPU |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    recipe = recipes.get(args.recipe)
    time = args.time or recipe.time
    time_limit.check_time(time, args.partition)
    try:
        layout = plan.plan_layout(recipe, args.nodes, tuple(args.overrides), args.config)
        cfg = plan.recipe_config(recipe, layout.nodes, tuple(args.overrides), args.config)
    except plan.PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(plan.format_plan(layout))
    until_done.note_save_interval(time, cfg.train, args.step_time)
    return 0


def check_not_run(configs: list[str], overrides: list[str]) -> None:
    """The trainer's refusals of options it cannot run (context parallelism, FP8 rollouts) on the
    job's config as composed here (its files are checked on the cluster): before anything queues."""
    # lazy: training.job_config imports torch; `ngrpo-launch` stays quick for other tasks
    from megatron_ngrpo.config_loader import compose
    from megatron_ngrpo.training import job_config

    job_config.check_not_run(compose(job_config.NGRPOConfig, configs, overrides))


def make_plan(args: argparse.Namespace):
    # lazy: keeps launch.cli free of NeMo-Run at import (start-up)
    from megatron_ngrpo.launch import experiment

    recipe = _recipe_with_layout(args)
    packager = _packager(args)
    _check_job_paths(args)
    hf_path = args.hf_path or f"{args.models_dir}/{recipe.hf_name}"
    tasks = _tasks(args, recipe, hf_path)
    if args.task in ("train", "eval"):
        recipes.check_configs(recipe, args.config, args.overrides)
    if runs_trainer(args):
        check_not_run(args.config, trainer_overrides(args, recipe, hf_path))
    if args.executor == "slurm":
        time_limit.check_time(args.time or recipe.time, args.partition)
    return experiment.Plan(
        title=args.title or f"ngrpo-{recipe.name}-{args.task}",
        tasks=tasks,
        executor=args.executor,
        cluster=_cluster(args, recipe, hf_path, packager),
        time=recipe.time,
        configs=[Path(c) for c in args.config],
        until_done=until_done.spec(
            args, runs_trainer(args), lambda: trainer_overrides(args, recipe, hf_path), recipe.time
        ),
    )


def _recipe_with_layout(args: argparse.Namespace) -> recipes.Recipe:
    """The recipe with the ranks, GPUs and rollout nodes per node the options set."""
    layout = {
        k: v
        for k, v in (
            ("procs_per_node", args.procs_per_node),
            ("gpus_per_node", args.gpus_per_node),
            ("rollout_nodes", args.rollout_nodes),
        )
        if v is not None
    }
    return dataclasses.replace(recipes.get(args.recipe), **layout)


def _packager(args: argparse.Namespace) -> str:
    """git for Slurm, none (this checkout in place) locally, the only choice a local job has."""
    packager = args.packager or ("git" if args.executor == "slurm" else "none")
    if args.executor == "local" and packager != "none":
        raise ConfigError("--packager git: the local executor runs this checkout in place")
    return packager


def _check_job_paths(args: argparse.Namespace) -> None:
    """NEMORUN_HOME usable in a Slurm script; every --config file present."""
    home = os.environ.get("NEMORUN_HOME", "")
    if args.executor == "slurm" and not args.container_image and "/nemo_run" in home:
        # NeMo-Run rewrites every "/nemo_run" of a non-container sbatch script to the job directory.
        raise ConfigError(
            f"NEMORUN_HOME {home!r}: contains '/nemo_run', which NeMo-Run rewrites in sbatch scripts"
        )
    for config in args.config:
        if not Path(config).is_file():
            raise ConfigError(f"--config {config!r}: no such file")


def _tasks(args: argparse.Namespace, recipe: recipes.Recipe, hf_path: str) -> list:
    """The recipe's task rendered; a disaggregated job's rollout servers before it."""
    # lazy: keeps launch.cli free of NeMo-Run at import (start-up)
    from megatron_ngrpo.launch import experiment

    task = recipes.render(
        recipe,
        args.task,
        hf_path=hf_path,
        configs=tuple(experiment.config_placeholder(i) for i in range(len(args.config))),
        checkpoint=args.checkpoint,
        output=args.output,
        nodes=args.nodes,
        overrides=tuple(args.overrides),
        module=args.module,
        disaggregated=args.disaggregated,
    )
    if not args.disaggregated:
        return [task]
    if args.executor != "slurm" or args.task != "train":
        raise ConfigError("--disaggregated: only for --task train on --executor slurm")
    return [recipes.rollout_server(recipe, hf_path, tuple(shlex.split(args.rollout_args))), task]


def _cluster(args: argparse.Namespace, recipe: recipes.Recipe, hf_path: str, packager: str):
    """The executor's settings; a Slurm job's outside files checked absolute and, in a
    container, mounted."""
    # lazy: keeps launch.cli free of NeMo-Run at import (start-up)
    from megatron_ngrpo.launch.executors import Cluster

    mounts = list(args.mount)
    if args.executor == "slurm":
        files = slurm_files(args, recipe, hf_path)
        job_files.require_absolute(files)
        if args.container_image:
            mounts = job_files.container_mounts(mounts, files)
    waits = {
        "group_start_wait": args.group_start_wait,
        "group_monitor_wait": args.group_monitor_wait,
    }
    env, passthrough_names = passthrough.split(args.env)
    return Cluster(
        account=args.account,
        partition=args.partition,
        time=args.time,
        container_image=args.container_image,
        container_mounts=mounts,
        env=env,
        passthrough=passthrough_names,
        packager=packager,
        rdzv_port=args.rdzv_port,
        exclusive=args.exclusive,
        mem=args.mem,
        signal_lead_s=args.signal_lead,
        **{name: value for name, value in waits.items() if value is not None},
    )


def runs_trainer(args: argparse.Namespace) -> bool:
    """Whether the job runs the trainer (whose config this launcher can read)."""
    return args.task == "train" and (args.module or recipes.TRAIN_MODULE) == recipes.TRAIN_MODULE


def trainer_overrides(args: argparse.Namespace, recipe: recipes.Recipe, hf_path: str) -> list[str]:
    """The trainer's overrides as the rendered command gives them: the recipe's, then the user's."""
    return [
        *recipe.model_overrides(hf_path),
        *recipe.rollout_overrides(args.disaggregated),
        *args.overrides,
    ]


def slurm_files(
    args: argparse.Namespace, recipe: recipes.Recipe, hf_path: str
) -> job_files.JobFiles:
    """What a Slurm job of ``args`` reads and writes outside its job folder (launch/job_files.py):
    the trainer's config paths; for other entry modules and tasks, the model and the options."""
    if runs_trainer(args):
        return job_files.train_files(args.config, trainer_overrides(args, recipe, hf_path))
    reads = {"--hf-path": hf_path, "--checkpoint": args.checkpoint or ""}
    files = job_files.JobFiles(reads={k: v for k, v in reads.items() if os.path.isabs(v)})
    if args.task.startswith("convert") and args.output:
        files.writes["--output"] = args.output
    return files


def cmd_run(args: argparse.Namespace) -> int:
    # lazy: keeps launch.cli free of NeMo-Run at import (start-up)
    from megatron_ngrpo.launch import experiment

    plan = make_plan(args)
    if args.dryrun:
        for name, script in experiment.dryrun(plan).items():
            print(f"# ---- {name} ----\n{script}")
        return 0
    # Local jobs: their output (progress bar, summary) follows in this terminal, quietly.
    exp_id, status = experiment.submit(plan, wait=not args.detach, follow=sys.stdout.buffer)
    _print_status(exp_id, status)
    if args.detach:
        print(f"submitted; follow with: ngrpo-launch status {exp_id} --wait")
        return 0
    for f in experiment.log_files(experiment.load(exp_id)):
        print(f"log: {f}")
    if plan.until_done:
        return until_done.follow(experiment.load(exp_id), status, wait=True)
    bad = experiment.failed(status)
    if bad:
        print(f"error: job(s) {', '.join(bad)} did not succeed", file=sys.stderr)
    return 1 if bad else 0


def _print_status(exp_id: str, status: dict) -> None:
    print(f"\nexperiment {exp_id}")  # NeMo-Run's progress panel may leave the line open
    for name, s in status.items():
        print(f"  {name}: {s}")


def cmd_status(args: argparse.Namespace) -> int:
    # lazy: keeps launch.cli free of NeMo-Run at import (start-up)
    from megatron_ngrpo.launch import chain, experiment

    exp = experiment.load(args.experiment)
    status = experiment.wait_for(exp) if args.wait else experiment.statuses(exp)
    _print_status(exp._id, status)
    if (experiment.job_dir(exp) / chain.CHAIN_FILE).is_file():
        return until_done.follow(exp, status, args.wait)
    if args.wait:
        return 1 if experiment.failed(status) else 0
    ended_badly = [
        n
        for n, s in status.items()
        if s.state not in experiment.PENDING_STATES and s.state != experiment.TERMINAL_OK
    ]
    return 1 if ended_badly or not status else 0


def cmd_logs(args: argparse.Namespace) -> int:
    # lazy: keeps launch.cli free of NeMo-Run at import (start-up)
    from megatron_ngrpo.launch import experiment

    files = experiment.log_files(experiment.load(args.experiment), args.job)
    if not files:
        print(
            f"error: no log files for {args.experiment} (job {args.job or 'any'})", file=sys.stderr
        )
        return 1
    for f in files:
        print(f"==> {f} <==")
        print(f.read_text(errors="replace"), end="")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    # lazy: keeps launch.cli free of NeMo-Run at import (start-up)
    from megatron_ngrpo.launch import experiment

    exp = experiment.load(args.experiment)
    for job in exp.jobs:
        exp.cancel(job.id)
    until_done.cancel(exp)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after "--" goes to the job verbatim (conversion tools' options).
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    # Overrides may follow options (argparse stops a positional list at the first option).
    args, extra = parser.parse_known_args(argv)
    if (
        (extra or passthrough)
        and args.cmd not in ("run", "plan")
        or any(e.startswith("-") for e in extra)
    ):
        parser.error(f"unrecognized arguments: {' '.join(extra + passthrough)}")
    if args.cmd in ("run", "plan"):
        args.overrides = [*args.overrides, *extra, *passthrough]
    try:
        if args.cmd == "recipes":
            return cmd_recipes()
        if args.cmd == "memory":
            print(memory_table(recipes.get(args.recipe), args.nodes))
            return 0
        if args.cmd == "plan":
            return cmd_plan(args)
        return {"run": cmd_run, "status": cmd_status, "logs": cmd_logs, "cancel": cmd_cancel}[
            args.cmd
        ](args)
    except (ConfigError, LookupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
