"""Shared driver of the conversion command lines (``tools/convert_*.py``): their common options
(:func:`parser`), the argument check before any process starts and the torchrun relaunch
(:func:`main`)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from megatron_ngrpo.config_loader import ConfigError


def run(script: str, argv: list[str], nproc: int, fn, **kwargs) -> int:
    """Run ``fn(**kwargs)`` in a process group of ``nproc`` ranks: as is under torchrun (or for
    one rank), else by relaunching ``script`` under torchrun. Bad input → one line on stderr, exit 2."""
    # lazy: keeps conversion.cli free of torch at import (start-up)
    import torch.distributed as dist

    # lazy: keeps conversion.cli free of torch at import (start-up)
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


def parser(doc: str, input_help: str, output_help: str, dtype_help: str) -> argparse.ArgumentParser:
    """The options of both directions: --input/--output, the TP × PP (× VPP) layout, --dtype,
    --overwrite, --no-progress; the caller adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--input", required=True, help=input_help)
    p.add_argument("--output", required=True, help=output_help)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None, help=dtype_help)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(script: str, argv: list[str] | None, p: argparse.ArgumentParser, fn, extra) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) with ``p``, check the arguments (one line,
    exit 2), then :func:`run` ``fn`` with the common options plus ``extra(args)``."""
    # lazy: keeps conversion.cli free of torch at import (start-up)
    from megatron_ngrpo.conversion.convert import check_args

    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    try:
        check_args(a.input, a.output, a.tp, a.pp, a.vpp, a.dtype, a.overwrite, world=a.tp * a.pp)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(script, argv, a.tp * a.pp, fn, src=a.input, out=a.output, tp=a.tp, pp=a.pp, vpp=a.vpp,
               dtype=a.dtype, overwrite=a.overwrite, progress=not a.no_progress, **extra(a))
