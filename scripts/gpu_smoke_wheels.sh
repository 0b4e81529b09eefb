#!/usr/bin/env bash
# Wheels for scripts/gpu_smoke.sh on a lent GPU machine without network: the packages the train
# path imports that such a machine lacks (it has torch, transformers and their dependencies),
# downloaded here into the git-ignored .whl/ folder, which travels with the checkout.
# Python 3.12, x86_64; --no-deps: each dependency is listed here (checked with
# `unzip -p .whl/X.whl '*/METADATA' | grep ^Requires-Dist`). About 4.2 MiB in all.
# The versions are the ones scripts/setup.sh installs and the tests run with.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  megatron-core==0.16.1              # cp312 manylinux_2_28 wheel; needs torch, numpy, packaging
  omegaconf==2.4.0                   # config_loader; needs PyYAML
  antlr4-python3-runtime==4.13.2     # latex2sympy2_extended's parser
  math-verify==0.9.0                 # the math grader
  latex2sympy2_extended==1.11.0      # math-verify's; needs sympy (torch brings it)
  psutil==7.2.2                      # megatron-core's checkpoint save (undeclared by it)
  einops==0.8.2                      # megatron-core (undeclared by it)
  datasets==5.2.0                    # data/datasets.py reads every training file through it
  dill==0.4.1                        # datasets'
  multiprocess==0.70.19              # datasets' (py312 wheel)
)
mkdir -p .whl
for spec in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done
du -sh .whl
