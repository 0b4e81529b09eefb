"""Rollout client: the trainer's engine when vLLM runs on other nodes (``rollout.engine=remote``).

:class:`RemoteEngine` implements :class:`~megatron_ngrpo.rollout.types.RolloutEngine` against
rollout servers: vLLM's OpenAI server (``vllm serve``) with the mixing hook's worker extension,
as :mod:`megatron_ngrpo.rollout.remote.server` starts it (``rollout.remote``: their URLs, or the
directory a hetjob's servers register in). Global rank 0 is the only rank that talks to them;
every method is a collective of all ranks, and an error on rank 0 is raised on every rank (no
rank is left waiting in a collective). Those collectives run on a gloo group of the engine's own
(CPU objects need no device copies, and a one-step-off producer generating on a second thread,
``training/async_rollout.py``, never pairs them with the trainer's collectives).

The routes are vLLM's: ``/health``, ``/version``, ``/weight_info``, ``/inference/v1/generate``
(token ids in, token ids and log-probs out), the weight-transfer routes, and ``/collective_rpc``
calling the worker extension's methods (rollout/remote/server_worker.py) for what vLLM has no route
for: the server's facts, the mix records, the neighbour table, HTTP weight pushes.

* Each server proves the job's shared secret before the client sends it anything, and every
  request then carries a MAC of a session derived from it (rollout/remote/auth.py; the servers
  refuse any other request, a replayed one included, with HTTP 401).
* Start-up (the constructor), one-line errors before training starts: no shared secret (or its
  file readable by others), a server that does not prove it, a server that does not answer within ``start_timeout_s``, a server that is not vLLM, a vLLM other than the minor
  version the hook was written for, a vLLM without the rollout worker extension or without the
  hook installed, a wire protocol or model (vocabulary, hidden size, ``num_real_tokens``) other
  than the trainer's, another weight-transfer backend.
* ``generate``: every rank's ``(key, prompt)`` requests are gathered and de-duplicated (the
  ranks of a data-parallel group ask for the same prompts), split into one contiguous slice per
  live server; each prompt is one request (``n`` children, opted into mixing by
  ``sampling_params.extra_args``, vLLM batches concurrent requests), then the slice's records are
  popped from the server's workers. Every token must come from the current weight version (vLLM
  reports it per response). A slice that fails (connection lost, timeout, server error, stale
  weights) is retried once on the next live server (the failed one is dropped for the rest of
  the run); a second failure is a one-line error naming the server. Every HTTP call has a
  connect and a request timeout (:mod:`~megatron_ngrpo.rollout.remote.http`): a dead or hung
  server never hangs the trainer.
* ``sync_weights``: a new weight version, the HF-named tensors pushed to every live server in
  buckets of ``bucket_mb`` (:mod:`~megatron_ngrpo.rollout.remote.weights`): ``weight_transfer:
  http`` (the fallback) through ``/collective_rpc``; ``gloo`` / ``nccl`` through vLLM's
  weight-transfer API, the tensors travelling over the backend from rank 0 to the server's
  worker (``transfer_host``: where the servers reach rank 0). With ``verify_weights`` each
  server checks a SHA-256 per tensor (http, gloo).
* ``set_neighbor_table``: the trainer's table of the current weight version, shipped to every
  server as int32 ``[V, k]`` (≈1.8 MB for a 152k vocabulary with k = 3).
* ``sleep`` / ``wake_up``: no-ops (the servers' memory is not the trainer's).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.parallel import broadcast_from_rank0, collective_timeout, is_rank0
from megatron_ngrpo.rollout.config import RemoteConfig
from megatron_ngrpo.rollout.remote.auth import ServerProofError, read_secret, registration_dir
from megatron_ngrpo.rollout.remote.http import (
    CallFailed,
    RolloutServerError,
    ServerHTTP,
    json_object,
    on_all,
    short,
)
from megatron_ngrpo.rollout.remote.weights import ServerWeights
from megatron_ngrpo.rollout.types import (
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    active_mixing,
    validate_request,
)
from megatron_ngrpo.rollout.vllm import wire
from megatron_ngrpo.rollout.vllm.protocol import (
    SUPPORTED_VLLM,
    hook_mix_record,
    request_options,
    sampling_options,
    supported_vllm,
)
from megatron_ngrpo.rollout.vllm.replicas import gather_requests

logger = logging.getLogger(__name__)


# The worker extension's method answering the server's facts (rollout/remote/server_worker.py).
INFO_METHOD = "nbr_server_info"


class RemoteEngine(RolloutEngine):
    """Rollouts on the servers of ``cfg`` for a policy of architecture ``spec``
    (:class:`~megatron_ngrpo.architecture.ArchSpec`) sampling ids ``< num_real_tokens``;
    ``tokenizer`` (optional) encodes ``mixing.stop_after``."""

    def __init__(self, cfg: RemoteConfig, spec, num_real_tokens: int, tokenizer=None):
        self.cfg, self.spec, self.num_real_tokens = cfg, spec, int(num_real_tokens)
        self.tokenizer = tokenizer
        # Weight version the servers hold; each sync makes the next one. Starting from the
        # newest a server reports lets a resumed trainer reuse running servers.
        self.version = -1
        self.max_model_len = 0  # the smallest of the servers'
        self.last_sync: dict = {}
        self.servers: list[str] = []
        self._noise: dict[str, tuple] = {}  # url → (weight version, STHT noise scale) it holds
        self._table_width: int | None = None  # k of the neighbour table the servers were sent
        multi = dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo", timeout=collective_timeout()) if multi else None
        self.http = ServerHTTP(cfg)  # the job's shared secret set by rank 0 at start-up
        self.weights = ServerWeights(cfg, spec, self.http, self.group)
        error, start = None, None
        if is_rank0():
            try:
                start = self._start()
            except RolloutServerError as e:
                error = str(e)
        start, error = broadcast_from_rank0((start, error), self.group)
        if error:
            raise RolloutServerError(error)
        self.servers, self.version, self.max_model_len = start
        logger.info("rollout servers: %s", ", ".join(self.servers))

    @classmethod
    def from_config(cls, rollout_cfg, model_cfg, tokenizer=None) -> RemoteEngine:
        spec = ArchSpec.from_hf(model_cfg.hf_path)
        return cls(
            rollout_cfg.remote, spec, model_cfg.num_real_tokens or spec.vocab_size, tokenizer
        )

    # ---- start-up ---------------------------------------------------------------------------
    def _start(self) -> tuple[list[str], int, int]:
        """The checked servers' URLs, the newest weight version among them, the smallest
        ``max_model_len``."""
        try:
            self.http.secret = read_secret(self.cfg.secret_file, self.cfg.url_dir)
            folder = registration_dir(self.cfg.url_dir) if not self.cfg.urls else None
        except ValueError as e:
            raise RolloutServerError(str(e)) from None
        deadline = time.monotonic() + self.cfg.start_timeout_s
        urls = list(self.cfg.urls) or self._registered(folder, deadline)
        infos = [self._info(url, deadline) for url in urls]
        for url, info in zip(urls, infos):
            self.check(url, info)
            self.weights.workers[url] = int(info.get("tensor_parallel", 1))
        return urls, max(i["weight_version"] for i in infos), min(i["max_model_len"] for i in infos)

    def _registered(self, folder: Path, deadline: float) -> list[str]:
        """The URLs of ``num_servers`` servers registered in this run's ``folder`` (a hetjob's
        training group may start first) that proved the job's secret; a registration whose server
        refuses the connection or fails the proof is stale (a killed server, another job's) and
        ignored until its file changes."""
        want, live, ignored = self.cfg.num_servers, set(), {}  # ignored: file → (mtime, reason)
        while True:
            for f in sorted(folder.glob("*.url")):
                try:
                    mtime, url = f.stat().st_mtime, f.read_text().strip()
                except OSError:
                    continue  # removed meanwhile (a server that stopped)
                if url in live or ignored.get(f, (None,))[0] == mtime:
                    continue
                reason = self._proven(url)
                if reason is None:
                    live.add(url)
                elif reason:
                    logger.warning("rollout servers: ignoring %s (%s)", f, reason)
                    ignored[f] = (mtime, reason)
            if len(live) >= want:
                return sorted(live)[:want]
            if time.monotonic() > deadline:
                stale = "".join(f"; ignored {f.name}: {why}" for f, (_, why) in ignored.items())
                raise RolloutServerError(
                    f"rollout servers: {len(live)} of {want} registered in {folder} after "
                    f"{self.cfg.start_timeout_s:g} s (rollout.remote.start_timeout_s){stale}"
                )
            time.sleep(0.5)

    def _proven(self, url: str) -> str | None:
        """None when the server at ``url`` proved the job's secret, else why not ("" when it may
        still answer: try again)."""
        # lazy: HTTP client of the remote engine only
        import requests

        try:
            self.http.session(url).auth.handshake()
        except ServerProofError as e:
            return f"did not prove the job's secret: {e}"
        except requests.Timeout:
            return ""
        except requests.ConnectionError as e:
            return f"unreachable, a stale registration ({short(e)})"
        except OSError:
            return ""
        return None

    def _info(self, url: str, deadline: float) -> dict:
        """The server's facts: vLLM's ``/version`` and ``/weight_info``, and the worker
        extension's ``nbr_server_info``; retried until ``deadline`` while nothing answers or the
        hook is not installed yet (still starting). The server proves the job's secret before
        the first request (:class:`~megatron_ngrpo.rollout.remote.auth.ClientAuth`)."""
        # lazy: HTTP client of the remote engine only
        import requests

        while True:
            try:
                r = self.http.session(url).get(f"{url}/version", timeout=self.http.timeouts())
            except ServerProofError as e:
                raise RolloutServerError(
                    f"rollout server {url}: did not prove the job's secret, so nothing was sent "
                    f"to it ({e})"
                ) from None
            except OSError as e:
                if time.monotonic() > deadline:
                    # a read timeout: the port took the connection (a hung or overloaded server)
                    hung = isinstance(e, requests.ReadTimeout)
                    raise RolloutServerError(
                        f"rollout server {url}: "
                        f"{'connected but never answered' if hung else 'unreachable'} after "
                        f"{self.cfg.start_timeout_s:g} s ({short(e)})"
                    ) from None
                time.sleep(0.5)
                continue
            if r.status_code == 401:
                raise RolloutServerError(
                    f"rollout server {url}: refused this client's requests (HTTP 401: "
                    f"{short(json_object(r).get('error', r.text))})"
                )
            found = json_object(r).get("version") if r.status_code == 200 else None
            if not isinstance(found, str):
                raise RolloutServerError(
                    f"rollout server {url}: not a vLLM server (GET /version: HTTP "
                    f"{r.status_code}); start `python -m megatron_ngrpo.rollout.remote.server`"
                )
            try:
                info = self.http.rpc(url, INFO_METHOD)
            except CallFailed as e:
                raise RolloutServerError(
                    f"rollout server {url}: vLLM {found} without the rollout worker extension, so no "
                    f"mixing hook (POST /collective_rpc: {e}); start `python -m megatron_ngrpo.rollout.remote.server`"
                ) from None
            if info.get("hook") is None and time.monotonic() < deadline:
                time.sleep(0.5)  # the launcher installs the hook once vLLM answers
                continue
            try:
                version = self.http.get(url, "/weight_info")["weight_version"]
            except CallFailed as e:
                raise RolloutServerError(
                    f"rollout server {url}: GET /weight_info failed: {e}"
                ) from None
            return {
                **info,
                "vllm": found,
                "weight_version": int(version) if str(version).isdigit() else -1,
            }

    def check(self, url: str, info: dict) -> None:
        """One-line :class:`RolloutServerError` unless the server with facts ``info``
        (:meth:`_info`) can serve this trainer."""
        if not supported_vllm(info.get("vllm", "")):
            raise RolloutServerError(
                f"rollout server {url}: vLLM {info.get('vllm')}, but the mixing hook "
                f"is written for vLLM {SUPPORTED_VLLM}"
            )
        if not str(info.get("hook", "")).startswith("NeighborMix"):
            raise RolloutServerError(
                f"rollout server {url}: the mixing hook is not installed in vLLM's "
                f"model runner (hook {info.get('hook')!r})"
            )
        if info.get("protocol") != wire.PROTOCOL:
            raise RolloutServerError(
                f"rollout server {url}: wire protocol {info.get('protocol')}, "
                f"this trainer speaks {wire.PROTOCOL} (different code versions)"
            )
        route = self.cfg.weight_transfer
        if route != "http" and info.get("weight_transfer") != wire.BACKENDS[route]:
            raise RolloutServerError(
                f"rollout server {url}: weight-transfer backend "
                f"{info.get('weight_transfer')!r}, the trainer sends with {route!r} "
                f"(start the servers with --weight-transfer {route}, or "
                f"rollout.remote.weight_transfer=http)"
            )
        ours = {
            "vocab_size": self.spec.vocab_size,
            "hidden_size": self.spec.hidden_size,
            "num_real_tokens": self.num_real_tokens,
        }
        for key, value in ours.items():
            if info.get(key) != value:
                raise RolloutServerError(
                    f"rollout server {url}: serves a model with {key} = "
                    f"{info.get(key)}, the trainer's is {value}"
                )

    # ---- RolloutEngine ----------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        mixing=None,
        keys: list[int] | None = None,
    ) -> RolloutBatch:
        """As :meth:`RolloutEngine.generate`; a collective of all ranks in a multi-rank job."""
        mixing = active_mixing(mixing)
        validate_request(
            prompts,
            params,
            keys,
            self.max_model_len,
            self.num_real_tokens,
            "the servers' max_model_len",
            mixing,
            self._table_width,
        )
        if mixing is not None and mixing.strategy == "neighbor" and self._table_width is None:
            # the servers mix with the table they were sent (a server without one would fail in its model runner)
            raise ValueError(
                "generate: strategy 'neighbor' on rollout servers needs the trainer's neighbour "
                "table: call set_neighbor_table first"
            )
        if mixing is not None and mixing.stop_after and self.tokenizer is None:
            raise ValueError(
                "generate: mixing.stop_after needs the trainer's tokenizer (none was given)"
            )
        keys = list(range(len(prompts))) if keys is None else [int(k) for k in keys]
        by_key = (
            gather_requests(prompts, keys, self.group)
            if self.group is not None
            else dict(zip(keys, prompts))
        )
        result = None
        if is_rank0():
            ordered = sorted(by_key)
            try:
                result = (
                    ordered,
                    self._spread([by_key[k] for k in ordered], ordered, params, mixing),
                )
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
        if not prompts:
            return RolloutBatch(
                [], [], [], [], MixRecord.empty(0, mixing.k if mixing is not None else 1), []
            )
        servers = list(self.servers)
        per = -(-len(prompts) // len(servers))
        slices = [
            (i, prompts[s : s + per], keys[s : s + per])
            for i, s in enumerate(range(0, len(prompts), per))
        ]

        def call(item):
            i, p, k = item
            url = servers[i]
            try:
                return self._generate_on(url, p, k, params, mixing)
            except CallFailed as first:
                if not first.retry:
                    raise RolloutServerError(
                        f"rollout server {url}: generate failed: {first}"
                    ) from None
                others = [s for s in self.servers if s != url]
                retry = others[i % len(others)] if others else url
                if others:
                    self.servers = others  # drop it for the rest of the run
                logger.warning(
                    "rollout server %s: generate failed (%s); retrying on %s", url, first, retry
                )
                try:
                    return self._generate_on(retry, p, k, params, mixing)
                except CallFailed as e:
                    after = "twice" if retry == url else f"after {url} failed ({first})"
                    raise RolloutServerError(
                        f"rollout server {retry}: generate failed {after}: {e}"
                    ) from None

        with ThreadPoolExecutor(len(slices)) as pool:
            return RolloutBatch.cat(list(pool.map(call, slices)))

    def _generate_on(self, url: str, prompts, keys, params: SamplingParams, mixing) -> RolloutBatch:
        """One request per prompt on ``url`` (concurrently: vLLM batches them), then the call's
        mix records; raises :class:`CallFailed`."""
        call = uuid.uuid4().hex
        stop_ids = []
        if mixing is not None:
            if mixing.stop_after:
                stop_ids = self.tokenizer.encode(mixing.stop_after, add_special_tokens=False)
            if mixing.strategy == "stht" and self._noise.get(url) != (
                self.version,
                mixing.noise_scale,
            ):
                self.http.rpc(url, "nbr_server_set_noise", mixing.noise_scale)
                self._noise[url] = (self.version, mixing.noise_scale)

        def one(i):
            extra = (
                None
                if mixing is None
                else request_options(call, i, keys[i], params.n, params.seed, mixing, stop_ids)
            )
            options = sampling_options(
                params, min(params.max_new_tokens, self.max_model_len - len(prompts[i])), extra
            )
            return self.http.post(
                url,
                "/inference/v1/generate",
                json={
                    "request_id": f"{call}-{i}",
                    "token_ids": list(prompts[i]),
                    "sampling_params": options,
                },
            )

        try:
            with ThreadPoolExecutor(min(len(prompts), _MAX_REQUESTS)) as pool:
                answers = list(pool.map(one, range(len(prompts))))
        except CallFailed:
            if mixing is not None:  # the hook forgets this call's requests (best effort: the
                with contextlib.suppress(CallFailed):  # server may be gone); the slice is retried
                    self.http.rpc(url, "nbr_mix_pop", call)
            raise
        # Records lost here would be replayed as plain tokens: a failed pop fails the slice.
        records = self.http.rpc(url, "nbr_mix_pop", call) if mixing is not None else {}
        return self._batch(
            prompts, params.n, answers, records, mixing.k if mixing is not None else 1
        )

    def _batch(self, prompts, n: int, answers: list[dict], records: dict, k: int) -> RolloutBatch:
        """The batch of one server's answers; :class:`CallFailed` (retried) when a response did not
        finish normally or a token was sampled from another weight version than the trainer's
        current one."""
        want = "default" if self.version < 0 else str(self.version)
        prompt_ids, response_ids, logprobs, finish = [], [], [], []
        for i, answer in enumerate(answers):
            for c in sorted(answer["choices"], key=lambda c: c["index"]):
                if c["finish_reason"] not in ("stop", "length"):
                    raise CallFailed(
                        f"prompt {i}, sample {c['index']}: vLLM finished with {c['finish_reason']!r}"
                    )
                stale = {span["version"] for span in c.get("weight_versions") or []} - {want}
                if stale:
                    raise CallFailed(
                        f"sampled with weight version {sorted(stale)}, the trainer's is {want}"
                    )
                prompt_ids.append(list(prompts[i]))
                response_ids.append(list(c["token_ids"]))
                logprobs.append([float(e["logprob"]) for e in c["logprobs"]["content"]])
                finish.append(c["finish_reason"])
        return RolloutBatch(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=logprobs,
            finish_reasons=finish,
            mixes=hook_mix_record(records, n, [len(r) for r in response_ids], k),
            prompt_index=[i for i in range(len(prompts)) for _ in range(n)],
        )

    def sync_weights(self, model_chunks) -> None:
        """Push the trainer's weights to every live server as weight version ``self.version + 1``
        (collective: every rank drives the export; rank 0 sends; rollout/remote/weights.py)."""
        self.version += 1
        self.last_sync = self.weights.push(model_chunks, self.servers, self.version)

    def set_neighbor_table(self, table: torch.Tensor | None) -> None:
        """Ship the trainer's ``[V, k]`` table of the current weight version to every server (None:
        no table, a neighbour-mixing generate is refused until one is set)."""
        if table is None:
            self._table_width = None
            return
        error = None
        if is_rank0():
            data = base64.b64encode(wire.pack_tensors([("table", table.to(torch.int32))])).decode()
            try:
                on_all(
                    self.servers,
                    "neighbour table",
                    lambda url: self.http.rpc(url, "nbr_server_set_table", data, self.version),
                )
            except RolloutServerError as e:
                error = str(e)
        error = broadcast_from_rank0(error, self.group)
        if error:
            raise RolloutServerError(error)
        self._table_width = int(table.shape[1])

    def close(self) -> None:
        self.weights.close()
        self.http.close()


# Concurrent requests per server and generate call (vLLM queues what its batch cannot take).
_MAX_REQUESTS = 64
