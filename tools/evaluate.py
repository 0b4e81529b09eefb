"""Evaluate a policy (or re-grade saved generations): ``ngrpo-eval`` / ``python -m megatron_ngrpo.eval``."""

import sys

from megatron_ngrpo.eval.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
