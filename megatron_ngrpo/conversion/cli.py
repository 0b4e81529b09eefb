"""The conversion command lines, both directions:

    ngrpo-convert hf-to-megatron --input HF_DIR --output OUT [--tp 2 --pp 2] [--dtype bfloat16]
    ngrpo-convert megatron-to-hf --input CKPT_OR_RUN_DIR --output HF_OUT [--hf-source HF_DIR] [--dtype bfloat16]

(also ``python -m megatron_ngrpo.conversion ...``; ``tools/convert_*.py`` are thin wrappers). Their
common options (:func:`parser`), the argument check before any process starts and the torchrun
relaunch (:func:`run`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from megatron_ngrpo.config_loader import ConfigError

HF_TO_MEGATRON = """Convert an HF checkpoint (Qwen2 / Llama / Qwen3) — or reshard a Megatron checkpoint or run
directory — into a Megatron checkpoint written from layout TP × PP (× VPP).

With TP × PP > 1 it relaunches itself under torchrun (or run it under torchrun yourself)."""

MEGATRON_TO_HF = """Convert a Megatron checkpoint (or the ``latest`` one of a trainer run directory) into an HF
directory: safetensors shards + model.safetensors.index.json, config.json, tokenizer and
generation_config files.

The checkpoint is loaded in layout TP × PP (default 1 × 1, one process; any saved layout loads)."""


def run(command: str, argv: list[str], nproc: int, fn, **kwargs) -> int:
    """Run ``fn(**kwargs)`` in a process group of ``nproc`` ranks: as is under torchrun (or for
    one rank), else by relaunching ``python -m megatron_ngrpo.conversion COMMAND ARGV`` under
    torchrun. Bad input → one line on stderr, exit 2."""
    # lazy: torch and megatron load only once the arguments are known to be good (a usage error answers at once)
    import torch.distributed as dist

    # lazy: keeps conversion.cli free of torch at import (start-up)
    from megatron_ngrpo.conversion.mapping import ConversionError
    from megatron_ngrpo.parallel import is_rank0, launched, local_torchrun

    # launched(), not "RANK" in the environment: a parent's single-process init leaves RANK=0 behind
    if nproc > 1 and not launched():
        cmd = [
            *local_torchrun(nproc),
            "-m",
            "megatron_ngrpo.conversion",
            command,
            *argv,
        ]
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


def parser(
    command: str, doc: str, input_help: str, output_help: str, dtype_help: str
) -> argparse.ArgumentParser:
    """The options of both directions: --input/--output, the TP × PP (× VPP) layout, --dtype,
    --overwrite, --no-progress; the caller adds its own."""
    p = argparse.ArgumentParser(
        prog=f"ngrpo-convert {command}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", required=True, help=input_help)
    p.add_argument("--output", required=True, help=output_help)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help=dtype_help
    )
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def _main(command: str, argv: list[str] | None, p: argparse.ArgumentParser, fn, extra) -> int:
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
    return run(
        command,
        argv,
        a.tp * a.pp,
        fn,
        src=a.input,
        out=a.output,
        tp=a.tp,
        pp=a.pp,
        vpp=a.vpp,
        dtype=a.dtype,
        overwrite=a.overwrite,
        progress=not a.no_progress,
        **extra(a),
    )


def hf_to_megatron(argv: list[str] | None = None) -> int:
    # lazy: convert imports torch and megatron-core; a usage error answers before them
    from megatron_ngrpo.conversion.convert import convert_hf_to_megatron

    p = parser(
        "hf-to-megatron",
        HF_TO_MEGATRON,
        "HF directory, Megatron checkpoint or run directory (with latest)",
        "Megatron checkpoint directory to create",
        "parameter dtype (default float32 from HF, unchanged from Megatron)",
    )
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None)
    p.add_argument("--num-real-tokens", type=int, default=None)
    return _main(
        "hf-to-megatron",
        argv,
        p,
        convert_hf_to_megatron,
        lambda a: dict(
            make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
            num_real_tokens=a.num_real_tokens,
        ),
    )


def megatron_to_hf(argv: list[str] | None = None) -> int:
    # lazy: convert imports torch and megatron-core; a usage error answers before them
    from megatron_ngrpo.conversion.convert import convert_megatron_to_hf

    p = parser(
        "megatron-to-hf",
        MEGATRON_TO_HF,
        "Megatron checkpoint or run directory (with latest)",
        "HF directory to create",
        "output dtype (default: the checkpoint's)",
    )
    p.add_argument(
        "--hf-source",
        default=None,
        help="HF directory to copy tokenizer / generation_config from (default: the checkpoint's copies)",
    )
    p.add_argument("--max-shard-gb", type=float, default=2.0)
    return _main(
        "megatron-to-hf",
        argv,
        p,
        convert_megatron_to_hf,
        lambda a: dict(hf_source=a.hf_source, max_shard_bytes=int(a.max_shard_gb * 1024**3)),
    )


COMMANDS = {"hf-to-megatron": hf_to_megatron, "megatron-to-hf": megatron_to_hf}


def main(argv: list[str] | None = None) -> int:
    """``ngrpo-convert COMMAND ARGS``: COMMAND is hf-to-megatron or megatron-to-hf."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(__doc__.split("\n\n(")[0])
            return 0
        print(
            f"error: ngrpo-convert: expected a command ({', '.join(COMMANDS)}), got "
            f"{argv[0] if argv else 'none'!r}",
            file=sys.stderr,
        )
        return 2
    return COMMANDS[argv[0]](argv[1:])
