"""megatron_ngrpo: N-GRPO (semantic neighbour mixing) on megatron-core."""

import importlib.util

from setuptools import find_packages, setup

# The requirements live in megatron_ngrpo/pins.py (the pre-flight check and the job image read
# them there too); loaded by path (setup.py runs in its own folder): installing must not import
# the package.
_spec = importlib.util.spec_from_file_location("megatron_ngrpo_pins", "megatron_ngrpo/pins.py")
pins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pins)

setup(
    name="megatron_ngrpo",
    version="0.1.0",
    description="N-GRPO: GRPO with semantic neighbour mixing, at Megatron scale",
    packages=find_packages(include=["megatron_ngrpo", "megatron_ngrpo.*"]),
    python_requires=">=3.11",
    install_requires=pins.INSTALL_REQUIRES,
    extras_require=pins.EXTRAS,
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
