"""Conversion throughput on CPU for a synthetic Qwen2.5-1.5B-shaped model (random weights).

Shape: 28 layers, hidden 1536, ffn 8960, 12 heads, 2 KV heads, vocab 151936, tied embeddings, QKV
bias. Each phase runs in its own process (peak RSS per phase = that process's VmHWM):

* ``hf2m``   — ``convert_hf_to_megatron`` (read safetensors, build the model, save dist_checkpointing)
* ``m2hf``   — ``convert_megatron_to_hf`` (build, load, stream, write sharded safetensors)
* ``export`` — ``export_hf_tensors`` alone on a loaded model (what live weight sync pays, TP1)

On a small shared machine, run slices of ``--layers`` (default 2 and 6) and extrapolate each phase
linearly (time = fixed + per-layer × layers) to 28 layers; ``--layers 28`` measures the full model.
GB/s = HF checkpoint bytes (at the chosen dtype) / seconds.

    OMP_NUM_THREADS=1 python -m bench.bench_conversion [--layers 2 6] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_heads=12,
    num_kv_heads=2,
    vocab_size=151936,
    tied=True,
    max_pos=32768,
)
FULL_LAYERS = 28


def write_synthetic_hf(path: Path, layers: int, dtype: str) -> int:
    """config.json (via tests.harness.tiny) + random safetensors written tensor by tensor; returns bytes."""
    import torch

    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.conversion.hf_io import ShardedWriter
    from megatron_ngrpo.conversion.mapping import hf_layout
    from tests.harness.tiny import write_tiny_hf

    write_tiny_hf(path, "qwen2", weights=False, num_layers=layers, torch_dtype=dtype, **SHAPE)
    spec = ArchSpec.from_hf(path)
    writer = ShardedWriter(path, max_shard_bytes=2 * 1024**3)
    gen = torch.Generator().manual_seed(0)
    for name, shape in hf_layout(spec).items():
        writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(getattr(torch, dtype)))
    writer.close()
    return writer.total_bytes


def peak_rss_gib() -> float:
    """This process's peak resident set (VmHWM; ``ru_maxrss`` would include the parent's peak,
    which survives exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024**2
    raise RuntimeError("no VmHWM in /proc/self/status")


def phase(args) -> dict:
    """One measured phase in this process; prints a JSON line."""
    import torch

    from megatron_ngrpo.conversion.convert import (
        convert_hf_to_megatron,
        convert_megatron_to_hf,
    )

    work = Path(args.work)
    t0 = time.perf_counter()
    if args.phase == "hf2m":
        convert_hf_to_megatron(work / "hf", work / "m", dtype=args.dtype, progress=False)
    elif args.phase == "m2hf":
        convert_megatron_to_hf(work / "m", work / "hf_out", progress=False)
    else:
        from megatron_ngrpo.architecture import ArchSpec
        from megatron_ngrpo.conversion.checkpoint import (
            load_megatron_checkpoint,
            model_config_for,
        )
        from megatron_ngrpo.conversion.convert import _build
        from megatron_ngrpo.conversion.hf_export import export_hf_tensors

        chunks = _build(model_config_for(work / "m"))
        load_megatron_checkpoint(chunks, work / "m")
        spec = ArchSpec.from_hf(work / "m")
        t0 = time.perf_counter()
        n = 0
        for _, t in export_hf_tensors(chunks, spec):
            n += t.numel() * t.element_size()
        assert n == args.nbytes, (n, args.nbytes)
    seconds = time.perf_counter() - t0
    rss = peak_rss_gib()
    torch.distributed.destroy_process_group()
    return {"phase": args.phase, "seconds": seconds, "peak_rss_gib": rss}


def run_slice(layers: int, dtype: str, keep: Path | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"bench_conv_{layers}_", dir=keep))
    try:
        t0 = time.perf_counter()
        nbytes = write_synthetic_hf(work / "hf", layers, dtype)
        out = {"layers": layers, "bytes": nbytes, "write_synthetic_s": time.perf_counter() - t0}
        for ph in ("hf2m", "m2hf", "export"):
            cmd = [
                sys.executable,
                "-m",
                "bench.bench_conversion",
                "--phase",
                ph,
                "--work",
                str(work),
                "--dtype",
                dtype,
                "--nbytes",
                str(nbytes),
            ]
            r = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
            )
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode or not lines:
                raise RuntimeError(f"phase {ph} failed:\n{r.stderr[-3000:]}")
            res = json.loads(lines[-1])
            out[ph] = {
                "seconds": res["seconds"],
                "peak_rss_gib": res["peak_rss_gib"],
                "gb_per_s": nbytes / 1e9 / res["seconds"],
            }
            print(
                f"  layers={layers} {ph:6s} {res['seconds']:7.2f} s  {nbytes / 1e9 / res['seconds']:6.3f} GB/s"
                f"  peak RSS {res['peak_rss_gib']:.2f} GiB",
                flush=True,
            )
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def extrapolate(a: dict, b: dict, layers: int = FULL_LAYERS) -> dict:
    """Linear in layers through the two slices: seconds, bytes and RSS."""
    out = {}
    la, lb = a["layers"], b["layers"]
    lin = lambda ya, yb: ya + (yb - ya) / (lb - la) * (layers - la)  # noqa: E731
    nbytes = lin(a["bytes"], b["bytes"])
    out["bytes"] = nbytes
    for ph in ("hf2m", "m2hf", "export"):
        sec = lin(a[ph]["seconds"], b[ph]["seconds"])
        out[ph] = {
            "seconds": sec,
            "gb_per_s": nbytes / 1e9 / sec,
            "peak_rss_gib": lin(a[ph]["peak_rss_gib"], b[ph]["peak_rss_gib"]),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 6])
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--tmp", default=None, help="directory for the synthetic checkpoints")
    p.add_argument("--phase", choices=("hf2m", "m2hf", "export"), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return
    print(
        f"synthetic Qwen2.5-1.5B shape, dtype {args.dtype}, slices {args.layers} of {FULL_LAYERS} layers"
    )
    slices = [run_slice(n, args.dtype, Path(args.tmp) if args.tmp else None) for n in args.layers]
    result = {"dtype": args.dtype, "slices": slices}
    if len(slices) >= 2 and slices[-1]["layers"] != FULL_LAYERS:
        est = extrapolate(slices[0], slices[-1])
        result["extrapolated_28_layers"] = est
        print(f"extrapolated to {FULL_LAYERS} layers ({est['bytes'] / 1e9:.2f} GB):")
        for ph in ("hf2m", "m2hf", "export"):
            e = est[ph]
            print(
                f"  {ph:6s} {e['seconds']:7.1f} s  {e['gb_per_s']:6.3f} GB/s  peak RSS ≈ {e['peak_rss_gib']:.1f} GiB"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
