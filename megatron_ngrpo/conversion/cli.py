"""Shared driver of the conversion command lines (``tools/convert_*.py``)."""

from __future__ import annotations

import os
import subprocess
import sys


def run(script: str, argv: list[str], nproc: int, fn, **kwargs) -> int:
    """Run ``fn(**kwargs)`` in a process group of ``nproc`` ranks: as is under torchrun (or for
    one rank), else by relaunching ``script`` under torchrun. Bad input → one line on stderr, exit 2."""
    import torch.distributed as dist

    from megatron_ngrpo.config_loader import ConfigError
    from megatron_ngrpo.conversion.mapping import ConversionError
    from megatron_ngrpo.parallel import free_port, is_rank0

    if nproc > 1 and "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, *argv]
        return subprocess.call(cmd, env={"OMP_NUM_THREADS": "1", **os.environ})
    try:
        out = fn(**kwargs)
        if is_rank0():
            print(f"wrote {out}")
        return 0
    except (ConfigError, ConversionError, FileExistsError) as e:
        if is_rank0():
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
