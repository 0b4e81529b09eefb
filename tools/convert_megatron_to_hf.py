#!/usr/bin/env python
"""Convert a Megatron checkpoint (or the ``latest`` one of a trainer run directory) into an HF
directory: safetensors shards + model.safetensors.index.json, config.json, tokenizer and
generation_config files.

    python tools/convert_megatron_to_hf.py --input CKPT_OR_RUN_DIR --output HF_OUT [--hf-source HF_DIR] [--dtype bfloat16]

The checkpoint is loaded in layout TP × PP (default 1 × 1, one process; any saved layout loads).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from megatron_ngrpo.conversion import cli
    from megatron_ngrpo.conversion.convert import convert_megatron_to_hf

    p = cli.parser(__doc__, "Megatron checkpoint or run directory (with latest)", "HF directory to create",
                   "output dtype (default: the checkpoint's)")
    p.add_argument("--hf-source", default=None,
                   help="HF directory to copy tokenizer / generation_config from (default: the checkpoint's copies)")
    p.add_argument("--max-shard-gb", type=float, default=2.0)
    return cli.main(__file__, argv, p, convert_megatron_to_hf, lambda a: dict(
        hf_source=a.hf_source, max_shard_bytes=int(a.max_shard_gb * 1024**3)))


if __name__ == "__main__":
    sys.exit(main())
