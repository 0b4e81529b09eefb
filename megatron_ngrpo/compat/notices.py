"""Libraries' notices of a CPU-only install, silenced in this process and the processes it starts.

Megatron-core warns on import that Transformer Engine and apex are missing (always true on a CPU
machine, and its local fallbacks are what the CPU path runs), and megatron's and torch's
dist-checkpointing code raise deprecation notices about their own internals: none says anything
about this project's run. The CPU entry points (the demo, the benchmarks) call
:func:`quiet_cpu_notices` first; the test suite keeps its own filters in ``pytest.ini``. The
training and launch entry points do not: on a GPU machine a missing Transformer Engine is worth
seeing. No megatron import here: the filters must be in place before megatron's modules warn.
"""

from __future__ import annotations

import os
import re
import warnings

# (message prefix, category); an empty prefix takes every warning of that category: every
# FutureWarning, since those on the CPU path are the libraries' own (megatron's, torch's and
# vLLM's deprecations of their internals; pytest.ini lists the same sources).
CPU_NOTICES = (
    ("Transformer Engine and Apex", UserWarning),
    ("Apex is not installed", UserWarning),
    ("full scope is deprecated", UserWarning),
    ("", FutureWarning),
)


def quiet_cpu_notices() -> None:
    """Ignore :data:`CPU_NOTICES` here and, through ``PYTHONWARNINGS``, in child processes
    (torchrun workers, launched jobs)."""
    specs = [f"ignore:{message}:{category.__name__}" for message, category in CPU_NOTICES]
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [os.environ.get("PYTHONWARNINGS"), *specs])
    )
    for message, category in CPU_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
