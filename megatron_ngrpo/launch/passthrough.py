"""``--env`` of ``ngrpo-launch run``: values written into the job script, or names passed through.

``--env NAME=VALUE`` writes ``export NAME=VALUE`` into the rendered script, which NeMo-Run's
``set -evx`` also echoes into the job's ``sbatch_*.out``, and the value sits in the launcher's
``ps`` line: fine for ``NCCL_SOCKET_IFNAME=ib0``, not for a credential. ``--env NAME`` passes the
launcher's own value instead: sbatch (and a local job's torchrun) inherits the launcher's
environment, so the value reaches the job without being written anywhere; the script only
checks that it arrived. An inline value for a name that looks like a credential is refused.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from megatron_ngrpo.config_loader import ConfigError

# Names whose inline value is refused (case-insensitive, anywhere in the name).
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def split(
    items: list[tuple[str, str | None]], environ: Mapping[str, str] = os.environ
) -> tuple[dict[str, str], tuple[str, ...]]:
    """``--env`` items (``(NAME, VALUE)`` or ``(NAME, None)``) -> (values written into the
    script, names passed through). One :class:`ConfigError` line for a bad name, an inline
    credential, or a passed-through name the launcher's environment lacks."""
    values, names = {}, []
    for name, value in items:
        if not ENV_NAME.fullmatch(name):
            raise ConfigError(f"--env {name!r}: not an environment variable name")
        if value is None:
            if name not in environ:
                raise ConfigError(
                    f"--env {name}: not set in this environment (--env {name} passes the "
                    f"launcher's own value to the job)"
                )
            names.append(name)
        elif SECRET_NAME.search(name):
            raise ConfigError(
                f"--env {name}=...: looks like a credential, and an inline value is written into "
                f"the job script and its log; export {name} here and pass --env {name}"
            )
        else:
            values[name] = value
    return values, tuple(names)


def check_lines(names: tuple[str, ...]) -> list[str]:
    """Job-script lines that stop the job when a passed-through variable did not arrive; they
    print no value (the script runs under ``set -x``: ``${NAME+set}`` expands to ``set``)."""
    return [
        f'[ -n "${{{name}+set}}" ] || {{ echo "--env {name}: not in the job\'s environment '
        f"(passed through from the launcher's; sbatch's --export must keep it)\"; exit 1; }}"
        for name in names
    ]
