"""Shared pytest fixtures: the repository's data folder and a clean process-group state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_ngrpo.data.paths import REPO_DATA

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The data the tests read: the repository's own ``data/`` (never a folder beside it)."""
    if not REPO_DATA.is_dir():
        pytest.fail(f"data folder {REPO_DATA} missing from the checkout")
    return REPO_DATA


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct's HF folder (scripts/setup_real_model.sh builds it)."""
    from tests.harness.real_model import real_model_dir

    try:
        return real_model_dir()
    except FileNotFoundError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def single_rank():
    """A process group of this process alone and megatron's parallel state, TP = PP = 1 (the
    single-process value tests of tests/test_core_values_*.py)."""
    # lazy: the other modules' collection stays free of megatron-core
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel

    init_distributed()
    initialize_model_parallel(1, 1, None, seed=0)


@pytest.fixture(autouse=True, scope="module")
def _fresh_process_groups():
    """Each test module starts without process groups. An in-process vLLM engine owns a world
    group that it destroys when garbage-collected, which could otherwise happen in the middle of
    a later module's test; collect it here and reset torch.distributed / megatron's state."""
    yield
    import gc

    gc.collect()
    try:
        import torch.distributed as dist
    except ImportError:
        return
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
