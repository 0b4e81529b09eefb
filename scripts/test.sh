#!/usr/bin/env bash
# Fresh machine → everything installed → the whole test suite. (README's second command.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The real pretrained model of the real-model tests (SmolLM2-135M-Instruct, built once, cached).
bash scripts/setup_real_model.sh
export OMP_NUM_THREADS=1
exec python3 -m pytest -q -p no:cacheprovider tests "$@"
