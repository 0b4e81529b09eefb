"""The prepared GPU benchmark of issue #38, run by ``scripts/gpu_bench.sh`` the day a GPU is lent.

Stages, each a benchmark in its own process with its own time limit (a failing or hanging one
becomes a FAIL row; the next still runs); on one H100 under 8 minutes in all, set-up included:

* ``mfu_unfused``: ``bench/bench_mfu.py`` at the 1.5B shape (4 × 4096 tokens a step, bf16) on
  megatron's local spec with its unfused attention, as shipped before issue #38: s/step, MFU,
  peak allocated GiB, plain and mixed GRPO steps;
* ``mfu_sdpa``: the same on the local spec's default attention, torch SDPA (models/attention.py),
  with the log-prob pass in chunks (grpo/token_logprobs.py), and the host syncs of one plain and
  one mixed step counted by torch.profiler (``--count-syncs``);
* ``neighbors``: the neighbour table at the 7B shape, 152,064 × 3,584, by ``bench/bench_neighbors.py
  --device cuda --shape 152064x3584`` (the GPU path of the "mixing" work on issue #38: the device's
  bf16 screen with fp32 re-scoring against the fp32 screen, tables checked identical);
* ``vs_trl``: ``bench/bench_vs_trl.py --device cuda``: SmolLM2-135M's shape with random weights and
  its real tokenizer (.whl/smollm2-135m, from scripts/gpu_bench_wheels.sh), fixed-length responses,
  our GRPO step on the built-in engine against TRL's, steps per hour with the ratio's interval.

Writes ``gpu_bench.md`` (one table with the device's name and the commit) and ``gpu_bench.json``
to ``--results`` (default bench/results/), each stage's log and JSON to ``--work``. ``--dry``: every
stage at a tiny size on CPU (plumbing only: its figures are not GPU figures), so the script is
tested where no GPU is (tests/test_gpu_bench.py). Exit status 1 if a stage failed.

    bash scripts/gpu_bench.sh [--dry] [--skip STAGE ...] [--results DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
STAGES = ("mfu_unfused", "mfu_sdpa", "neighbors", "vs_trl")
# Seconds per stage on the GPU (their sum, ~7.7 min, is the budget's upper end; a stage normally
# takes a third to a half of it); --dry allows the CPU more for the same tiny work.
TIMEOUT_S = {"mfu_unfused": 140, "mfu_sdpa": 120, "neighbors": 80, "vs_trl": 130}
DRY_TIMEOUT_S = 300
# bf16 dense peak TFLOP/s by device name (H100 SXM and H200 share it).
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}
ASSETS = REPO / ".whl"

MFU = ["-m", "bench.bench_mfu", "--layer-spec", "local", "--steps", "5"]
MFU_DRY = ["--shape", "tiny", "--seq", "64", "--steps", "1"]
# bench_neighbors' device path (the "mixing" work on issue #38): the table built with the device's
# screen against the fp32 screen, checked identical; the dry run takes the same path on CPU.
NEIGHBORS = ["-m", "bench.bench_neighbors", "--device", "cuda", "--shape", "152064x3584"]
NEIGHBORS_DRY = [
    "-m",
    "bench.bench_neighbors",
    "--device",
    "cpu",
    "--shape",
    "512x64",
    "--pairs",
    "1",
]
VS_TRL = ["-m", "bench.bench_vs_trl", "--engines", "megatron", "--random-weights", "--fixed-length"]
VS_TRL_GPU = [
    "--device",
    "cuda",
    "--prompts",
    "4",
    "--n",
    "4",
    "--new-tokens",
    "32",
    "--pairs",
    "5",
]
VS_TRL_DRY = ["--device", "cpu", "--prompts", "2", "--n", "2", "--new-tokens", "4", "--pairs", "1"]


def commit() -> str:
    """The commit the results belong to: git's, else the one scripts/gpu_bench_wheels.sh wrote."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO).returncode
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        stamp = ASSETS / "COMMIT"
        return stamp.read_text().strip() if stamp.is_file() else "unknown"


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)"


def smollm2_folder(args) -> Path:
    """SmolLM2-135M's config and tokenizer: the carried copy, else the real model's folder."""
    if (ASSETS / "smollm2-135m" / "tokenizer.json").is_file():
        return ASSETS / "smollm2-135m"
    # lazy: the real model's folder is this machine's; the lent one has the carried copy
    from tests.harness.real_model import real_model_dir

    return real_model_dir()


def stage_command(args, stage: str, out: Path) -> list[str]:
    """The benchmark command of ``stage`` writing its JSON to ``out``."""
    if stage.startswith("mfu_"):
        attention = stage.removeprefix("mfu_")
        cmd = [*MFU, "--attention", attention, "--out", str(out)]
        if attention == "sdpa":
            cmd.append("--count-syncs")
        if args.dry:
            return cmd + MFU_DRY
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in device_name()), 989.4)
        return cmd + ["--peak-tflops", str(peak)]
    if stage == "neighbors":
        return NEIGHBORS_DRY if args.dry else NEIGHBORS
    smollm2 = smollm2_folder(args)
    cmd = [*VS_TRL, f"--tokenizer={smollm2}", f"--work-dir={args.work / 'vs_trl'}"]
    if args.dry:  # SmolLM2's vocabulary and tokenizer on a two-layer model
        # lazy: writes the tiny model config (the dry run only)
        from tests.harness.tiny import write_tiny_hf

        tiny = write_tiny_hf(
            args.work / "tiny_smollm2",
            arch="llama",
            weights=False,
            vocab_size=49152,
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=128,
            max_pos=512,
            rope_scaling=None,
            tied=True,
        )
        return cmd + VS_TRL_DRY + [f"--model={tiny}", f"--out={out}"]
    return cmd + VS_TRL_GPU + [f"--model={smollm2}", f"--out={out}"]


def run_stage(args, stage: str) -> dict:
    """One stage in a child process: its row (status, seconds, detail) and its JSON results."""
    out, log = args.work / f"{stage}.json", args.work / f"{stage}.log"
    out.unlink(missing_ok=True)
    limit = DRY_TIMEOUT_S if args.dry else TIMEOUT_S[stage]
    t0 = time.time()
    try:
        with open(log, "w") as f:
            p = subprocess.run(
                [sys.executable, *stage_command(args, stage, out)],
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=limit,
                cwd=REPO,
            )
        failed = f"exit status {p.returncode}" if p.returncode else ""
    except subprocess.TimeoutExpired:
        failed = f"timed out after {limit} s"
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    row = {"stage": stage, "seconds": round(time.time() - t0, 1), "log_tail": lines[-8:]}
    if failed:
        return {
            **row,
            "status": "FAIL",
            "detail": f"{failed}: {(lines or ['(no output)'])[-1][:300]}",
        }
    row["status"] = "PASS"
    row["detail"] = lines[-1][:300] if lines else ""
    if out.is_file():
        row["results"] = json.loads(out.read_text())
    return row


def _mfu_cells(row: dict | None, kind: str) -> list[str]:
    r = (row or {}).get("results", {}).get(kind)
    if not r:
        return ["not run"] * 4
    peak = r["max_memory_gib"]
    syncs = r.get("syncs")
    return [
        f"{r['step_s']:.3f}",
        f"{100 * r['mfu']:.1f} %",
        f"{peak:.1f}" if peak is not None else "n/a (CPU)",
        f"{syncs['cuda_syncs']} / {syncs['scalar_reads']}" if syncs else "",
    ]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def report(rows: list[dict], meta: dict) -> str:
    """The results as markdown: the figures table, then the stages."""
    by = {r["stage"]: r for r in rows}
    lines = [
        "# GPU benchmark of issue #38 (`scripts/gpu_bench.sh`)",
        "",
        f"Device: {meta['device']}; commit {meta['commit']}; {meta['date']}; torch "
        f"{meta['torch']}.",
    ]
    if meta["dry"]:
        lines += ["", "**Dry run on CPU at tiny sizes: the plumbing, not GPU figures.**"]
    lines += [
        "",
        "| bench_mfu, 1.5B shape, 4 × 4096 tokens/step | s/step | MFU | peak GiB | host syncs "
        "(CUDA / scalar reads) |",
        "|---|---|---|---|---|",
    ]
    for stage, label in (("mfu_unfused", "local spec, unfused"), ("mfu_sdpa", "local spec, SDPA")):
        for kind in ("plain", "mixed"):
            lines.append(
                f"| {label}, {kind} | " + " | ".join(_mfu_cells(by.get(stage), kind)) + " |"
            )
        res = by.get(stage, {}).get("results", {})
        if "mixed_over_plain" in res:
            lines.append(
                f"| {label}, mixed / plain step time | {res['mixed_over_plain']:.3f} | | | |"
            )
    trl = by.get("vs_trl", {}).get("results", {}).get("rows", {}).get("megatron", {}).get("wall")
    nb = by.get("neighbors")
    lines += [
        "",
        "| other figure | value |",
        "|---|---|",
        "| neighbour table 152,064 × 3,584 (bench_neighbors, last line) | "
        + (
            _cell(nb["detail"])
            if nb and nb["status"] == "PASS"
            else "not measured: stage did not pass"
        )
        + " |",
        "| GRPO steps per hour, ours (built-in engine) / TRL, wall clock, 95% CI | "
        + (
            f"{trl['ratio']:.3f} [{trl['lo']:.3f}, {trl['hi']:.3f}] ({trl['ours_steps_per_hour']:.0f}"
            f" vs {trl['trl_steps_per_hour']:.0f})"
            if trl
            else "not measured: stage did not pass"
        )
        + " |",
        "",
        "| stage | status | seconds | detail |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['stage']} | {r['status']} | {r['seconds']:.0f} | {_cell(r['detail'])} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="tiny sizes on CPU (tests the script)")
    ap.add_argument("--skip", nargs="*", default=[], choices=STAGES, metavar="STAGE")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ngrpo_gpu_bench"))
    args = ap.parse_args(argv)
    if not args.dry and not torch.cuda.is_available():
        sys.exit("gpu_bench: no GPU here (torch.cuda.is_available() is False); --dry runs on CPU")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": device_name(),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "dry": args.dry,
    }
    rows = []
    for stage in STAGES:
        if stage in args.skip:
            rows.append({"stage": stage, "status": "SKIP", "seconds": 0.0, "detail": "--skip"})
            continue
        print(f"[gpu_bench] {stage} ...", flush=True)
        rows.append(run_stage(args, stage))
        print(f"[gpu_bench] {stage}: {rows[-1]['status']} {rows[-1]['detail']}", flush=True)
    text = report(rows, meta)
    (args.results / "gpu_bench.md").write_text(text)
    (args.results / "gpu_bench.json").write_text(json.dumps({**meta, "stages": rows}, indent=1))
    print(text)
    failed = [r["stage"] for r in rows if r["status"] == "FAIL"]
    print(f"[gpu_bench] {'FAILED: ' + ', '.join(failed) if failed else 'all stages passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
