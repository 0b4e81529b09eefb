"""``ngrpo-launch``'s side of a run longer than one allocation: the options of ``run`` and
``plan``, the chain a ``run --until-done`` renders (launch/chain.py), following it to its end,
and the one-line note when ``train.save_every`` steps do not fit one allocation."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.launch import chain, time_limit


def add_step_time(p) -> None:
    p.add_argument(
        "--step-time",
        type=float,
        help="seconds per training step, to check train.save_every against --time "
        "(default: as measured in the run directory's allocations.jsonl)",
    )


def add_options(s) -> None:
    """``run``'s options for a run longer than one allocation."""
    s.add_argument(
        "--until-done",
        action="store_true",
        help="continue the run in new allocations until train.max_steps (self-chaining job)",
    )
    s.add_argument(
        "--max-idle-allocations",
        type=int,
        default=2,
        help="--until-done stops after this many allocations in a row gain no step",
    )
    s.add_argument(
        "--signal-lead",
        type=int,
        help="seconds before the time limit the trainer gets SIGUSR1 to save and stop "
        "(default: 300 on GPUs, 60 on CPUs)",
    )
    add_step_time(s)


def note_save_interval(time: str, train, step_time: float | None) -> None:
    """One line on stderr when train.save_every steps do not fit one allocation."""
    step_time = step_time or time_limit.measured_step_seconds(train.run_dir)
    note = time_limit.save_interval_note(time, train.save_every, step_time)
    if note:
        print(note, file=sys.stderr)


def spec(
    args: argparse.Namespace,
    runs_trainer: bool,
    overrides: Callable[[], list[str]],
    recipe_time: str,
) -> chain.ChainSpec | None:
    """The chain of a ``run --until-done`` of the trainer on Slurm; for any trainer run on
    Slurm, the save-interval note first. ``overrides``: the trainer's, as the command gives them."""
    # lazy: training.job_config imports torch; `ngrpo-launch` stays quick for other tasks
    from megatron_ngrpo.config_loader import compose
    from megatron_ngrpo.training.job_config import NGRPOConfig

    if not (runs_trainer and args.executor == "slurm"):
        if args.until_done:
            raise ConfigError(
                "--until-done: only for the trainer (--task train) on --executor slurm"
            )
        return None
    train = compose(NGRPOConfig, args.config, overrides()).train
    note_save_interval(args.time or recipe_time, train, args.step_time)
    if not args.until_done:
        return None
    if args.max_idle_allocations < 1:
        raise ConfigError(f"--max-idle-allocations {args.max_idle_allocations}: expected >= 1")
    return chain.ChainSpec(train.run_dir, train.max_steps, args.max_idle_allocations)


def follow(exp, status: dict, wait: bool) -> int:
    """An --until-done run's chain, after waiting for its end with ``wait``: exit 0 while it goes
    on or once complete, 1 when it stopped."""
    # lazy: keeps launch.cli free of NeMo-Run at import (start-up)
    from megatron_ngrpo.launch import experiment

    job_dir = experiment.job_dir(exp)
    if wait:
        chain.wait(job_dir, next(iter(status.values())).job_id)
    table, ok = chain.summary(job_dir)
    print(table)
    return 0 if ok else 1


def cancel(exp) -> None:
    """``ngrpo-launch cancel`` of an --until-done run: the chain's allocations after the first
    (NeMo-Run knows only the first), the queued one included."""
    # lazy: keeps launch.cli free of NeMo-Run at import (start-up)
    from megatron_ngrpo.launch import experiment

    entries = chain.read_jsonl(experiment.job_dir(exp) / chain.CHAIN_FILE)
    ids = {str(e["job_id"]) for e in entries} | {str(e["next"]) for e in entries if e.get("next")}
    if ids:
        subprocess.run(["scancel", *sorted(ids)], check=False, timeout=60)
