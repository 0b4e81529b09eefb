#!/usr/bin/env python
"""Convert an HF checkpoint (Qwen2 / Llama / Qwen3) — or reshard a Megatron checkpoint or run
directory — into a Megatron checkpoint written from layout TP × PP (× VPP).

    python tools/convert_hf_to_megatron.py --input HF_DIR --output OUT [--tp 2 --pp 2] [--dtype bfloat16]

With TP × PP > 1 it relaunches itself under torchrun (or run it under torchrun yourself).
"""

from __future__ import annotations

import argparse
import sys


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="HF directory, Megatron checkpoint or run directory (with latest)")
    p.add_argument("--output", required=True, help="Megatron checkpoint directory to create")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="parameter dtype (default float32 from HF, unchanged from Megatron)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None)
    p.add_argument("--num-real-tokens", type=int, default=None)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from megatron_ngrpo.config_loader import ConfigError
    from megatron_ngrpo.conversion import cli
    from megatron_ngrpo.conversion.convert import check_args, convert_hf_to_megatron

    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    try:
        check_args(a.input, a.output, a.tp, a.pp, a.vpp, a.dtype, a.overwrite, world=a.tp * a.pp)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return cli.run(__file__, argv, a.tp * a.pp, convert_hf_to_megatron, src=a.input, out=a.output,
                   tp=a.tp, pp=a.pp, vpp=a.vpp, dtype=a.dtype,
                   make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                   num_real_tokens=a.num_real_tokens, overwrite=a.overwrite, progress=not a.no_progress)


if __name__ == "__main__":
    sys.exit(main())
