"""Built-in Megatron engine vs vLLM engine: tokens/s on the same tiny model, same prompts.

One process, TP=1, fp32, a tiny random Qwen2 with HF weights (loaded into Megatron through the
conversion mapping, into vLLM from the files); plain sampling and N-GRPO mixing at ρ=0.1 for each
engine; vLLM vs built-in timed in interleaved pairs by ``bench/_timing.py`` (tokens per second of
process CPU time, the machine is shared; median over A B / B A blocks with its 95% interval). Also the
vLLM weight-sync seconds (Megatron → vLLM) per million parameters.

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind \\
        python -m bench.bench_engines [--max-seconds 300]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from bench._timing import compare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()

    from megatron_ngrpo.conversion.loading import build_policy
    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.rollout.config import VLLMConfig
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine
    from megatron_ngrpo.rollout.types import SamplingParams
    from megatron_ngrpo.rollout.vllm.engine import VLLMEngine
    from megatron_ngrpo.testing.tiny import write_tiny_hf

    tmp = tempfile.TemporaryDirectory()
    hf = write_tiny_hf(
        tmp.name,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=4 * args.hidden,
    )
    chunks = build_policy(ModelConfig(hf_path=str(hf), dtype="float32"))
    engines = {
        "megatron": MegatronEngine(chunks, args.vocab),
        "vllm": VLLMEngine(hf, VLLMConfig(max_model_len=256, kv_cache_memory_bytes=256 * 2**20)),
    }
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(
            0, args.vocab, (int(torch.randint(16, 49, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(args.prompts)
    ]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    modes = {"plain": None, "mixed rho=0.1": MixingConfig(rate=0.1)}

    def run(e, m):
        return lambda: sum(engines[e].generate(prompts, params, modes[m]).response_lengths)

    print(
        f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.prompts} prompts "
        f"x n={args.n}, {args.new_tokens} new tokens",
        flush=True,
    )
    for m in modes:
        r = compare(
            run("vllm", m),
            run("megatron", m),
            kind="rate",
            label=f"tokens/s vLLM / built-in, {m}",
            max_seconds=args.max_seconds,
        )
        print(f"{r} | {1 / r.a_cpu:.0f} vs {1 / r.b_cpu:.0f} tok/s", flush=True)

    syncs = []
    for _ in range(3):
        engines["vllm"].sync_weights(chunks)
        syncs.append(engines["vllm"].last_sync)
    params_m = syncs[-1]["num_params"] / 1e6
    total = statistics.median(s["seconds"] for s in syncs)
    print(
        f"vLLM weight sync: {params_m:.2f} M params, {total:.3f} s median "
        f"({total / params_m:.4f} s per M params; load {statistics.median(s['load_seconds'] for s in syncs):.3f} s, "
        f"neighbour table {statistics.median(s['table_seconds'] for s in syncs):.3f} s)"
    )
    engines["vllm"].close()
    tmp.cleanup()


if __name__ == "__main__":
    main()
