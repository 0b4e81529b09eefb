"""What a Slurm job reads and writes outside its job folder, checked when it is launched.

* The run directory (``train.run_dir``) must be absolute: a Slurm job runs in its own job folder
  (the packaged code), so a relative one would put the checkpoints (~106 GB each at 7B) inside
  each experiment's folder, and a resubmission would never resume.
* In a container, every path the job reads (the HF model, a checkpoint to load, a tokenizer or
  data file given by absolute path) is mounted at the same path unless a ``--mount`` covers it
  already; a path it writes (the run directory, a conversion's output) must lie under a
  ``--mount``: the folder may not exist yet, and pyxis cannot mount what does not exist.

Each problem is one :class:`ConfigError` line naming the field and the value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatron_ngrpo.config_loader import ConfigError


@dataclass
class JobFiles:
    """Paths by the config field (or option) that names them."""

    reads: dict[str, str] = field(default_factory=dict)
    writes: dict[str, str] = field(default_factory=dict)


def train_files(configs: list[str], overrides: list[str]) -> JobFiles:
    """The training config's paths (files composed, not validated: they live on the cluster)."""
    # lazy: training.job_config imports torch; `ngrpo-launch` stays quick for other tasks
    from megatron_ngrpo.config_loader import compose
    from megatron_ngrpo.training.job_config import NGRPOConfig

    cfg = compose(NGRPOConfig, configs, overrides)
    reads = {
        "model.hf_path": cfg.model.hf_path,
        "tokenizer": cfg.tokenizer,
        "train.warmstart.path": cfg.train.warmstart.path,
        **{f"data.train[{i}].path": d.path for i, d in enumerate(cfg.data.train)},
        **{f"validation.benchmarks[{i}]": b for i, b in enumerate(cfg.validation.benchmarks)},
    }
    if cfg.train.load not in ("", "random"):
        reads["train.load"] = cfg.train.load
    # Registry names (tokenizer, benchmarks, datasets) and paths relative to the packaged code
    # travel with the code; only absolute paths are outside it.
    return JobFiles(
        reads={k: v for k, v in reads.items() if os.path.isabs(v)},
        writes={"train.run_dir": cfg.train.run_dir},
    )


def require_absolute(files: JobFiles) -> None:
    for name, path in files.writes.items():
        if not os.path.isabs(path):
            raise ConfigError(
                f"{name} = {path!r}: relative, so a Slurm job would write it inside its own job "
                f"folder and a resubmission would not resume: give an absolute path on shared "
                f"storage ({name}=/shared/...)"
            )


def _covered(path: str, mounts: list[str]) -> bool:
    """Whether ``path`` lies under the container side of one of ``mounts`` (SRC:DST[:FLAGS])."""
    for mount in mounts:
        parts = mount.split(":")
        dst = (parts[1] if len(parts) > 1 else parts[0]).rstrip("/") or "/"
        if path == dst or path.startswith(dst if dst == "/" else dst + "/"):
            return True
    return False


def container_mounts(mounts: list[str], files: JobFiles) -> list[str]:
    """``mounts`` plus each read path no mount covers, at the same path. Raises ConfigError for
    a written path no mount covers."""
    for name, path in files.writes.items():
        if not _covered(path, mounts):
            raise ConfigError(
                f"{name} = {path!r}: not under any --mount of the container, so the job would "
                f"write inside the container and lose it (add --mount SRC:DST covering it)"
            )
    extra = []
    for path in files.reads.values():
        if not _covered(path, [*mounts, *extra]):
            extra.append(f"{path}:{path}")
    return [*mounts, *extra]
