#!/usr/bin/env bash
# One prepared GPU check (issue #29 item 14; scripts/gpu_smoke.py says what it runs): a tiny Qwen2
# in bf16, 2 GRPO steps with mixing on the built-in engine, colocated vLLM TP 1 in sleep mode,
# refused routes, peak memory vs the plan; one summary table, exit status 1 if a stage failed.
#   bash scripts/gpu_smoke.sh [--cpu] [--skip STAGE ...] [--work DIR]
# On a machine without network the packages it lacks come from .whl/ (scripts/gpu_smoke_wheels.sh
# fills it here; it travels with the checkout), installed into /tmp/site, not into the system.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_site.sh
export VLLM_USE_V2_MODEL_RUNNER=0
exec python3 scripts/gpu_smoke.py "$@"
