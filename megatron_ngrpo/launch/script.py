"""What the user launch scripts (launchers/*.py) call: one recipe's training on Slurm with the
site's settings, then the script's own command line (``--dryrun``, more ``ngrpo-launch run``
options, ``a.b=c`` overrides), so that it wins."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_ngrpo.launch import cli, recipes
from megatron_ngrpo.launch.executors import REPO


def slurm(
    recipe: str,
    *,
    account: str,
    partition: str | None,
    container_image: str | None = None,
    mounts: Sequence[str] = (),
    env: dict[str, str | None] | None = None,
    models_dir: str = "/models",
    nodes: int | None = None,
    overrides: Sequence[str] = (),
    disaggregated: bool = False,
    rollout_nodes: int | None = None,
    argv: Sequence[str] = (),
) -> int:
    """``ngrpo-launch run RECIPE --executor slurm --config <the recipe's YAML> ...``; returns its
    exit code. ``env``: a value of None passes this environment's (``--env NAME``)."""
    args = [
        "run",
        recipe,
        "--executor",
        "slurm",
        "--config",
        str(REPO / recipes.get(recipe).config),
    ]
    args += ["--account", account, "--models-dir", models_dir]
    args += ["--partition", partition] if partition else []
    args += ["--container-image", container_image] if container_image else []
    args += [a for m in mounts for a in ("--mount", m)]
    # None: passed through from this environment, not written into the script (credentials).
    args += [a for k, v in (env or {}).items() for a in ("--env", k if v is None else f"{k}={v}")]
    args += ["--nodes", str(nodes)] if nodes else []
    args += ["--disaggregated"] if disaggregated else []
    args += ["--rollout-nodes", str(rollout_nodes)] if rollout_nodes else []
    return cli.main([*args, *overrides, *argv])
