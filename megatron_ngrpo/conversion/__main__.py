"""``python -m megatron_ngrpo.conversion hf-to-megatron|megatron-to-hf ...`` (= ``ngrpo-convert``)."""

import sys

from megatron_ngrpo.conversion.cli import main

if __name__ == "__main__":
    sys.exit(main())
