"""A task a tiny model can learn on CPU: one-step integer arithmetic answered as ``\\boxed{N}``.

Writes, into a directory:
- ``tokenizer/``: a character-level task tokenizer (HF ``tokenizers`` WordLevel model, one token per
  character plus ``\\boxed{``), loadable with ``AutoTokenizer.from_pretrained``;
- ``model/config.json``: a tiny Qwen2 whose vocabulary is that tokenizer;
- ``train.jsonl`` / ``heldout.jsonl``: problems ``{"problem": "7+5=", "answer": "12"}``;
- ``sft.jsonl``: worked solutions ``{"problem": ..., "response": "\\boxed{12}"}`` for the brief
  supervised warm-start (stated as such in the README).
The answers are graded by the project's own math grader, exactly as real runs are.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = list("0123456789+-*=?\n ")
BOXED = "\\boxed{"


def problems(seed: int, ops: str = "+-", lo: int = 0, hi: int = 9) -> list[dict]:
    """Every ``a op b`` with a, b in [lo, hi], shuffled."""
    out = []
    for op in ops:
        for a in range(lo, hi + 1):
            for b in range(lo, hi + 1):
                out.append({"problem": f"{a}{op}{b}=", "answer": str(eval_op(a, op, b))})
    random.Random(seed).shuffle(out)
    return out


def eval_op(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def build_tokenizer(path: Path):
    """Character-level tokenizer; ``\\boxed{`` and ``}`` are single tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS + [BOXED, "}"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\\boxed\{|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", model_max_length=64)
    fast.save_pretrained(path)
    return fast


def write_task(out: Path, seed: int = 0, heldout_fraction: float = 0.25, hidden_size: int = 64,
               num_layers: int = 2) -> dict:
    from megatron_ngrpo.testing.tiny import tiny_hf_config

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out / "tokenizer")
    cfg = tiny_hf_config("qwen2", vocab_size=len(tok), hidden_size=hidden_size,
                         num_layers=num_layers, num_heads=4, num_kv_heads=2,
                         intermediate_size=2 * hidden_size, max_pos=64,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    (out / "model").mkdir(exist_ok=True)
    (out / "model" / "config.json").write_text(json.dumps(cfg, indent=1))
    probs = problems(seed)
    n_held = int(len(probs) * heldout_fraction)
    held, train = probs[:n_held], probs[n_held:]
    _jsonl(out / "train.jsonl", train)
    _jsonl(out / "heldout.jsonl", held)
    _jsonl(out / "sft.jsonl", [{"problem": p["problem"], "response": f"{BOXED}{p['answer']}}}"}
                               for p in train])
    return {"train": len(train), "heldout": len(held), "vocab": len(tok)}


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(write_task(args.out, args.seed)))


if __name__ == "__main__":
    main()
