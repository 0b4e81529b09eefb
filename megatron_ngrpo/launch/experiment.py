"""NeMo-Run experiments from rendered tasks: dry-run, submit and wait, status, logs.

NeMo-Run 0.11.1 reports a failed job but still returns normally (docs/ENVIRONMENT.md §6): callers
check :func:`failed` on the statuses returned here.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import nemo_run as run

from megatron_ngrpo.launch import passthrough
from megatron_ngrpo.launch.chain import ChainSpec, chain_lines
from megatron_ngrpo.launch.executors import (
    REPO,
    Cluster,
    local_executor,
    preflight_line,
    runs_preflight,
    slurm_executor,
)
from megatron_ngrpo.launch.recipes import Command, TaskSpec

TERMINAL_OK = "SUCCEEDED"
PENDING_STATES = ("SUBMITTED", "PENDING", "RUNNING", "UNSUBMITTED")


def config_placeholder(index: int) -> str:
    """Stands for config file ``index`` in rendered commands until the files are staged."""
    return f"<config{index}>"


@dataclass
class Plan:
    """What one experiment runs: a single task, or a rollout group + training group (hetjob)."""

    title: str
    tasks: list[TaskSpec]
    executor: str  # "local" | "slurm"
    cluster: Cluster = field(default_factory=Cluster)
    time: str = "01:00:00"
    configs: list[Path] = field(default_factory=list)
    # --until-done (Slurm, the trainer): the job continues the run in new allocations.
    until_done: ChainSpec | None = None

    @property
    def heterogeneous(self) -> bool:
        return len(self.tasks) > 1


def stage_configs(plan: Plan) -> tuple[Plan, Path | None]:
    """Copy the config files to ``$NEMORUN_HOME/configs/<title>_<ns>/`` and point the commands at
    the copies: the job runs with the configs as submitted, and on Slurm they sit beside the
    experiments directory, which the nodes must see anyway (scripts and logs live there).
    Containers get the directory mounted at the same path. Returns the new plan and the staging
    directory."""
    if not plan.configs:
        return plan, None
    staged = Path(run.config.get_nemorun_home()) / "configs" / f"{plan.title}_{time.time_ns()}"
    staged.mkdir(parents=True)
    copies = {}
    for i, config in enumerate(plan.configs):
        names = [c.name for c in plan.configs]
        copy = staged / (config.name if names.count(config.name) == 1 else f"{i}-{config.name}")
        shutil.copyfile(config, copy)
        copies[config_placeholder(i)] = str(copy)
    swap = lambda argv: tuple(copies.get(a, a) for a in argv)  # noqa: E731
    tasks = [replace(t, command=replace(t.command, argv=swap(t.command.argv))) for t in plan.tasks]
    cluster = plan.cluster
    if cluster.container_image:
        cluster = replace(
            cluster, container_mounts=[*cluster.container_mounts, f"{staged}:{staged}"]
        )
    return replace(plan, tasks=tasks, cluster=cluster), staged


def _script(cmd: Command) -> run.Script:
    return run.Script(entrypoint=cmd.argv[0], path=cmd.argv[1], args=list(cmd.argv[2:]))


def _torchrun_script(task: TaskSpec, group: int, port: int) -> run.Script:
    """torchrun spelled out for hetjob group ``group``: its own first host hosts the c10d store
    (NeMo-Run's launcher would point every group at group 0's head node)."""
    if task.command.argv[0] != "python":
        raise ValueError(
            f"task {task.name}: torchrun runs python commands, not {task.command.argv[0]!r}"
        )
    torchrun = (
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(task.nodes),
        "--nproc-per-node",
        str(task.procs_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{run.ExecutorMacros.group_host(group)}:{port}",
        "--rdzv-id",
        "1",
    )
    return _script(Command(("python", *torchrun, *task.command.argv[1:])))


def _add(exp: run.Experiment, plan: Plan) -> list[str]:
    """Adds the plan's job(s) to ``exp``; returns the NeMo-Run job names."""
    if plan.executor == "local":
        for task in plan.tasks:
            exp.add(
                _script(task.command), executor=local_executor(task, plan.cluster), name=task.name
            )
        return [t.name for t in plan.tasks]
    if not plan.heterogeneous:
        task = plan.tasks[0]
        executor = slurm_executor(task, plan.cluster, plan.time, launcher=not task.command.per_node)
        exp.add(_script(task.command), executor=executor, name=task.name)
        _add_setup(exp, plan, {None: task})
        return [task.name]
    scripts, executors = [], []
    # The training group finds the rollout group's servers by their registrations in the job
    # directory (recipes.ROLLOUT_URL_DIR), not by host names.
    for group, task in enumerate(plan.tasks):
        scripts.append(
            _script(task.command)
            if task.command.per_node
            else _torchrun_script(task, group, plan.cluster.rdzv_port)
        )
        # No NeMo-Run launcher: one Slurm task per node; torchrun, if any, is spelled out above.
        executors.append(
            slurm_executor(task, plan.cluster, plan.time, launcher=False, heterogeneous=group == 0)
        )
    name = "-".join(t.name for t in plan.tasks)
    exp.add(scripts, executor=executors, name=name)
    _add_setup(exp, plan, dict(enumerate(plan.tasks)))
    return [name]


def _add_setup(exp: run.Experiment, plan: Plan, tasks: dict[int | None, TaskSpec]) -> None:
    """The job's setup: with ``plan.until_done`` the chain's lines (launch/chain.py), then the
    pre-flight lines (executors.preflight_line) of the trainer's group and the checks that
    ``--env NAME`` variables arrived (launch/passthrough.py). The job directory is known once the
    job is added, hence after ``exp.add``."""
    job = exp.jobs[-1]
    # A hetjob's JobGroup holds the groups merged into one executor.
    executor = job.executors if hasattr(job, "executors") else job.executor
    lines = [
        preflight_line(task, plan.cluster, executor.job_dir, group)
        for group, task in tasks.items()
        if runs_preflight(task)
    ]
    if lines:
        lines.insert(0, "# pre-flight (python -m megatron_ngrpo.launch.preflight)")
    if plan.cluster.passthrough:
        lines += ["# --env passed through (values not written here)"]
        lines += passthrough.check_lines(plan.cluster.passthrough)
    if plan.until_done:  # on the batch host, outside any container: the code as the host sees it
        code = os.path.join(executor.job_dir, "code") if plan.cluster.packager == "git" else REPO
        lines = [*chain_lines(str(code), executor.job_dir, plan.until_done), *lines]
    if lines:
        executor.setup_lines = "\n".join(lines)


def dryrun(plan: Plan) -> dict[str, str]:
    """The rendered job scripts by job name (Slurm: the sbatch script NeMo-Run would submit;
    local: the torchrun command line), without submitting anything."""
    plan, staged = stage_configs(plan)
    try:
        with run.Experiment(plan.title, log_level="WARN", enable_goodbye_message=False) as exp:
            names = _add(exp, plan)
            exp.dryrun(log=False, delete_exp_dir=False)
            out = {}
            for name, job in zip(names, exp.jobs):
                sbatch = Path(exp._exp_dir) / f"{name}_sbatch.sh"
                # Local jobs write no script; their dry-run info renders the torchrun command.
                out[name] = sbatch.read_text() if sbatch.is_file() else str(job._dryrun_info)
            shutil.rmtree(exp._exp_dir, ignore_errors=True)
    finally:
        if staged:
            shutil.rmtree(staged, ignore_errors=True)
    return out


def submit(
    plan: Plan, wait: bool = True, follow: BinaryIO | None = None
) -> tuple[str, dict[str, JobStatus]]:
    """Submit the plan; with ``wait`` block until every job ends. Returns the experiment id and
    each job's status. ``follow``: local jobs' logs are copied there as they grow, without
    torchrun's INFO lines (:class:`QuietLog`; the files keep them)."""
    plan, _ = stage_configs(plan)
    follower = None
    try:
        with run.Experiment(plan.title, log_level="WARN", enable_goodbye_message=False) as exp:
            _add(exp, plan)
            if follow and plan.executor == "local":
                follower = LogFollower(Path(exp._exp_dir), follow)
            # Slurm: submit only, then poll below (NeMo-Run's own wait leaves a job group's status
            # UNKNOWN in this process). Local jobs cannot detach: leaving the block waits for them.
            exp.run(detach=True)
    finally:
        if follower:
            follower.stop()
    if plan.executor == "local":  # only the launching process knows local jobs' status
        return exp._id, statuses(exp)
    exp = load(exp._id)
    return exp._id, wait_for(exp) if wait else statuses(exp)


@dataclass(frozen=True)
class JobStatus:
    state: str  # torchx AppState name: SUCCEEDED, FAILED, RUNNING, ...
    job_id: str  # Slurm job id, or the local process group's id

    def __str__(self) -> str:
        return f"{self.state} (job {self.job_id})"


def statuses(exp: run.Experiment) -> dict[str, JobStatus]:
    return {
        name: JobStatus(str(info["status"]), str(info["job_id"]))
        for name, info in exp.status(return_dict=True).items()
    }


def load(exp_id: str) -> run.Experiment:
    """An experiment of this NEMORUN_HOME by id, or by title (its latest run)."""
    is_id = "_" in exp_id and exp_id.rsplit("_", 1)[1].isdigit()
    try:
        return run.Experiment.from_id(exp_id) if is_id else run.Experiment.from_title(exp_id)
    except (AssertionError, FileNotFoundError):
        raise LookupError(
            f"experiment {exp_id!r} not found under {run.config.get_nemorun_home()}"
        ) from None


def wait_for(
    exp: run.Experiment, poll_s: float = 2.0, unknown_grace_s: float = 60.0
) -> dict[str, JobStatus]:
    """Poll until no job is pending or running. UNKNOWN counts as pending for
    ``unknown_grace_s``: sacct lists a job only once slurmdbd has recorded it."""
    start = time.monotonic()
    while True:
        status = statuses(exp)
        waiting = PENDING_STATES + (
            ("UNKNOWN",) if time.monotonic() - start < unknown_grace_s else ()
        )
        if not any(s.state in waiting for s in status.values()):
            return status
        time.sleep(poll_s)


def failed(status: dict[str, JobStatus]) -> list[str]:
    """Jobs that did not succeed (no job at all counts as a failure)."""
    return [name for name, s in status.items() if s.state != TERMINAL_OK] or (
        [] if status else ["<none>"]
    )


def job_dir(exp: run.Experiment) -> Path:
    """The first job's folder (a hetjob's JobGroup holds its groups' merged executor)."""
    job = exp.jobs[0]
    return Path((job.executors if hasattr(job, "executors") else job.executor).job_dir)


def log_files(exp: run.Experiment, job: str | None = None) -> list[Path]:
    """Log files of a job (all jobs when ``job`` is None): Slurm's per-group ``log-*.out`` and
    the batch script's ``sbatch_*.out``, or torchrun's per-rank logs of local jobs."""
    files: list[Path] = []
    for j in exp.jobs:
        if job is not None and j.id != job:
            continue
        job_dir = Path(j.executor.job_dir)
        files += sorted(job_dir.glob("log-*.out")) + sorted(job_dir.glob("sbatch_*.out"))
        files += sorted(job_dir.glob("nemo_run/*/*/*/stdout.log"))
        files += sorted(job_dir.glob("nemo_run/*/*/*/stderr.log"))
    return files


# torchrun's own INFO lines (torch.distributed.elastic, glog format), e.g.
# "I1126 17:29:15.097000 9791 site-packages/torch/distributed/launcher/api.py:254] Starting ...".
TORCHRUN_INFO = re.compile(rb"I\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
# megatron-core's INFO records as the trainer logs them (train.py: every line of a record carries
# its header, so a multi-line one such as the gradient buckets' parameter list is recognised line
# by line), after torchrun's rank prefix, e.g. "[default0]:2026-11-28 08:34:54,227 INFO
# megatron.core.distributed.param_and_grad_buffer: ...". Not megatron_ngrpo's own.
MEGATRON_INFO = re.compile(
    rb"(\[[^\]\n]*\]:)?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO megatron[.:]"
)
# That header, digits as 0: a partial line that still agrees with it may become one.
_MEGATRON_HEAD = b"0000-00-00 00:00:00,000 INFO megatron."


class QuietLog:
    """A growing log, fed in arbitrary chunks, less torchrun's INFO lines and megatron-core's
    (both stay in the job's log files). Everything else passes at once, partial lines included
    (progress bars redraw with carriage returns, no newline); a partial line that may still
    become such a line waits for its end."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        *lines, last = (self._pending + chunk).split(b"\n")
        out = [line + b"\n" for line in lines if not self._quiet(line)]
        self._pending = last if self._may_be_quiet(last) else b""
        return b"".join(out) + (b"" if self._pending else last)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return b"" if self._quiet(rest) else rest

    @staticmethod
    def _quiet(line: bytes) -> bool:
        return bool(TORCHRUN_INFO.match(line) or MEGATRON_INFO.match(line))

    @staticmethod
    def _may_be_quiet(partial: bytes) -> bool:
        if QuietLog._quiet(partial):
            return True
        # A prefix of torchrun's header: at most a few hundred bytes, without "] ".
        if partial[:1] == b"I" and b"] " not in partial and len(partial) < 512:
            return True
        # A prefix of megatron's: the rank prefix, then the header so far, digit for digit.
        rest = partial
        if rest[:1] == b"[":
            end = rest.find(b"]:")
            if end < 0:
                return len(rest) < 64 and b"\r" not in rest
            rest = rest[end + 2 :]
        return len(rest) < len(_MEGATRON_HEAD) and all(
            c in b"0123456789" if t == ord("0") else c == t for t, c in zip(_MEGATRON_HEAD, rest)
        )


class LogFollower:
    """Copies a local experiment's job logs (torchx's ``<job>/nemo_run/<app>/<role>/0/std*.log``,
    created after the launch) to ``out`` as they grow, through :class:`QuietLog`, on a thread
    until :meth:`stop`."""

    def __init__(self, exp_dir: Path, out: BinaryIO, poll_s: float = 0.5):
        self.exp_dir, self.out, self.poll_s = exp_dir, out, poll_s
        self._files: dict[Path, tuple[int, QuietLog]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-follower", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.pump()

    def pump(self, final: bool = False) -> None:
        for log in sorted(self.exp_dir.glob("*/nemo_run/*/*/0/std*.log")):
            offset, quiet = self._files.get(log, (0, QuietLog()))
            try:
                with open(log, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            self._files[log] = (offset + len(chunk), quiet)
            text = quiet.feed(chunk) + (quiet.flush() if final else b"")
            if text:
                self.out.write(text)
                self.out.flush()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pump(final=True)
