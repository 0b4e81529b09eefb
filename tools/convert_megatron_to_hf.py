#!/usr/bin/env python
"""Convert a Megatron checkpoint (or the ``latest`` one of a trainer run directory) into an HF
directory: safetensors shards + model.safetensors.index.json, config.json, tokenizer and
generation_config files.

    python tools/convert_megatron_to_hf.py --input CKPT_OR_RUN_DIR --output HF_OUT [--hf-source HF_DIR] [--dtype bfloat16]

The checkpoint is loaded in layout TP × PP (default 1 × 1, one process; any saved layout loads).
"""

from __future__ import annotations

import argparse
import sys


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="Megatron checkpoint or run directory (with latest)")
    p.add_argument("--output", required=True, help="HF directory to create")
    p.add_argument("--hf-source", default=None,
                   help="HF directory to copy tokenizer / generation_config from (default: the checkpoint's copies)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="output dtype (default: the checkpoint's)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--max-shard-gb", type=float, default=2.0)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from megatron_ngrpo.config_loader import ConfigError
    from megatron_ngrpo.conversion import cli
    from megatron_ngrpo.conversion.convert import check_args, convert_megatron_to_hf

    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    try:
        check_args(a.input, a.output, a.tp, a.pp, a.vpp, a.dtype, a.overwrite, world=a.tp * a.pp)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return cli.run(__file__, argv, a.tp * a.pp, convert_megatron_to_hf, src=a.input, out=a.output,
                   dtype=a.dtype, hf_source=a.hf_source, tp=a.tp, pp=a.pp, vpp=a.vpp,
                   overwrite=a.overwrite, max_shard_bytes=int(a.max_shard_gb * 1024**3),
                   progress=not a.no_progress)


if __name__ == "__main__":
    sys.exit(main())
