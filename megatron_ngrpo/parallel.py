"""Process-group set-up: torch.distributed from the torchrun environment, megatron-core model
parallel state, and the seeds of the model-parallel RNG streams.

gloo on CPU (with :mod:`megatron_ngrpo.compat.cpu` installed), NCCL on GPU.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

# How long a collective waits for the slowest rank (a long rollout on one data-parallel group, a
# checkpoint written by rank 0): the jobs' `train.dist_timeout_s` / `dist_timeout_s`. Every group
# of the job gets it: the project's (collective_timeout()), megatron's and vLLM's colocated ones
# (adopt_timeout after they are made); torch gives a group made without one its 30-min default.
DEFAULT_TIMEOUT_S = 1800
_timeout_s = DEFAULT_TIMEOUT_S

# NCCL flight recorder, dumped when a collective times out: each rank writes what it was waiting
# in to <trace prefix><rank>. torch reads these when a NCCL group is made; set where unset under
# any of their names, so the user's settings win; written under torch's newer TORCH_FR_* name
# (the older one prints a deprecation warning in every process, torch 2.11 and 2.13 alike).
NCCL_DEBUG_DEFAULTS = {
    ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000",
    ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
}
_TRACE_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")

# Names the port of the store a single-process init bound (init_distributed): torchrun variables
# naming that port were written by that init, not by a launcher.
SINGLE_PROCESS_PORT_VAR = "NGRPO_SINGLE_PROCESS_PORT"


def set_nccl_debug_defaults(trace_dir: str | None = None) -> None:
    """The flight-recorder defaults above; dumps go to ``trace_dir/nccl_trace_rank_<rank>`` (the
    run directory: node-local /tmp, torch's default, is gone with the allocation)."""
    defaults = dict(NCCL_DEBUG_DEFAULTS)
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        defaults[_TRACE_FILE] = os.path.join(os.path.abspath(trace_dir), "nccl_trace_rank_")
    for names, value in defaults.items():
        if not any(n in os.environ for n in names):
            os.environ[names[0]] = value


def init_distributed(timeout_s: int = DEFAULT_TIMEOUT_S, trace_dir: str | None = None) -> None:
    """Initialise the default process group from torchrun's environment variables (or a single
    process group of size 1 when they are absent), with collectives timing out after
    ``timeout_s`` and NCCL's flight recorder dumping to ``trace_dir`` on a timeout
    (:func:`set_nccl_debug_defaults`). Idempotent (the first call's settings stay)."""
    global _timeout_s
    # megatron is imported here, not at module level: processes that only need the rank helpers
    # below (CLIs failing on a config error, report writers) stay free of it.
    # lazy: keeps parallel free of megatron-core at import (start-up)
    from megatron_ngrpo.compat import cpu as cpu_compat

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        cpu_compat.install()
    if dist.is_initialized():
        return
    _timeout_s = timeout_s
    set_nccl_debug_defaults(trace_dir)
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if launched():
        defaults = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        for name, value in defaults.items():
            os.environ.setdefault(name, value)
        dist.init_process_group(backend=backend, timeout=collective_timeout())
        return
    # One process without a launcher: its store binds port 0 itself (a port picked free and bound
    # later can be taken in between). The torchrun variables are written for vLLM's external
    # launcher, which reads them, and marked as ours (SINGLE_PROCESS_PORT_VAR): a later init in
    # this process, or a child process inheriting them, would otherwise rendezvous on a port that
    # is still held (EADDRINUSE in CI).
    store = listening_store("127.0.0.1", 0, 1, collective_timeout())
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    os.environ[SINGLE_PROCESS_PORT_VAR] = str(store.port)
    dist.init_process_group(
        backend=backend, store=store, rank=0, world_size=1, timeout=collective_timeout()
    )


def listening_store(host: str, port: int, world_size: int, timeout: datetime.timedelta):
    """A master ``TCPStore`` listening on ``host``'s address only (``port`` 0: a free one).
    torch binds a master store to every interface whatever host it is given; a socket bound
    here and handed over (``master_listen_fd``) keeps it on the one interface."""
    sock = socket.create_server((host, port), backlog=128)
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=sock.detach(),  # the store owns the descriptor from here
    )


def launched() -> bool:
    """Whether the torchrun variables come from a launcher (torchrun, srun, a test harness), not
    from a single-process init of this process or of a parent (they name its port: stale here)."""
    if "RANK" not in os.environ and "MASTER_PORT" not in os.environ:
        return False
    ours = os.environ.get(SINGLE_PROCESS_PORT_VAR)
    return ours is None or os.environ.get("MASTER_PORT") != ours


def collective_timeout() -> datetime.timedelta:
    """The job's collective timeout: give it to every process group made (``dist.new_group``)."""
    return datetime.timedelta(seconds=_timeout_s)


def adopt_timeout() -> None:
    """Give every process group of this process the job's timeout: the groups a library made
    with torch's default (vLLM's colocated TP / PP / DP groups, one of megatron's)."""
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(collective_timeout(), group)


def initialize_model_parallel(
    tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234
) -> None:
    """(Re-)initialise megatron-core's parallel state with TP×PP (DP is what remains) and seed the
    model-parallel RNG streams; its groups time out like the default group. Safe to call
    repeatedly in one process to switch layouts."""
    # lazy: keeps parallel free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        _destroy_subgroups()
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        distributed_timeout_minutes=_timeout_s / 60,  # megatron makes timedelta(minutes=...): exact
    )
    adopt_timeout()  # megatron 0.16.1 makes EXPERT_DATA_PARALLEL_GROUP_GLOO without its timeout
    model_parallel_seed(seed)


def _destroy_subgroups() -> None:
    """Destroy every process group but WORLD. ``destroy_model_parallel`` only forgets megatron's
    groups; each gloo group keeps ~50 polling threads alive, so switching layouts many times in
    one process (tests) piled up thousands of threads."""
    c10d = dist.distributed_c10d
    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):
                pass


def duplicate_model_parallel_groups():
    """A megatron ``ProcessGroupCollection`` whose model-parallel groups (tp, pp, mp, cp, tp_cp,
    embd, pos_embd) are new groups over the same ranks as megatron's (collective: every rank
    calls it at the same point). Collectives on them never pair up with ones on megatron's
    groups, so a model built on them can run on a second thread while the first trains
    (training/async_rollout.py); the other groups are megatron's own."""
    # lazy: keeps parallel free of megatron-core at import (start-up)
    from megatron.core.process_groups_config import ProcessGroupCollection

    names = ("tp", "pp", "mp", "cp", "tp_cp", "embd", "pos_embd")
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    mine = {n: _members(getattr(pgs, n, None)) for n in names}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for n in names:
        # Every rank creates every distinct group of this kind, in one order, and keeps its own.
        kinds = sorted({tuple(m[n]) for m in everyone if m[n] is not None})
        groups = {
            ranks: dist.new_group(list(ranks), timeout=collective_timeout()) for ranks in kinds
        }
        if mine[n] is not None:
            setattr(pgs, n, groups[tuple(mine[n])])
    return pgs


def _members(group) -> list[int] | None:
    return dist.get_process_group_ranks(group) if isinstance(group, dist.ProcessGroup) else None


def model_parallel_seed(seed: int) -> None:
    """megatron's ``model_parallel_cuda_manual_seed`` on GPU, its CPU twin otherwise."""
    # lazy: keeps parallel free of megatron-core at import (start-up)
    from megatron_ngrpo.compat import cpu as cpu_compat

    if cpu_compat.is_active():
        cpu_compat.cpu_model_parallel_seed(seed)
    else:
        # lazy: keeps parallel free of megatron-core at import (start-up)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def is_rank0() -> bool:
    """Global rank 0, or no process group at all (a single process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def broadcast_from_rank0(obj, group: dist.ProcessGroup | None = None):
    """Global rank 0's ``obj`` on every rank of ``group`` (default: the world; ``group`` must
    hold global rank 0), ``obj`` itself without a process group: one decision for collective
    follow-ups that ranks must not take from their own data."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def barrier() -> None:
    """``dist.barrier()`` when a process group exists (a no-op in a single process)."""
    if dist.is_initialized():
        dist.barrier()


def free_port() -> int:
    """A free TCP port on the loopback interface (torchrun ports are random: fixed ones hit
    EADDRINUSE after a killed run)."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_torchrun(nproc: int) -> list[str]:
    """The command prefix of a single-node torchrun of ``nproc`` processes on a free loopback port
    (the script or ``-m module`` and its arguments follow)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]
