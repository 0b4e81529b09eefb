"""Weight versions to the rollout servers (``RemoteEngine.sync_weights``).

The HF-named tensors (the one mapping, ``conversion.hf_export.export_hf_tensors``, gathered to
rank 0 one parameter at a time; every rank drives the export) reach every live server in buckets
of ``bucket_mb``. ``weight_transfer: http`` (the fallback): safetensors bytes through
``/collective_rpc``, the last bucket loads them (``reload_weights``), then
``/update_weight_version``. ``gloo`` / ``nccl``: vLLM's weight-transfer API, the same trainer
engine as the colocated route (:class:`~megatron_ngrpo.rollout.vllm.weight_transfer.WeightSender`,
one per server on a thread of its own, all fed by one export, whose client is vLLM's
``HTTPVLLMWeightSyncClient`` over the authenticated session). Every wait has a deadline (the
sender's stages ``train.dist_timeout_s`` each, the fan-out's queue and join that plus the
request timeout), each expiry one line naming the server and the stage. After a failure rank 0
still drains the export, then every rank raises the same one-line error.
"""

from __future__ import annotations

import base64
import queue
import socket
import threading
import time

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.conversion.hf_export import export_hf_tensors
from megatron_ngrpo.parallel import broadcast_from_rank0, collective_timeout, is_rank0
from megatron_ngrpo.rollout.config import RemoteConfig
from megatron_ngrpo.rollout.remote.http import (
    CallFailed,
    RolloutServerError,
    ServerHTTP,
    on_all,
    short,
)
from megatron_ngrpo.rollout.vllm import wire


class ServerWeights:
    """The weight pushes of one client: ``http`` its calls, ``group`` its collectives (None: one
    rank); ``workers``: url → the server's vLLM TP (the workers of one transfer)."""

    def __init__(self, cfg: RemoteConfig, spec: ArchSpec, http: ServerHTTP, group):
        self.cfg, self.spec, self.http, self.group = cfg, spec, http, group
        self.workers: dict[str, int] = {}
        self.version = -1  # the version being pushed (the senders' finish_weight_update)
        self._senders: dict = {}  # url → WeightSender (weight_transfer gloo / nccl)

    def push(self, model_chunks, servers: list[str], version: int) -> dict:
        """Push the model as weight version ``version`` to ``servers`` (collective: every rank
        drives the export; rank 0 sends); the sync's figures (``last_sync``)."""
        self.version = version
        if self.cfg.weight_transfer != "http":
            return self._transfer(model_chunks, servers)
        return self._over_http(model_chunks, servers)

    def _over_http(self, model_chunks, servers: list[str]) -> dict:
        """Safetensors buckets through the worker extension's ``nbr_server_receive``."""
        t0 = time.perf_counter()
        limit, bucket, size, index = self.cfg.bucket_mb * 2**20, [], 0, 0
        stats = {"num_params": 0, "bytes": 0, "tensors": 0, "verified": 0, "load_seconds": 0.0}
        error = None

        def push(named, last):
            data = base64.b64encode(wire.pack_tensors(named, self.cfg.verify_weights)).decode()
            t = time.perf_counter()
            answers = on_all(
                servers,
                "weight push",
                lambda url: self.http.rpc(url, "nbr_server_receive", data, index, int(last)),
            )
            if last:
                on_all(
                    servers,
                    "weight version",
                    lambda url: self.http.post(
                        url, "/update_weight_version", json={"new_version": str(self.version)}
                    ),
                )
                stats["load_seconds"] = time.perf_counter() - t
                stats["verified"] = min(a["verified"] for a in answers)

        # Every rank drives the export (collectives inside); only rank 0 receives tensors. After
        # a failure rank 0 still drains it, then every rank raises the same error.
        for name, t in export_hf_tensors(model_chunks, self.spec, rank0_only=True):
            stats["tensors"] += 1
            stats["num_params"] += t.numel()
            stats["bytes"] += t.numel() * t.element_size()
            if bucket and size + t.numel() * t.element_size() > limit and error is None:
                try:
                    push(bucket, last=False)
                except RolloutServerError as e:
                    error = str(e)
                bucket, size, index = [], 0, index + 1
            if error is None:
                bucket.append((name, t))
                size += t.numel() * t.element_size()
        if is_rank0() and error is None:
            try:
                push(bucket, last=True)
            except RolloutServerError as e:
                error = str(e)
        error, stats = broadcast_from_rank0((error, stats), self.group)
        if error:
            raise RolloutServerError(error)
        return {**stats, "buckets": index + 1, "seconds": time.perf_counter() - t0}

    def _transfer(self, model_chunks, servers: list[str]) -> dict:
        """vLLM's weight-transfer API: one export for all servers (every rank drives it), which
        rank 0 fans out to one sender thread per live server (:class:`_Fan`); after a failure the
        others finish, then every rank raises the first one-line error."""
        # lazy: keeps rollout.remote.weights free of vllm at import (start-up)
        from megatron_ngrpo.rollout.vllm.weight_transfer import MegatronSource

        t0 = time.perf_counter()
        layout = MegatronSource(model_chunks, self.spec).metadata()  # vLLM's engines read it
        export = export_hf_tensors(model_chunks, self.spec, rank0_only=True)
        stats, error = {}, None
        if is_rank0():
            deadline_s = collective_timeout().total_seconds() + self.cfg.request_timeout_s
            fans = [_Fan(url, self._sender(url), layout, deadline_s) for url in servers]
            for item in export:
                for fan in fans:
                    fan.put(item)
            for fan in fans:
                fan.close()
                if fan.error is None:
                    stats = fan.stats
                elif error is None:
                    self._senders.pop(fan.url).close()
                    e = fan.error
                    error = (
                        e
                        if isinstance(e, RolloutServerError)
                        else f"rollout server {fan.url}: weight transfer failed: {short(e)}"
                    )
        else:
            for _ in export:  # the other ranks' share of the collectives
                pass
        error, stats = broadcast_from_rank0((str(error) if error else None, stats), self.group)
        if error:
            raise RolloutServerError(error)
        verified = stats["tensors"] if self.cfg.verify_weights else 0
        return {
            "num_params": stats["params"],
            "bytes": stats["bytes"],
            "tensors": stats["tensors"],
            "verified": verified,
            "buckets": stats.get("buckets", 0),
            "load_seconds": stats["seconds"],
            "seconds": time.perf_counter() - t0,
        }

    def _sender(self, url: str):
        """The :class:`~megatron_ngrpo.rollout.vllm.weight_transfer.WeightSender` of server ``url``
        (rank 0; built on its first sync)."""
        # lazy: weight_transfer imports vllm (heavy), only for the gloo / nccl routes
        from megatron_ngrpo.rollout.vllm.weight_transfer import WeightSender

        if url not in self._senders:
            self._senders[url] = WeightSender(
                self._weight_client(url),
                self.cfg.weight_transfer,
                self.cfg.bucket_mb * 2**20,
                self.cfg.verify_weights,
                num_workers=self.workers.get(url, 1),
                host=self.cfg.transfer_host or socket.gethostname(),
                secret=self.http.secret,
            )
        return self._senders[url]

    def _weight_client(self, url: str):
        """vLLM's ``HTTPVLLMWeightSyncClient`` for ``url`` with the rollout client's timeouts,
        one-line errors naming the server, and the pushed weight version at ``finish``."""
        # lazy: vLLM is an optional extra (heavy import)
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        weights = self

        class Client(HTTPVLLMWeightSyncClient):
            def _post(self, path: str, json: dict | None = None) -> None:
                try:
                    weights.http.post(url, f"/{path}", json=json)
                except CallFailed as e:
                    raise RolloutServerError(
                        f"rollout server {url}: weight transfer {path} failed: {e}"
                    ) from None

            def finish_weight_update(self, weight_version: str | None = None) -> None:
                super().finish_weight_update(str(weights.version))

            def prove_workers(self, nonce: str) -> list:
                """Every worker's answer to the ``nccl`` route's challenge
                (rollout/vllm/nccl_transfer.py).."""
                try:
                    return weights.http.post(
                        url,
                        "/collective_rpc",
                        json={"method": "nbr_server_prove", "args": [nonce]},
                    )["results"]
                except CallFailed as e:
                    raise RolloutServerError(
                        f"rollout server {url}: weight transfer nccl proof failed: {e}"
                    ) from None

        return Client(url, self.cfg.request_timeout_s)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders = {}


class _Fan:
    """One server's share of a fanned-out export: its sender runs on a thread of its own and
    reads the tensors from a queue of at most ``_FAN_DEPTH`` (references to the export's own
    tensors: the extra memory is a few tensors plus each sender's bucket, not a model per
    server). A sender that failed stops reading; :meth:`put` then skips it. A sender that takes
    no tensor, or does not finish, within ``deadline_s`` is given up (its thread left behind)."""

    def __init__(self, url: str, sender, layout: list, deadline_s: float):
        self.url, self.stats, self.error, self.deadline_s = url, {}, None, deadline_s
        self.queue: queue.Queue = queue.Queue(_FAN_DEPTH)
        self.thread = threading.Thread(target=self._run, args=(sender, layout), daemon=True)
        self.thread.start()

    def _run(self, sender, layout) -> None:
        try:
            self.stats = sender.send(_Stream(iter(self.queue.get, None), layout))
        except Exception as e:  # noqa: BLE001 - reported by the caller
            if self.error is None:
                self.error = e

    def put(self, item) -> None:
        give_up = time.monotonic() + self.deadline_s
        while self.thread.is_alive() and self.error is None:
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                if time.monotonic() > give_up:
                    self._stuck("took no tensor")

    def close(self) -> None:
        self.put(None)
        self.thread.join(self.deadline_s if self.error is None else 0)
        if self.thread.is_alive():
            self._stuck("did not finish")

    def _stuck(self, what: str) -> None:
        self.error = self.error or RolloutServerError(
            f"rollout server {self.url}: weight transfer: the sender {what} within "
            f"{self.deadline_s:g} s (train.dist_timeout_s + rollout.remote.request_timeout_s)"
        )


_FAN_DEPTH = 4


class _Stream:
    """A one-pass vLLM ``WeightSource``: rank 0's share of an export (``export_hf_tensors`` with
    ``rank0_only``, read once by the sender) and the whole model's layout, computed beforehand on
    every rank (a collective of the PP group)."""

    def __init__(self, named, layout: list):
        self.named, self.layout = named, layout

    def metadata(self) -> list:
        return self.layout

    def __iter__(self):
        return iter(self.named)
