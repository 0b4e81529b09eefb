"""NeMo-Run executors: torchrun on this machine, or Slurm (optionally in pyxis containers).

The NeMo-Run 0.11.1 traps handled here (docs/ENVIRONMENT.md §6):
* torchrun's ``--nproc-per-node`` comes from ``torchrun_nproc_per_node``; left unset it becomes
  ``ntasks_per_node`` (and NeMo-Run then forces one Slurm task per node), so
  ``ntasks_per_node=1, gpus_per_node=8`` would start one rank per node. Both are set explicitly.
* ``LocalTunnel`` copies nothing, so its ``job_dir`` must be ``$NEMORUN_HOME/experiments``.
* In a heterogeneous job every group gets the first executor's launcher and the head node of
  group 0 as torchrun endpoint, so hetjob groups run without a launcher and the training group's
  torchrun is rendered explicitly, with its own group's first host as rendezvous endpoint.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import nemo_run as run

from megatron_ngrpo.launch.recipes import ROLLOUT_SERVER, TRAIN_MODULE, TaskSpec

# The checkout: megatron_ngrpo/launch/executors.py -> the repository root.
REPO = Path(__file__).resolve().parents[2]
PREFLIGHT_MODULE = "megatron_ngrpo.launch.preflight"
# Where the packaged code is inside a NeMo-Run job (NeMo-Run rewrites /nemo_run to the job
# directory outside containers, and mounts the job directory there inside).
PACKAGED_CODE = "/nemo_run/code"

# Environment of every GPU job. Cluster-specific NCCL settings (NCCL_SOCKET_IFNAME,
# NCCL_IB_HCA, ...) come from --env.
GPU_ENV = {
    # megatron-core: TP/SP communication must be issued in order on one hardware queue.
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NCCL_DEBUG": "WARN",
    # A hung or failed collective raises instead of blocking until the Slurm time limit.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # Frees NCCL's buffers when the collective completes, not at the next caching-allocator sweep.
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    # The neighbour-mixing hook patches vLLM's V1 model runner (docs/ENVIRONMENT.md §4).
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
CPU_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# torchrun's c10d store lives on the job's own head node, so a constant rendezvous id cannot meet
# another job's (NeMo-Run would draw a random one, which makes rendered scripts unreproducible).
RDZV_ID = 1
# The trainer's warning before the time limit: Slurm sends SIGUSR1 this many seconds before it
# (up to 60 s earlier: Slurm's event resolution), to every process of the job's steps.
SIGNAL_LEAD_S = {"gpu": 300, "cpu": 60}


@dataclass
class Cluster:
    """Where and how jobs run: the Slurm account and partition, the container, the code."""

    account: str = "ngrpo"
    partition: str | None = None
    time: str | None = None  # None: the recipe's
    container_image: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Variables the job inherits from the launcher's environment, never written into its script
    # (launch/passthrough.py).
    passthrough: tuple[str, ...] = ()
    # "git": the committed HEAD is archived into the job directory (reproducible); "none": jobs
    # run the checkout in place (it must be visible on the compute nodes).
    packager: str = "git"
    rdzv_port: int = 29500
    # None: exclusive nodes and all their memory ("0") for GPU jobs, Slurm's defaults for CPU jobs.
    exclusive: bool | None = None
    mem: str | None = None
    # Seconds the hetjob monitor waits (NeMo-Run defaults 30 / 60 suit long jobs).
    group_start_wait: int = 30
    group_monitor_wait: int = 60
    # Seconds before the time limit the trainer gets SIGUSR1 (None: SIGNAL_LEAD_S by device).
    signal_lead_s: int | None = None

    def code_root(self) -> str:
        return PACKAGED_CODE if self.packager == "git" else str(REPO)

    def packager_obj(self) -> run.Packager:
        return run.GitArchivePackager() if self.packager == "git" else run.Packager()

    def mounts(self) -> list[str]:
        """Container mounts; with packager "none" the checkout is mounted at its own path."""
        extra = [f"{REPO}:{REPO}"] if self.packager != "git" and self.container_image else []
        return [*self.container_mounts, *extra]


def job_env(task: TaskSpec, cluster: Cluster, pythonpath: str) -> dict[str, str]:
    base = GPU_ENV if task.gpus_per_node else CPU_ENV
    return {**base, "PYTHONPATH": pythonpath, **task.env, **cluster.env}


def signal_lead(task: TaskSpec, cluster: Cluster) -> int:
    return cluster.signal_lead_s or SIGNAL_LEAD_S["gpu" if task.gpus_per_node else "cpu"]


def stop_signal_env(task: TaskSpec, cluster: Cluster) -> dict[str, str]:
    """torchrun's side of a planned stop. Slurm signals every process of a step, torchrun too:
    torchrun dies of SIGUSR1 unless it handles it (PET_ = its own options from the environment),
    then passes it on to the workers and waits for them as long as the warning lasts, not its
    default 30 s, before SIGKILL: the trainer finishes its step and saves (training/stop.py)."""
    return {
        "PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(signal_lead(task, cluster)),
    }


def local_executor(task: TaskSpec, cluster: Cluster) -> run.LocalExecutor:
    """torchrun with one rank per GPU (or ``procs_per_node`` CPU ranks) on this machine, running
    the checkout in place."""
    if task.nodes != 1:
        raise ValueError(f"task {task.name}: the local executor runs on one node, not {task.nodes}")
    # No shell expands the values here: extend PYTHONPATH now.
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return run.LocalExecutor(
        ntasks_per_node=task.procs_per_node,
        launcher="torchrun",
        env_vars=job_env(task, cluster, pythonpath),
    )


def slurm_executor(
    task: TaskSpec,
    cluster: Cluster,
    time: str,
    *,
    launcher: bool = True,
    heterogeneous: bool = False,
) -> run.SlurmExecutor:
    """A Slurm executor for ``task``: torchrun over ``task.nodes`` nodes (c10d rendezvous on the
    head node), or one plain task per node (``launcher=False``)."""
    nproc = task.procs_per_node
    gpu = bool(task.gpus_per_node)
    exclusive = cluster.exclusive if cluster.exclusive is not None else gpu
    # Only the trainer saves on a signal: other jobs (rollout servers, conversions) would die of it.
    trainer = task.command.argv[:3] == ("python", "-m", TRAIN_MODULE)
    env = job_env(task, cluster, f"{cluster.code_root()}${{PYTHONPATH:+:$PYTHONPATH}}")
    return run.SlurmExecutor(
        account=cluster.account,
        # Slurm job name <prefix><task>; NeMo-Run reads the task back after the last ".".
        job_name_prefix="ngrpo.",
        partition=cluster.partition,
        time=cluster.time or time,
        nodes=task.nodes,
        ntasks_per_node=nproc if launcher else 1,
        torchrun_nproc_per_node=nproc if launcher else None,
        gpus_per_node=task.gpus_per_node or None,
        exclusive=exclusive or None,
        mem=cluster.mem if cluster.mem is not None else ("0" if gpu else None),
        container_image=cluster.container_image,
        container_mounts=cluster.mounts(),
        env_vars={**env, **(stop_signal_env(task, cluster) if trainer else {}), **cluster.env},
        signal=f"USR1@{signal_lead(task, cluster)}" if trainer else None,
        launcher=run.Torchrun(rdzv_port=cluster.rdzv_port, rdzv_id=RDZV_ID) if launcher else None,
        packager=cluster.packager_obj(),
        tunnel=run.LocalTunnel(job_dir=os.path.join(run.config.get_nemorun_home(), "experiments")),
        heterogeneous=heterogeneous,
        wait_time_for_group_job=cluster.group_start_wait,
        monitor_group_job_wait_time=cluster.group_monitor_wait,
        poll_estimated_start_time=False,
    )


def runs_preflight(task: TaskSpec) -> bool:
    """Jobs that get the pre-flight check: the trainer's (its config is the one checked) and a
    disaggregated job's rollout servers (``--server``: their vLLM, GPUs and weights)."""
    return task.command.argv[:3] in (
        ("python", "-m", TRAIN_MODULE),
        ("python", "-m", ROLLOUT_SERVER),
    )


def preflight_argv(task: TaskSpec) -> tuple[str, ...]:
    """The pre-flight's options for ``task``: the trainer's config, or the server's model."""
    argv = task.command.argv
    if argv[:3] == ("python", "-m", ROLLOUT_SERVER):
        return (
            "--gpus",
            str(task.gpus_per_node),
            "--server",
            "--model",
            argv[argv.index("--model") + 1],
        )
    world = str(task.nodes * task.procs_per_node)
    return ("--gpus", str(task.gpus_per_node), "--world-size", world, *argv[3:])


def preflight_line(
    task: TaskSpec, cluster: Cluster, job_dir: str, het_group: int | None = None
) -> str:
    """The sbatch line that runs :mod:`megatron_ngrpo.launch.preflight` once on every node of
    ``task``, as its ranks will run (same container, mounts and code), before torchrun starts: a
    failing node prints its one line and the job ends without requeueing."""
    check = ("python", "-m", PREFLIGHT_MODULE, *preflight_argv(task))
    srun = [
        "srun",
        *([f"--het-group={het_group}"] if het_group is not None else []),
        f"--nodes={task.nodes}",
        "--ntasks-per-node=1",
    ]
    if cluster.container_image:
        srun += [
            "--container-image",
            cluster.container_image,
            "--container-mounts",
            ",".join([*cluster.mounts(), f"{job_dir}:/nemo_run"]),
            "--container-workdir",
            "/nemo_run/code",
        ]
    else:
        srun += [
            "--chdir",
            os.path.join(job_dir, "code") if cluster.packager == "git" else str(REPO),
        ]
    return (
        f"{shlex.join([*srun, *check])} || "
        "{ echo 'pre-flight failed (the line above): torchrun not started'; exit 1; }"
    )
