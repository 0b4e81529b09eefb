"""The bucket format the project's weight-transfer engines share (``gloo``,
rollout/vllm/weight_transfer.py; ``nccl``, rollout/vllm/nccl_transfer.py), both sides, and the
bounded helper thread every wait of a transfer runs on.

A bucket is the tensors of up to ``bucket_bytes`` packed into one flat ``uint8`` buffer, each at a
multiple of 16 bytes; its update info (names, dtypes, shapes and, with ``verify``, each tensor's
SHA-256) travels over the authenticated control route before the buffer travels over the backend.
The worker checks the digests before it loads anything (one-line :class:`WeightSyncError` naming
the tensor) and loads the bucket's views with ``model.load_weights`` inside vLLM's layerwise
reload (as vLLM's ``ipc`` engine does).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import torch
from vllm.distributed.weight_transfer import base

from megatron_ngrpo.rollout.vllm.wire import digest, first_mismatch

_ALIGN = 16  # byte alignment of each tensor in a packed bucket (any dtype view is legal)


class WeightSyncError(RuntimeError):
    """A weight transfer that failed: a tensor that arrived different from what the trainer sent,
    a peer that did not prove the key, a stage past its deadline (one line)."""


@dataclass
class BucketUpdateInfo(base.WeightTransferUpdateInfo):
    """One bucket: the tensors packed in order, each at a multiple of 16 bytes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    digests: list[str] | None = None


def _layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[int], int]:
    """Byte offsets of the tensors in a bucket and its total size."""
    offsets, size = [], 0
    for dt, shape in zip(dtypes, shapes):
        offsets.append(size)
        n = torch.Size(shape).numel() * dt.itemsize
        size += -(-n // _ALIGN) * _ALIGN
    return offsets, size


def _views(buf: torch.Tensor, dtypes, shapes, offsets) -> list[torch.Tensor]:
    return [
        buf[o : o + torch.Size(s).numel() * dt.itemsize].view(dt).view(s)
        for o, dt, s in zip(offsets, dtypes, shapes)
    ]


class _Staging:
    """The sender's reused bucket buffer on ``device``: a fresh multi-MiB tensor for every bucket
    costs the page faults of zero-filled pages at every sync (~1 ms per M fp32 params here), more
    than the copy into it. The receiver cannot reuse one: vLLM's layerwise reload keeps the loaded
    tensors (views of the bucket) until each layer is complete, some until the reload ends."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.buf = torch.empty(0, dtype=torch.uint8, device=device)

    def get(self, size: int) -> torch.Tensor:
        if self.buf.numel() < size:
            self.buf = torch.empty(size, dtype=torch.uint8, device=self.buf.device)
        return self.buf[:size]


def in_thread(fn, *args):
    """Run ``fn(*args)`` on a daemon helper thread (on the caller's CUDA device); the returned
    ``join(timeout_s, stage)`` waits at most ``timeout_s`` and returns its result, re-raises its
    error, or raises a one-line :class:`WeightSyncError` naming ``stage`` when the deadline passes
    (the thread is left behind: a call blocked in a library cannot be cancelled)."""
    out: dict = {}
    # CUDA's current device is per thread: the helper runs on the caller's (NCCL, its streams)
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def run():
        try:
            if device is not None:
                torch.cuda.set_device(device)
            out["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()

    def join(timeout_s: float, stage: str):
        th.join(timeout_s)
        if th.is_alive():
            raise WeightSyncError(
                f"{stage}: no answer within {timeout_s:g} s (train.dist_timeout_s)"
            )
        if "error" in out:
            raise out["error"]
        return out.get("result")

    return join


def begin_reload(model) -> None:
    """Open a sync of ``model``'s weights in buckets (vLLM's layerwise reload: each layer is
    processed once all its tensors arrived; the receiver holds a bucket, not the model)."""
    # lazy: vLLM internals, resolved inside the worker
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def load_bucket(model, named: list[tuple[str, torch.Tensor]]) -> None:
    """Load one bucket of HF-named tensors inside :func:`begin_reload` / :func:`end_reload`."""
    # lazy: vLLM internals, resolved inside the worker
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    with disable_mtp_completeness_check():
        model.load_weights(named)


def end_reload(model, model_config) -> None:
    """Close the sync (layers no bucket touched get their previous weights back)."""
    # lazy: vLLM internals, resolved inside the worker
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


class BucketReceiver:
    """vLLM worker side of a bucket engine (a mixin before ``base.WeightTransferEngine``): the
    subclass's ``_receive(size)`` returns the bucket's buffer as the backend delivered it."""

    def start_weight_update(self) -> None:
        begin_reload(self.model)

    def finish_weight_update(self) -> None:
        end_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on CPU.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # Close vLLM's layerwise reload (the worker ends the session on errors): untouched
            # layers get their previous weights back, so the next full sync can start.
            self.finish_weight_update()
            raise
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: BucketUpdateInfo) -> None:
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        offsets, size = _layout(dtypes, update_info.shapes)
        buf = self._receive(size)  # a fresh one: see _Staging
        tensors = self._unpack(buf, dtypes, update_info.shapes, offsets)
        if update_info.digests is not None:
            bad = first_mismatch(
                zip(update_info.names, tensors), dict(zip(update_info.names, update_info.digests))
            )
            if bad:
                raise WeightSyncError(bad)
        load_bucket(self.model, list(zip(update_info.names, tensors)))

    def _unpack(self, buf, dtypes, shapes, offsets) -> list[torch.Tensor]:
        return _views(buf, dtypes, shapes, offsets)


class BucketSender:
    """Trainer side of a bucket engine (a mixin before ``base.TrainerWeightTransferEngine``):
    sends the source in buckets of ``self.info.bucket_bytes`` (staged in ``self.staging``),
    each with its update info posted on a helper thread while the subclass's ``_transmit(buf)``
    sends the buffer (both sides meet in the same backend call); ``self.info.timeout_s`` bounds
    every wait."""

    def send_weights(self) -> None:
        stats = {"tensors": 0, "params": 0, "bytes": 0, "buckets": 0}
        self.client.start_weight_update()
        bucket, size = [], 0
        for name, t in self.source:
            n = t.numel() * t.element_size()
            if bucket and size + n > self.info.bucket_bytes:
                self._send(bucket, stats)
                bucket, size = [], 0
            bucket.append((name, t.detach()))
            size += n
            stats["tensors"] += 1
            stats["params"] += t.numel()
            stats["bytes"] += n
        if bucket:
            self._send(bucket, stats)
        self.client.finish_weight_update()
        self.stats = stats

    def _send(self, bucket: list[tuple[str, torch.Tensor]], stats: dict) -> None:
        dtypes = [t.dtype for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        offsets, size = _layout(dtypes, shapes)
        buf = self.staging.get(size)
        for view, (_, t) in zip(_views(buf, dtypes, shapes, offsets), bucket):
            view.copy_(t)
        info = BucketUpdateInfo(
            names=[n for n, _ in bucket],
            dtype_names=[str(d).split(".")[-1] for d in dtypes],
            shapes=shapes,
            digests=[digest(t) for _, t in bucket] if self.info.verify else None,
        )
        join = in_thread(self.client.update_weights, asdict(info))
        self._transmit(buf)
        join(self.info.timeout_s, f"update_weights of bucket {stats['buckets']}")
        stats["buckets"] += 1
