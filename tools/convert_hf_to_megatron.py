#!/usr/bin/env python
"""HF -> Megatron: ``ngrpo-convert hf-to-megatron`` (megatron_ngrpo/conversion/cli.py), kept for the
tools/ layout.

    python tools/convert_hf_to_megatron.py --input HF_DIR --output OUT [--tp 2 --pp 2] [--dtype bfloat16]
"""

import sys

from megatron_ngrpo.conversion.cli import hf_to_megatron

if __name__ == "__main__":
    sys.exit(hf_to_megatron())
