#!/usr/bin/env bash
# One prepared GPU check (issue #29 item 14; scripts/gpu_smoke.py says what it runs): a tiny Qwen2
# in bf16, 2 GRPO steps with mixing on the built-in engine, colocated vLLM TP 1 in sleep mode,
# refused routes, peak memory vs the plan; one summary table, exit status 1 if a stage failed.
#   bash scripts/gpu_smoke.sh [--cpu] [--skip STAGE ...] [--work DIR]
# On a machine without network the packages it lacks come from .whl/ (scripts/gpu_smoke_wheels.sh
# fills it here; it travels with the checkout), installed into /tmp/site, not into the system.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null && ! python3 -c "import megatron.core" 2>/dev/null; then
  if python3 -m pip --version >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  else  # a venv without pip: a wheel is a zip of its site-packages files
    for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false CUDA_DEVICE_MAX_CONNECTIONS=1 \
  VLLM_USE_V2_MODEL_RUNNER=0
exec python3 scripts/gpu_smoke.py "$@"
