"""``python -m launchers`` = ``ngrpo-launch``."""

import sys

from launchers.cli import main

sys.exit(main())
