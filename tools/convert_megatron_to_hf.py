#!/usr/bin/env python
"""Megatron -> HF: ``ngrpo-convert megatron-to-hf`` (megatron_ngrpo/conversion/cli.py), kept for the
tools/ layout.

    python tools/convert_megatron_to_hf.py --input CKPT_OR_RUN_DIR --output HF_OUT [--hf-source HF_DIR] [--dtype bfloat16]
"""

import sys

from megatron_ngrpo.conversion.cli import megatron_to_hf

if __name__ == "__main__":
    sys.exit(megatron_to_hf())
