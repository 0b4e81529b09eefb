"""CPU compatibility layer for megatron-core (used only when no GPU is present).

Why this exists: megatron-core calls ``torch.cuda.current_device()`` in ~175 places and hard-codes
``device="cuda"`` / ``.cuda()`` in many more (optimizer, pipeline schedules, KV cache, checkpoint
save). On a CPU-only machine nearly everything after ``initialize_model_parallel`` then fails with
"Torch not compiled with CUDA enabled". To run the real megatron-core code paths on CPU (tests,
CI, the tiny default job) we redirect those calls here instead of forking megatron-core:

* ``torch.cuda`` query/stream/event/RNG functions become CPU no-ops or CPU equivalents;
* one ``TorchFunctionMode`` rewrites ``device="cuda"`` in factory calls, makes ``Tensor.cuda()`` the
  identity, keeps ``.to("cuda")`` on CPU, drops ``pin_memory`` and makes ``Tensor.type()`` report
  ``torch.cuda.*Tensor`` (megatron asserts that in ``clip_grads.py`` and the optimizers);
* a CPU RNG tracker replaces ``CudaRNGStatesTracker`` (which reads the CUDA RNG state);
* megatron's advice to set ``CUDA_DEVICE_MAX_CONNECTIONS`` (a CUDA queue setting) is not printed.

``torch.cuda.is_available()`` stays False so code that branches on it still sees the truth.
Call :func:`install` once per process, before building models; it is a no-op when CUDA exists.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import layers
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE: _CudaToCpuMode | None = None
_THREAD = threading.local()  # .no_fork: this thread's RNG-tracker forks leave the generator alone

_FACTORIES = {
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.arange,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.tensor,
    torch.as_tensor,
    torch.empty_like,
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.linspace,
    torch.eye,
    torch.empty_strided,
    torch.randperm,
    torch.normal,
    torch.sparse_coo_tensor,
}
_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(dev) -> bool:
    if dev is None:
        return False
    if isinstance(dev, int):
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Keeps every tensor megatron-core asks to place on "cuda" on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES or getattr(func, "__name__", "") in (
            "new_empty",
            "new_zeros",
            "new_ones",
            "new_full",
            "new_tensor",
        ):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
        elif func is torch.Tensor.cuda:
            return args[0]
        elif func is torch.Tensor.pin_memory:
            return args[0]
        elif func is torch.Tensor.is_pinned:
            return False
        elif func is torch.Tensor.to:
            args = tuple(
                "cpu" if _is_cuda_device(a) and not isinstance(a, int) else a for a in args
            )
            if (
                args
                and len(args) > 1
                and isinstance(args[1], int)
                and not isinstance(args[1], bool)
            ):
                args = (args[0], "cpu") + args[2:]
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
        elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _TYPE_NAMES.get(args[0].dtype, func(*args))
        return func(*args, **kwargs)


class _DummyStream:
    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _DummyEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DummyEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.set_stream = lambda *a, **k: None
    cuda.Stream = _DummyStream
    cuda.Event = _DummyEvent
    cuda.current_stream = lambda *a, **k: _DummyStream()
    cuda.default_stream = lambda *a, **k: _DummyStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    for name in (
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
    ):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.get_rng_state = cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda state, *a, **k: torch.set_rng_state(
        state
    )
    # Not torch.manual_seed: megatron calls both, and redirecting recurses. The lazy CUDA seeding
    # is already a no-op without CUDA.


class CpuRNGStatesTracker(CudaRNGStatesTracker):
    """Drop-in for megatron's ``CudaRNGStatesTracker`` backed by ``torch.Generator`` on CPU.

    ``fork(name)`` swaps the default CPU generator's state for the named stream, like the CUDA
    tracker does with the CUDA generator, so dropout inside TP regions gets per-rank streams.
    """

    def __init__(self):
        super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=False)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        if getattr(_THREAD, "no_fork", False):
            yield
            return
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _install_rng_tracker() -> None:
    tracker = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recomputation saves and restores the "CUDA" RNG state through these two helpers
    # (and torch.cuda.random's functions, which are not torch.cuda's): the CPU generator here.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # Its backward re-runs the forward on autograd's thread, where the (thread-local) redirect
    # mode is not active: enter it there too.
    recompute_backward = mrandom.CheckpointFunction.backward

    def backward(ctx, *grads):
        with _CudaToCpuMode():
            return recompute_backward(ctx, *grads)

    mrandom.CheckpointFunction.backward = staticmethod(backward)


def cpu_model_parallel_seed(seed: int, *args, **kwargs) -> None:
    """Same stream layout as megatron's ``model_parallel_cuda_manual_seed`` (data-parallel seed,
    ``seed + 2718 + tp_rank`` for TP regions, an expert stream), on CPU generators."""

    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + 100 * ep_rank + tp_rank + 1
    )


def install() -> bool:
    """Install the CPU redirections once per process. Returns True when they are active."""
    global _INSTALLED, _MODE
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    _patch_torch_cuda()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _install_rng_tracker()
    _quiet_cuda_queue_advice()
    _INSTALLED = True
    return True


def _quiet_cuda_queue_advice() -> None:
    """Megatron's TP linear layers advise, once per process, ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    (the order of CUDA's hardware queues): nothing to set on CPU, so the advice is marked given."""

    layers.linear_with_grad_accumulation_and_async_allreduce.warned = True


@contextlib.contextmanager
def background_thread():
    """Enter on a second thread that runs eval-mode megatron forwards (the one-step-off rollout
    producer): the redirect mode is thread-local, so it is entered here too; and the RNG
    tracker's forks on this thread leave the process-wide CPU generator alone, since swapping it
    would race with the main thread's draws (eval-mode forwards draw nothing)."""
    _THREAD.no_fork = True
    try:
        with _CudaToCpuMode() if _INSTALLED else contextlib.nullcontext():
            yield
    finally:
        _THREAD.no_fork = False


def is_active() -> bool:
    return _INSTALLED


def bypass():
    """Context in which torch calls skip the redirect mode: for hot code that makes many small
    torch calls and none that needs redirecting (the mixing embedding's ~40 per step). The
    mode's Python hook costs ~2–4 µs a call, a few % of a small step. A no-op where the shim is
    not installed (on GPU nothing is bypassed)."""
    return torch._C.DisableTorchFunction() if _INSTALLED else contextlib.nullcontext()


def device() -> torch.device:
    """The device models and batches live on: the local GPU, or the CPU under this shim."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
