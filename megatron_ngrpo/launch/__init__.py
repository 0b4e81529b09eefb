"""Launching jobs with NeMo-Run (local torchrun or Slurm)."""

import warnings

# NeMo-Run imports its Lepton executor's SDK, which imports a deprecated starlette module that
# warns (a UserWarning, so always shown) on import: not ours to act on, and it would open every
# launch's output.
warnings.filterwarnings(
    "ignore", message="starlette.middleware.wsgi is deprecated", category=UserWarning
)
