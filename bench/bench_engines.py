"""Built-in Megatron engine vs vLLM engine: tokens/s on the same model, same prompts.

One process, TP=1, fp32, HF weights loaded into Megatron through the conversion mapping and into
vLLM from the files: a tiny random Qwen2 (default) or a real HF folder (``--hf``, e.g.
SmolLM2-135M-Instruct, prompted with chat-templated arithmetic questions). Timed in interleaved
pairs by ``bench/_timing.py`` (tokens per second of process CPU time, the machine is shared; median
over A B / B A blocks with its 95% interval): vLLM vs built-in, plain and with N-GRPO mixing at
ρ=0.1; mixing vs plain within each engine. Also the vLLM weight-sync seconds (Megatron → vLLM) per
million parameters, with the neighbour-table rebuild apart.

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind \\
        python -m bench.bench_engines [--max-seconds 300] [--hf ~/.cache/megatron_ngrpo/models/SmolLM2-135M-Instruct] [--ignore-eos]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from bench._timing import compare
from tests.harness.tiny import random_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hf", default="", help="a real HF model folder instead of the tiny model")
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every response runs to --new-tokens (fixed work per call: where samples stop no "
        "longer varies between calls and modes)",
    )
    ap.add_argument(
        "--rows",
        choices=("all", "mixing"),
        default="all",
        help="mixing: only mixed / plain within each engine (and the weight sync)",
    )
    args = ap.parse_args()

    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.conversion.loading import build_policy
    from megatron_ngrpo.mixing.config import MixingConfig
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.rollout.config import VLLMConfig
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine
    from megatron_ngrpo.rollout.types import SamplingParams
    from megatron_ngrpo.rollout.vllm.engine import VLLMEngine
    from tests.harness.tiny import write_tiny_hf

    tmp = tempfile.TemporaryDirectory()
    if args.hf:
        hf = Path(args.hf).expanduser()
        tok = AutoTokenizer.from_pretrained(hf)
        prompts, eos = chat_prompts(tok, args.prompts), [tok.eos_token_id]
        kv_bytes = 2**30
    else:
        hf = write_tiny_hf(
            tmp.name,
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=4 * args.hidden,
        )
        prompts = random_prompts(args.prompts, args.vocab)
        kv_bytes, eos = 256 * 2**20, []
    spec = ArchSpec.from_hf(hf)
    chunks = build_policy(ModelConfig(hf_path=str(hf), dtype="float32"))
    engines = {
        "megatron": MegatronEngine(chunks, spec.vocab_size, eos_token_ids=eos),
        "vllm": VLLMEngine(hf, VLLMConfig(max_model_len=256, kv_cache_memory_bytes=kv_bytes)),
    }
    params = SamplingParams(
        n=args.n,
        temperature=1.0,
        max_new_tokens=args.new_tokens,
        seed=0,
        stop_token_ids=[] if args.ignore_eos else eos,
        ignore_eos=args.ignore_eos,
    )
    modes = {"plain": None, "mixed rho=0.1": MixingConfig(rate=0.1)}

    def run(e, m):
        return lambda: sum(engines[e].generate(prompts, params, modes[m]).response_lengths)

    print(
        f"model: {hf.name if args.hf else 'tiny random Qwen2'}, hidden {spec.hidden_size}, "
        f"{spec.num_layers} layers, vocab {spec.vocab_size}; {args.prompts} prompts x n={args.n}, "
        f"{'exactly' if args.ignore_eos else 'up to'} {args.new_tokens} new tokens",
        flush=True,
    )
    pairs = [(("vllm", m), ("megatron", m)) for m in modes] if args.rows == "all" else []
    pairs += [((e, "mixed rho=0.1"), (e, "plain")) for e in engines]
    for a, b in pairs:
        r = compare(
            run(*a),
            run(*b),
            kind="rate",
            label=f"tokens/s {' '.join(a)} / {' '.join(b)}",
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


def chat_prompts(tok, count: int) -> list[list[int]]:
    """``count`` chat-templated arithmetic questions (the model's own template), as token ids."""
    rng = random.Random(0)
    prompts = []
    for _ in range(count):
        nums = [rng.randint(10, 99) for _ in range(rng.randint(2, 4))]
        q = f"What is the largest of {', '.join(map(str, nums))}? Put the answer in \\boxed{{}}."
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    return prompts


if __name__ == "__main__":
    main()
