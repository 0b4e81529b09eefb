"""Rollout client: the trainer's engine when vLLM runs on other nodes (``rollout.engine=remote``).

:class:`RemoteEngine` implements :class:`~megatron_ngrpo.rollout.types.RolloutEngine` against
the rollout servers of :mod:`megatron_ngrpo.rollout.server` (``rollout.remote``: their URLs, or
the directory a hetjob's servers register in). Global rank 0 is the only rank that talks to
them; every method is a collective of all ranks, and an error on rank 0 is raised on every rank
(no rank is left waiting in a collective). Those collectives run on a gloo group of the engine's
own (CPU objects need no device copies, and a one-step-off producer generating on a second
thread, ``training/async_rollout.py``, never pairs them with the trainer's collectives).

* Start-up (the constructor), one-line errors before training starts: a server that does not
  answer within ``start_timeout_s``, a server that is not an N-GRPO rollout server or runs
  without the mixing hook, a vLLM other than the minor version the hook was written for, a wire
  protocol or model (vocabulary, hidden size, ``num_real_tokens``) other than the trainer's.
* ``generate``: every rank's ``(key, prompt)`` requests are gathered and de-duplicated (the
  ranks of a data-parallel group ask for the same prompts), split into one contiguous slice per
  live server, sent concurrently, and every rank keeps its own responses. A request that fails
  (connection lost, timeout, server error) is retried once on the next live server (the failed
  one is dropped for the rest of the run); a second failure is a one-line error naming the
  server. Every HTTP call has a connect and a request timeout: a dead or hung server never
  hangs the trainer.
* ``sync_weights``: a new weight version. The HF-named tensors (the one mapping,
  ``conversion.mapping.export_hf_tensors``, gathered to rank 0 one parameter at a time) reach
  every live server in buckets of ``bucket_mb``. ``weight_transfer: http`` (the fallback):
  safetensors bytes over HTTP, the last bucket loads them into vLLM (``reload_weights``).
  ``gloo`` / ``nccl``: vLLM's weight-transfer API, the same trainer engine as the colocated
  route (:class:`~megatron_ngrpo.rollout.weight_transfer.WeightSender`, one per server, whose
  client is the server's ``/transfer`` routes); the tensors travel over the backend from rank 0
  to the server's worker (``transfer_host``: where the servers reach rank 0). With
  ``verify_weights`` each server checks a SHA-256 per tensor (http, gloo).
* ``set_neighbor_table``: the trainer's table of the current weight version, shipped to every
  server as int32 ``[V, k]`` (≈1.8 MB for a 152k vocabulary with k = 3).
* ``sleep`` / ``wake_up``: no-ops (the servers' memory is not the trainer's).
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.parallel import broadcast_from_rank0, is_rank0
from megatron_ngrpo.rollout import wire
from megatron_ngrpo.rollout.config import RemoteConfig
from megatron_ngrpo.rollout.replicas import gather_requests
from megatron_ngrpo.rollout.types import RolloutBatch, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)


class RolloutServerError(RuntimeError):
    """A rollout server that cannot be used; the message is one line naming it."""


class _Failed(Exception):
    """One failed HTTP call (``retry``: worth another try)."""

    def __init__(self, message: str, retry: bool = True):
        super().__init__(message)
        self.retry = retry


class RemoteEngine(RolloutEngine):
    """Rollouts on the servers of ``cfg`` for a policy of architecture ``spec``
    (:class:`~megatron_ngrpo.architecture.ArchSpec`) sampling ids ``< num_real_tokens``."""

    def __init__(self, cfg: RemoteConfig, spec, num_real_tokens: int):
        self.cfg, self.spec, self.num_real_tokens = cfg, spec, int(num_real_tokens)
        # Weight version the servers hold; each sync makes the next one. Starting from the
        # newest a server reports lets a resumed trainer reuse running servers.
        self.version = -1
        self.last_sync: dict = {}
        self.servers: list[str] = []
        self._sessions: dict = {}
        self._senders: dict = {}  # url → WeightSender (weight_transfer gloo / nccl)
        self._workers: dict[str, int] = {}  # url → the server's vLLM TP (workers of one transfer)
        multi = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if multi else None
        error = None
        if is_rank0():
            try:
                self.servers, self.version = self._start()
            except RolloutServerError as e:
                error = str(e)
        self.servers, self.version, error = broadcast_from_rank0((self.servers, self.version, error), self.group)
        if error:
            raise RolloutServerError(error)
        logger.info("rollout servers: %s", ", ".join(self.servers))

    @classmethod
    def from_config(cls, rollout_cfg, model_cfg) -> "RemoteEngine":
        from megatron_ngrpo.architecture import ArchSpec

        spec = ArchSpec.from_hf(model_cfg.hf_path)
        return cls(rollout_cfg.remote, spec, model_cfg.num_real_tokens or spec.vocab_size)

    # ---- start-up ---------------------------------------------------------------------------
    def _start(self) -> tuple[list[str], int]:
        """The checked servers' URLs and the newest weight version among them."""
        deadline = time.monotonic() + self.cfg.start_timeout_s
        urls = list(self.cfg.urls) or self._registered(deadline)
        infos = [self._version(url, deadline) for url in urls]
        for url, info in zip(urls, infos):
            self.check(url, info)
            self._workers[url] = int(info.get("tensor_parallel", 1))
        return urls, max(int(i["weight_version"]) for i in infos)

    def _registered(self, deadline: float) -> list[str]:
        """The URLs the servers wrote to ``url_dir`` (a hetjob's training group may start first)."""
        folder, want = Path(self.cfg.url_dir), self.cfg.num_servers
        while True:
            files = sorted(folder.glob("*.url")) if folder.is_dir() else []
            if len(files) >= want:
                return [f.read_text().strip() for f in files]
            if time.monotonic() > deadline:
                raise RolloutServerError(
                    f"rollout servers: {len(files)} of {want} registered in {folder} after "
                    f"{self.cfg.start_timeout_s:g} s (rollout.remote.start_timeout_s)")
            time.sleep(0.5)

    def _version(self, url: str, deadline: float) -> dict:
        """``GET /version``, retried until ``deadline`` while nothing answers (still starting)."""
        while True:
            try:
                r = self._session(url).get(f"{url}/version", timeout=self._timeouts())
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RolloutServerError(f"rollout server {url}: unreachable after "
                                             f"{self.cfg.start_timeout_s:g} s ({_short(e)})") from None
                time.sleep(0.5)
                continue
            try:
                info = r.json() if r.status_code == 200 else None
            except ValueError:
                info = None
            if not isinstance(info, dict) or info.get("server") != wire.SERVER_NAME:
                raise RolloutServerError(
                    f"rollout server {url}: not an N-GRPO rollout server, so no mixing hook (GET "
                    f"/version: HTTP {r.status_code}); start `python -m megatron_ngrpo.rollout.server`")
            return info

    def check(self, url: str, info: dict) -> None:
        """One-line :class:`RolloutServerError` unless the server answering ``GET /version`` with
        ``info`` can serve this trainer."""
        from megatron_ngrpo.rollout.vllm_engine import SUPPORTED_VLLM

        if not str(info.get("hook", "")).startswith("NeighborMix"):
            raise RolloutServerError(f"rollout server {url}: vLLM runs without the mixing hook "
                                     f"(model runner {info.get('hook')!r})")
        if not str(info.get("vllm", "")).startswith(SUPPORTED_VLLM + "."):
            raise RolloutServerError(f"rollout server {url}: vLLM {info.get('vllm')}, but the mixing hook "
                                     f"is written for vLLM {SUPPORTED_VLLM}.x")
        if info.get("protocol") != wire.PROTOCOL:
            raise RolloutServerError(f"rollout server {url}: wire protocol {info.get('protocol')}, "
                                     f"this trainer speaks {wire.PROTOCOL} (different code versions)")
        route = self.cfg.weight_transfer
        if route != "http" and info.get("weight_transfer") != route:
            raise RolloutServerError(f"rollout server {url}: weight-transfer backend "
                                     f"{info.get('weight_transfer')!r}, the trainer sends with {route!r} "
                                     f"(start the servers with --weight-transfer {route}, or "
                                     f"rollout.remote.weight_transfer=http)")
        ours = {"vocab_size": self.spec.vocab_size, "hidden_size": self.spec.hidden_size,
                "num_real_tokens": self.num_real_tokens}
        for key, value in ours.items():
            if info.get(key) != value:
                raise RolloutServerError(f"rollout server {url}: serves a model with {key} = "
                                         f"{info.get(key)}, the trainer's is {value}")

    # ---- HTTP -------------------------------------------------------------------------------
    def _timeouts(self) -> tuple[float, float]:
        return self.cfg.connect_timeout_s, self.cfg.request_timeout_s

    def _session(self, url: str):
        import requests

        if url not in self._sessions:
            self._sessions[url] = requests.Session()
        return self._sessions[url]

    def _post(self, url: str, route: str, **kwargs) -> dict:
        """One POST; raises :class:`_Failed` with a short reason."""
        import requests

        try:
            r = self._session(url).post(f"{url}{route}", timeout=self._timeouts(), **kwargs)
        except requests.Timeout:
            raise _Failed(f"no answer within {self.cfg.request_timeout_s:g} s "
                          f"(rollout.remote.request_timeout_s)") from None
        except OSError as e:
            raise _Failed(_short(e)) from None
        if r.status_code != 200:
            try:
                reason = r.json().get("error", r.text)
            except ValueError:
                reason = r.text
            # A bad request fails the same way everywhere; a server error or a stale weight
            # version (409) may pass on another try.
            raise _Failed(f"HTTP {r.status_code}: {_short(reason)}",
                          retry=r.status_code >= 500 or r.status_code == 409)
        return r.json()

    def _on_all(self, route: str, **kwargs) -> list[dict]:
        """POST to every live server concurrently, each retried once; one-line error otherwise."""
        def call(url):
            try:
                return self._post(url, route, **kwargs)
            except _Failed as first:
                if not first.retry:
                    raise RolloutServerError(f"rollout server {url}: {route} failed: {first}") from None
                try:
                    return self._post(url, route, **kwargs)
                except _Failed as e:
                    raise RolloutServerError(f"rollout server {url}: {route} failed twice: {e}") from None

        with ThreadPoolExecutor(len(self.servers)) as pool:
            return list(pool.map(call, self.servers))

    # ---- RolloutEngine ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, mixing=None,
                 keys: list[int] | None = None) -> RolloutBatch:
        """As :meth:`RolloutEngine.generate`; a collective of all ranks in a multi-rank job."""
        params.validate()
        mixing = mixing if mixing is not None and mixing.enabled else None
        keys = list(range(len(prompts))) if keys is None else [int(k) for k in keys]
        if len(keys) != len(prompts):
            raise ValueError(f"generate: {len(keys)} keys for {len(prompts)} prompts")
        by_key = gather_requests(prompts, keys, self.group) if self.group is not None else dict(zip(keys, prompts))
        result = None
        if is_rank0():
            ordered = sorted(by_key)
            try:
                result = (ordered, self._spread([by_key[k] for k in ordered], ordered, params, mixing))
            except RolloutServerError as e:
                result = str(e)
        result = broadcast_from_rank0((result, self.servers), self.group)
        result, self.servers = result
        if isinstance(result, str):
            raise RolloutServerError(result)
        ordered, batch = result
        where = {k: i for i, k in enumerate(ordered)}
        return batch.select_prompts([where[k] for k in keys])

    def _spread(self, prompts, keys, params: SamplingParams, mixing) -> RolloutBatch:
        """One contiguous slice of the prompts per live server, concurrently; responses in order."""
        import dataclasses

        if not prompts:
            return RolloutBatch([], [], [], [], MixRecord.empty(0, mixing.k if mixing is not None else 1), [])
        servers = list(self.servers)
        per = -(-len(prompts) // len(servers))
        slices = [(i, prompts[s:s + per], keys[s:s + per]) for i, s in enumerate(range(0, len(prompts), per))]
        base = {"params": dataclasses.asdict(params), "weight_version": self.version,
                "mixing": None if mixing is None else dataclasses.asdict(mixing)}

        def call(item):
            i, p, k = item
            body = {**base, "prompts": p, "keys": k}
            url = servers[i]
            try:
                return self._post(url, "/generate", json=body)
            except _Failed as first:
                if not first.retry:
                    raise RolloutServerError(f"rollout server {url}: generate failed: {first}") from None
                others = [s for s in self.servers if s != url]
                retry = others[i % len(others)] if others else url
                if others:
                    self.servers = others  # drop it for the rest of the run
                logger.warning("rollout server %s: generate failed (%s); retrying on %s", url, first, retry)
                try:
                    return self._post(retry, "/generate", json=body)
                except _Failed as e:
                    after = "twice" if retry == url else f"after {url} failed ({first})"
                    raise RolloutServerError(f"rollout server {retry}: generate failed {after}: {e}") from None

        with ThreadPoolExecutor(len(slices)) as pool:
            answers = list(pool.map(call, slices))
        return RolloutBatch.cat([wire.batch_from_json(a) for a in answers])

    def sync_weights(self, model_chunks) -> None:
        """Push the trainer's weights to every live server as weight version ``self.version + 1``
        (collective: every rank drives the export; rank 0 sends)."""
        from megatron_ngrpo.conversion.mapping import export_hf_tensors

        self.version += 1
        if self.cfg.weight_transfer != "http":
            self._transfer_weights(model_chunks)
            return
        t0 = time.perf_counter()
        limit, bucket, size, index = self.cfg.bucket_mb * 2**20, [], 0, 0
        stats = {"num_params": 0, "bytes": 0, "tensors": 0, "verified": 0, "load_seconds": 0.0}
        error = None

        def push(named, last):
            data = wire.pack_tensors(named, self.cfg.verify_weights)
            answers = self._on_all(f"/sync?version={self.version}&bucket={index}&last={int(last)}",
                                   data=data, headers={"Content-Type": "application/octet-stream"})
            if last:
                stats["load_seconds"] = max(a["load_seconds"] for a in answers)
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
        self.last_sync = {**stats, "buckets": index + 1, "seconds": time.perf_counter() - t0}

    def _transfer_weights(self, model_chunks) -> None:
        """``sync_weights`` through vLLM's weight-transfer API: rank 0 sends the export to each
        live server in turn (every rank drives each export; after a failure rank 0 drains it,
        then every rank raises the same one-line error)."""
        from megatron_ngrpo.conversion.mapping import export_hf_tensors
        from megatron_ngrpo.rollout.weight_transfer import MegatronSource, WeightSender

        t0 = time.perf_counter()
        layout = MegatronSource(model_chunks, self.spec).metadata()  # vLLM's engines read it
        stats, error = {}, None
        # self.servers is the same list on every rank: rank 0's changes are broadcast where made.
        for url in list(self.servers):
            export = export_hf_tensors(model_chunks, self.spec, rank0_only=True)
            if is_rank0() and error is None:
                if url not in self._senders:
                    self._senders[url] = WeightSender(
                        _ServerWeightClient(self, url), self.cfg.weight_transfer, self.cfg.bucket_mb * 2**20,
                        self.cfg.verify_weights, num_workers=self._workers.get(url, 1),
                        host=self.cfg.transfer_host or socket.gethostname(), timeout_s=self.cfg.request_timeout_s)
                try:
                    stats = self._senders[url].send(_Stream(export, layout))
                except Exception as e:  # noqa: BLE001 - reported on every rank as one line
                    self._senders.pop(url).close()
                    error = e if isinstance(e, RolloutServerError) else \
                        f"rollout server {url}: weight transfer failed: {_short(e)}"
            for _ in export:  # the other ranks' share of the collectives (rank 0: after a failure)
                pass
        error, stats = broadcast_from_rank0((str(error) if error else None, stats), self.group)
        if error:
            raise RolloutServerError(error)
        verified = stats["tensors"] if self.cfg.verify_weights else 0
        self.last_sync = {"num_params": stats["params"], "bytes": stats["bytes"], "tensors": stats["tensors"],
                          "verified": verified, "buckets": stats.get("buckets", 0),
                          "load_seconds": stats["seconds"], "seconds": time.perf_counter() - t0}

    def set_neighbor_table(self, table: torch.Tensor) -> None:
        """Ship the trainer's ``[V, k]`` table of the current weight version to every server."""
        error = None
        if is_rank0():
            data = wire.pack_tensors([("table", table.to(torch.int32))])
            try:
                self._on_all(f"/neighbor_table?version={self.version}", data=data,
                             headers={"Content-Type": "application/octet-stream"})
            except RolloutServerError as e:
                error = str(e)
        error = broadcast_from_rank0(error, self.group)
        if error:
            raise RolloutServerError(error)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders = {}
        for s in self._sessions.values():
            s.close()
        self._sessions = {}


class _ServerWeightClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over one server's ``/transfer`` routes (what
    ``LLMClient`` is for an in-process engine)."""

    def __init__(self, engine: RemoteEngine, url: str):
        self.engine, self.url = engine, url

    def _step(self, step: str, body: dict) -> None:
        try:
            self.engine._post(self.url, f"/transfer/{step}", json=body)
        except _Failed as e:
            raise RolloutServerError(f"rollout server {self.url}: weight transfer {step} failed: {e}") from None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._step("init", init_info)

    def start_weight_update(self) -> None:
        self._step("start", {})

    def update_weights(self, update_info: dict) -> None:
        self._step("update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._step("finish", {"version": self.engine.version})


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


def _short(e) -> str:
    """One line of an exception or response text, without urllib3's nested reprs."""
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:200] + "..."
