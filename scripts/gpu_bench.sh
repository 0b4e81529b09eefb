#!/usr/bin/env bash
# The prepared GPU benchmark of issue #38 (scripts/gpu_bench.py says what it runs): every GPU
# figure of the issue in one table with the device's name and the commit, written to
# bench/results/ (or --results DIR). Under 8 minutes on one H100 including set-up.
#   bash scripts/gpu_bench.sh [--dry] [--skip STAGE ...] [--results DIR] [--work DIR]
# --dry: every stage at a tiny size on CPU (tests/test_gpu_bench.py), to know the script works
# before a GPU is lent. Wheels, tokenizer and commit: bash scripts/gpu_bench_wheels.sh here first.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_site.sh
exec python3 scripts/gpu_bench.py "$@"
