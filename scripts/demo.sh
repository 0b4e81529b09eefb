#!/usr/bin/env bash
# Fresh machine → everything installed → the main job: a real tiny N-GRPO training on CPU
# (TP=2 through the NeMo-Run local launcher). README's first command. Outputs under runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec python3 -m examples.tiny_ngrpo "$@"
