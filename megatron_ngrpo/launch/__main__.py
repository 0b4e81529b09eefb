"""``python -m megatron_ngrpo.launch`` = ``ngrpo-launch``."""

import sys

from megatron_ngrpo.launch.cli import main

sys.exit(main())
