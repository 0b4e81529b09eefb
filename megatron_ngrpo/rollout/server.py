"""Rollout server of a disaggregated job: one vLLM engine with the mixing hook behind HTTP.

    python -m megatron_ngrpo.rollout.server --model HF_DIR [--tokenizer DIR] [--port 8000]
        [--url-dir DIR] [--tensor-parallel-size N] [--max-model-len L] ...

Design choice: a small HTTP application (FastAPI + uvicorn, vLLM's own server stack) around the
project's :class:`~megatron_ngrpo.rollout.vllm_engine.VLLMEngine`, not vLLM's OpenAI server with
added routes. The engine already carries everything a rollout needs and the colocated tests
check: the hook installed and verified, log-probs converted to what the trainer replays, the
hook's records turned into one ``MixRecord``, the trainer's neighbour table, in-place weight
reload. vLLM's OpenAI app runs an ``AsyncLLM`` whose engine core is a separate process (12-38 s
to start on CPU, docs/ENVIRONMENT.md §3, §8): the records and weights would go through
``collective_rpc`` across that process boundary (no tensors: files), and its completions
routes return text-level log-probs with no place for the records. The cost of this choice: one
generate call runs at a time per server (vLLM batches within a call; the client sends each
server one call per step with all of its share).

Routes (JSON unless noted):

* ``GET /health``: 200 once the engine is up.
* ``GET /version``: server name, wire protocol, vLLM version, the hook's runner class, the
  model's vocabulary / hidden size / ``num_real_tokens``, vLLM TP, current weight version.
* ``POST /generate``: ``{prompts, keys, params, mixing, weight_version}`` →
  :func:`~megatron_ngrpo.rollout.wire.batch_to_json` of the engine's ``RolloutBatch`` (token ids,
  log-probs, MixRecords); 409 when the server holds another weight version than asked for.
* ``POST /sync?version=V&bucket=I&last=0|1``: one bucket of HF-named tensors (safetensors bytes,
  :func:`~megatron_ngrpo.rollout.wire.pack_tensors`); the last bucket loads them all into vLLM
  and makes ``V`` the weight version. With digests in the bucket, each tensor is checked.
* ``POST /neighbor_table?version=V``: the trainer's ``[V, k]`` table (safetensors ``table``).
* ``POST /transfer/{init,start,update,finish}``: vLLM's weight-transfer API on the engine's
  ``--weight-transfer`` backend (``gloo`` on CPU, ``nccl`` on GPU): the JSON body is the init /
  update info of the trainer's engine (rollout/weight_transfer.py), ``finish`` takes
  ``{"version": V}``. ``init`` and ``update`` return once the worker has met the trainer's
  sender (the tensors travel over the backend, not HTTP).

Start-up refuses, with one line on stderr and exit code 1: a vLLM other than the minor version
the hook patches, a hook that did not install, a TP that does not divide the visible GPUs. With
``--url-dir`` the server writes ``<url-dir>/<host>_<port>.url`` (its base URL) once it accepts
requests, which is how the training group of a hetjob finds it.
"""

import argparse
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_ngrpo.rollout.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF checkpoint directory (config.json, safetensors)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's, if it has one)")
    p.add_argument("--num-real-tokens", type=int, help="ids >= this are never sampled (default: the tokenizer's id count, else the HF vocab_size)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--advertise-host", default=socket.gethostname(),
                   help="host name written to --url-dir (default: this host's name)")
    p.add_argument("--url-dir", help="register <host>_<port>.url here once serving")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engines on this node: one server process each, on consecutive ports, each "
                        "on its own block of tensor-parallel-size GPUs")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=512 * 2**20, help="CPU only")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--weight-transfer", choices=("gloo", "nccl"),
                   help="vLLM weight-transfer backend of the /transfer routes (default: nccl on GPU, gloo "
                        "on CPU at TP 1, none otherwise: HTTP pushes only)")
    return p


class RolloutServer:
    """The engine and its weight / table versions; one engine call at a time."""

    def __init__(self, engine, tensor_parallel: int, hook: str):
        self.engine, self.hook, self.tensor_parallel = engine, hook, tensor_parallel
        self.weight_transfer = engine.cfg.weight_transfer
        self.lock = threading.Lock()
        self.weight_version = -1  # the checkpoint's weights, before the trainer's first sync
        self.table_version = -1
        self.bucket: list = []
        self.expected: dict[str, str] = {}

    def version(self) -> dict:
        import vllm

        from megatron_ngrpo.rollout import wire

        spec = self.engine.spec
        return {"server": wire.SERVER_NAME, "protocol": wire.PROTOCOL, "vllm": vllm.__version__,
                "hook": self.hook, "tensor_parallel": self.tensor_parallel, "model": self.engine.hf_path,
                "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
                "num_real_tokens": self.engine.num_real_tokens, "max_model_len": self.engine.max_model_len,
                "weight_version": self.weight_version, "table_version": self.table_version,
                "weight_transfer": self.weight_transfer}

    def generate(self, req: dict) -> dict:
        from megatron_ngrpo.mixing.config import MixingConfig
        from megatron_ngrpo.rollout.types import SamplingParams
        from megatron_ngrpo.rollout.wire import batch_to_json

        mixing = MixingConfig(**req["mixing"]) if req.get("mixing") else None
        with self.lock:
            if req["weight_version"] != self.weight_version:
                raise StaleWeights(f"server holds weight version {self.weight_version}, the request is "
                                   f"for version {req['weight_version']}")
            batch = self.engine.generate(req["prompts"], SamplingParams(**req["params"]), mixing=mixing,
                                         keys=req["keys"])
        return batch_to_json(batch)

    def sync(self, data: bytes, version: int, bucket: int, last: bool) -> dict:
        from megatron_ngrpo.rollout.wire import digest, unpack_tensors

        tensors, expected = unpack_tensors(data)
        with self.lock:
            if bucket == 0:
                self.bucket, self.expected = [], {}
            elif not self.bucket:
                raise ValueError(f"weight bucket {bucket} of version {version} without bucket 0")
            self.bucket += list(tensors.items())
            self.expected.update(expected)
            if not last:
                return {"buckets": bucket + 1}
            named, expected, self.bucket, self.expected = self.bucket, self.expected, [], {}
            bad = [n for n, t in named if n in expected and digest(t) != expected[n]]
            if bad:
                raise ValueError(f"weight sync {version}: {len(bad)} tensors differ from the trainer's "
                                 f"(first {bad[0]})")
            t0 = time.perf_counter()
            self.engine.load_weights(named)
            self.weight_version = version
            return {"version": version, "tensors": len(named), "verified": len(expected),
                    "load_seconds": time.perf_counter() - t0}

    def transfer(self, step: str, body: dict) -> dict:
        """One step of vLLM's weight-transfer API on this engine (the trainer drives the order:
        init once, then start, update per bucket, finish with the new weight version)."""
        llm = self.engine.llm
        with self.lock:  # no generate call while weights change
            if step == "init":
                llm.init_weight_transfer_engine({"init_info": body})
            elif step == "start":
                llm.start_weight_update()
            elif step == "update":
                llm.update_weights({"update_info": body})
            elif step == "finish":
                llm.finish_weight_update()
                self.weight_version = int(body["version"])
            else:
                raise ValueError(f"unknown weight-transfer step {step!r}")
        return {"step": step, "version": self.weight_version}

    def set_table(self, data: bytes, version: int) -> dict:
        from megatron_ngrpo.rollout.wire import unpack_tensors

        tensors, _ = unpack_tensors(data)
        with self.lock:
            self.engine.set_neighbor_table(tensors["table"])
            self.table_version = version
        return {"version": version}


class StaleWeights(RuntimeError):
    """A generate request for a weight version the server does not hold."""


def make_app(server: RolloutServer):
    """The FastAPI application of ``server`` (this module has no ``from __future__ import
    annotations``: FastAPI reads the handlers' annotations as types). Errors answer ``{"error": one line}``: 400 for bad
    requests (ValueError), 409 for a stale weight version, 500 otherwise."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="megatron_ngrpo rollout server")

    def answer(fn, *args):
        try:
            return fn(*args)
        except StaleWeights as e:
            return JSONResponse({"error": str(e)}, status_code=409)
        except ValueError as e:
            return JSONResponse({"error": _one_line(e)}, status_code=400)
        except Exception as e:  # noqa: BLE001 - reported to the client, which names this server
            logger.exception("request failed")
            return JSONResponse({"error": _one_line(e)}, status_code=500)

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.get("/version")
    def version():
        return server.version()

    # Plain (sync) handlers run in FastAPI's thread pool; the server's lock orders engine calls.
    @app.post("/generate")
    def generate(req: dict):
        return answer(server.generate, req)

    @app.post("/sync")
    async def sync(request: Request, version: int, bucket: int, last: int):
        data = await request.body()
        return await _in_thread(answer, server.sync, data, version, bucket, bool(last))

    @app.post("/transfer/{step}")
    def transfer(step: str, body: dict):
        return answer(server.transfer, step, body)

    @app.post("/neighbor_table")
    async def neighbor_table(request: Request, version: int):
        data = await request.body()
        return await _in_thread(answer, server.set_table, data, version)

    return app


async def _in_thread(fn, *args):
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def start_engine(args):
    """The engine of ``args`` after the start-up checks; returns (engine, hook runner class)."""
    import torch

    from megatron_ngrpo.rollout.config import VLLMConfig
    from megatron_ngrpo.rollout.vllm_engine import VLLMEngine, check_vllm_version

    check_vllm_version()
    tp = args.tensor_parallel_size
    if torch.cuda.is_available() and torch.cuda.device_count() % tp:
        raise RuntimeError(f"--tensor-parallel-size {tp} does not divide the {torch.cuda.device_count()} "
                           f"visible GPUs")
    # The gloo engine pairs the trainer with one worker: a CPU server of TP > 1 takes HTTP pushes only.
    backend = args.weight_transfer or ("nccl" if torch.cuda.is_available() else "gloo" if tp == 1 else "reload")
    if backend == "gloo" and tp > 1:
        raise RuntimeError(f"--weight-transfer gloo sends to one worker: --tensor-parallel-size {tp} "
                           f"needs nccl")
    cfg = VLLMConfig(tensor_parallel=tp, weight_transfer=backend, dtype=args.dtype, max_model_len=args.max_model_len,
                     gpu_memory_utilization=args.gpu_memory_utilization,
                     kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens)
    engine = VLLMEngine(args.model, cfg, num_real_tokens=args.num_real_tokens, tokenizer=args.tokenizer,
                        seed=args.seed)
    # Idempotent: reports the runner class the engine's install put in place.
    hook = engine.llm.collective_rpc("nbr_mix_install", args=(engine.num_real_tokens,))[0]
    if not str(hook).startswith("NeighborMix"):
        engine.close()
        raise RuntimeError(f"the mixing hook is not installed in vLLM's model runner ({hook})")
    return engine, str(hook)


def _register(server, url_file: Path, url: str) -> None:
    """Write ``url`` to ``url_file`` once uvicorn accepts connections."""
    from megatron_ngrpo.atomic import atomic_write

    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    atomic_write(url_file, url)
    logger.info("rollout server registered at %s", url_file)


def run_replicas(args, argv: list[str]) -> int:
    """``--data-parallel-size`` D > 1: D server processes (ports ``port .. port+D-1``, GPUs in
    blocks of TP); ends with the first one that exits, after stopping the others."""
    import signal
    import subprocess

    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(tp * dp)]
    if len(devices) < tp * dp:
        print(f"error: rollout server: {dp} engines of TP {tp} need {tp * dp} GPUs, {len(devices)} visible",
              file=sys.stderr)
        return 1
    procs = []
    for i in range(dp):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices[i * tp:(i + 1) * tp])}
        procs.append(subprocess.Popen([sys.executable, "-m", __spec__.name, *argv, "--port", str(args.port + i),
                                       "--data-parallel-size", "1"], env=env))
    stop = lambda *_: [p.send_signal(signal.SIGTERM) for p in procs if p.poll() is None]  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    while all(p.poll() is None for p in procs):
        time.sleep(1)
    stop()
    return next(p.returncode for p in procs if p.returncode is not None)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.data_parallel_size > 1:  # later --port / --data-parallel-size override the given ones
        return run_replicas(args, argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        engine, hook = start_engine(args)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"error: rollout server: {_one_line(e)}", file=sys.stderr)
        return 1
    import uvicorn

    server = RolloutServer(engine, args.tensor_parallel_size, hook)
    uv = uvicorn.Server(uvicorn.Config(make_app(server), host=args.host, port=args.port, log_level="warning"))
    url_file = None
    if args.url_dir:
        url_file = Path(args.url_dir) / f"{args.advertise_host}_{args.port}.url"
        url_file.parent.mkdir(parents=True, exist_ok=True)
        threading.Thread(target=_register, args=(uv, url_file, f"http://{args.advertise_host}:{args.port}"),
                         daemon=True).start()
    logger.info("rollout server on %s:%d (vLLM TP %d, hook %s)", args.host, args.port,
                args.tensor_parallel_size, hook)
    try:
        uv.run()
    finally:
        if url_file is not None:
            url_file.unlink(missing_ok=True)
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
