#!/usr/bin/env bash
# What scripts/gpu_bench.sh needs on a lent GPU machine without network, into the git-ignored
# .whl/ folder that travels with the checkout (the device tool's `carry: [".whl"]`):
# - scripts/gpu_smoke_wheels.sh's wheels (megatron-core and the train path's small packages);
# - TRL and accelerate (bench_vs_trl's peer; the machine has transformers, datasets' dependencies
#   and torch), pure-Python wheels at the versions scripts/setup.sh installs;
# - .whl/smollm2-135m/: SmolLM2-135M-Instruct's config and tokenizer without the weights
#   (bench_vs_trl --random-weights initialises that shape), from scripts/setup_real_model.sh's
#   folder;
# - .whl/COMMIT: the commit (and whether the tree had changes) the results are recorded under.
# Run here before the device run; about 5 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/gpu_smoke_wheels.sh >/dev/null
for spec in trl==1.16.0 accelerate==1.15.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done
MODEL="$(python3 -c 'from tests.harness.real_model import real_model_dir; print(real_model_dir())')"
mkdir -p .whl/smollm2-135m
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  cp "$MODEL/$f" .whl/smollm2-135m/
done
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')" > .whl/COMMIT
du -sh .whl
