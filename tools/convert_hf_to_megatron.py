#!/usr/bin/env python
"""Convert an HF checkpoint (Qwen2 / Llama / Qwen3) — or reshard a Megatron checkpoint or run
directory — into a Megatron checkpoint written from layout TP × PP (× VPP).

    python tools/convert_hf_to_megatron.py --input HF_DIR --output OUT [--tp 2 --pp 2] [--dtype bfloat16]

With TP × PP > 1 it relaunches itself under torchrun (or run it under torchrun yourself).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from megatron_ngrpo.conversion import cli
    from megatron_ngrpo.conversion.convert import convert_hf_to_megatron

    p = cli.parser(__doc__, "HF directory, Megatron checkpoint or run directory (with latest)",
                   "Megatron checkpoint directory to create",
                   "parameter dtype (default float32 from HF, unchanged from Megatron)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None)
    p.add_argument("--num-real-tokens", type=int, default=None)
    return cli.main(__file__, argv, p, convert_hf_to_megatron, lambda a: dict(
        make_vocab_size_divisible_by=a.make_vocab_size_divisible_by, num_real_tokens=a.num_real_tokens))


if __name__ == "__main__":
    sys.exit(main())
