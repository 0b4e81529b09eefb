"""A task a tiny model can learn on CPU, and learn in general: the maximum or minimum of a list of two
to four two-digit numbers, answered as ``\\boxed{N}``. About 18,000 distinct problems of three
difficulty levels (list length); 64 held-out problems per level, none of them trained on.

Writes, into a directory:
- ``tokenizer/``: a character-level task tokenizer (HF ``tokenizers`` WordLevel model, one token per
  character plus ``\\boxed{``), loadable with ``AutoTokenizer.from_pretrained``;
- ``model/config.json``: a tiny Qwen2 whose vocabulary is that tokenizer;
- ``train.jsonl`` / ``heldout.jsonl``: problems ``{"problem": "max(37,52,18)=", "answer": "52", "level": 2}``;
- ``sft.jsonl``: worked solutions ``{"problem": ..., "response": "\\boxed{52}"}`` for the brief
  supervised warm-start (stated as such in the README).
The answers are graded by the project's own math grader, exactly as real runs are.

``--task sums`` writes a task of the same shape with room to explore (examples/study): numbers
added and subtracted, three one-digit ones (``7+5-8=``), a two-digit and two one-digit ones
(``47+5-8=``) or two two-digit ones (``47-58=``) by level, answered as ``\\boxed{44}``.
A tiny warm-started policy gets a digit wrong often but not always, so its pass@k climbs with k
where max / min is near its ceiling at k = 1.

``--chat`` writes only ``train.jsonl`` / ``heldout.jsonl``, the same problems and the same held-out
split phrased for a pretrained chat model ("What is the largest of the numbers 37, 52 and 18?"),
for the real-model recipe (configs/smollm2_135m_arith.yaml), whose instruction asks for the box.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = list("0123456789+-*=?\n (),maxin")
BOXED = "\\boxed{"


# Difficulty: how many numbers the list holds. Lists are drawn at random from two-digit numbers, so
# there are far more problems than a demo can see: a model can only score on held-out problems by
# learning to compare, not by memorising answers.
LEVELS = {1: 2, 2: 3, 3: 4}
OPS = {"max": max, "min": min}


def max_min(rng: random.Random, level: int) -> tuple[str, int]:
    """``max(37,52,18)=`` / ``min(...)=`` of 2-4 two-digit numbers (by level), and its answer."""
    op = rng.choice(sorted(OPS))
    xs = [rng.randint(10, 99) for _ in range(LEVELS[level])]
    return f"{op}({','.join(map(str, xs))})=", OPS[op](xs)


# sums: the digits of each number, by level.
SUM_DIGITS = {1: (1, 1, 1), 2: (2, 1, 1), 3: (2, 2)}


def sums(rng: random.Random, level: int) -> tuple[str, int]:
    """``47+5-8=``: numbers of ``SUM_DIGITS[level]`` digits, each after the first added or
    subtracted (2,916 distinct problems at level 1)."""
    xs = [rng.randint(1 if d == 1 else 10, 10**d - 1) for d in SUM_DIGITS[level]]
    signs = [rng.choice((1, -1)) for _ in xs[1:]]
    text = str(xs[0]) + "".join(("+" if s > 0 else "-") + str(x) for s, x in zip(signs, xs[1:]))
    return f"{text}=", xs[0] + sum(s * x for s, x in zip(signs, xs[1:]))


# Task name → (problem generator (rng, level) → (problem text, integer answer), problems per level).
TASKS = {"maxmin": (max_min, 12000), "sums": (sums, 2000)}


def problems(
    seed: int,
    per_level: int | None = None,
    levels: tuple[int, ...] = (1, 2, 3),
    task: str = "maxmin",
) -> list[dict]:
    """``per_level`` (default: the task's) distinct problems of ``task`` per level (``level``
    field: list length)."""
    generate, default_per_level = TASKS[task]
    per_level = per_level or default_per_level
    rng = random.Random(seed)
    out, seen = [], set()
    for level in levels:
        count = 0
        while count < per_level:
            problem, answer = generate(rng, level)
            if problem in seen:
                continue
            seen.add(problem)
            out.append({"problem": problem, "answer": str(answer), "level": level})
            count += 1
    rng.shuffle(out)
    return out


def build_tokenizer(path: Path):
    """Character-level tokenizer; ``\\boxed{`` and ``}`` are single tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS + [BOXED, "}"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\\boxed\{|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        model_max_length=64,
    )
    fast.save_pretrained(path)
    return fast


def write_task(
    out: Path,
    seed: int = 0,
    heldout_per_level: int = 64,
    hidden_size: int = 64,
    num_layers: int = 2,
    task: str = "maxmin",
) -> dict:
    from tests.harness.tiny import tiny_hf_config

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out / "tokenizer")
    cfg = tiny_hf_config(
        "qwen2",
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=2 * hidden_size,
        max_pos=64,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    (out / "model").mkdir(exist_ok=True)
    (out / "model" / "config.json").write_text(json.dumps(cfg, indent=1))
    held, rest = split(problems(seed, task=task), heldout_per_level)
    # The warm-start's worked solutions and the GRPO prompts are disjoint halves: every training
    # reward is then earned on a problem the model never saw solved, as on the held-out set.
    sft, train = rest[: len(rest) // 2], rest[len(rest) // 2 :]
    _jsonl(out / "train.jsonl", train)
    _jsonl(out / "heldout.jsonl", held)
    _jsonl(
        out / "sft.jsonl",
        [{"problem": p["problem"], "response": f"{BOXED}{p['answer']}}}"} for p in sft],
    )
    return {"train": len(train), "sft": len(sft), "heldout": len(held), "vocab": len(tok)}


def split(probs: list[dict], heldout_per_level: int) -> tuple[list[dict], list[dict]]:
    """(held-out, rest). Held out: a fixed number per level (none of them trained on), so held-out
    accuracy measures the rule at every difficulty rather than the memorised one-digit table."""
    held = [
        p for level in LEVELS for p in [q for q in probs if q["level"] == level][:heldout_per_level]
    ]
    seen = {p["problem"] for p in held}
    return held, [p for p in probs if p["problem"] not in seen]


def chat_phrasing(problem: dict) -> dict:
    """``max(37,52,18)=`` as a question: "What is the largest of the numbers 37, 52 and 18?"."""
    op, xs = problem["problem"][:3], problem["problem"][4:-2].split(",")
    numbers = f"{', '.join(xs[:-1])} and {xs[-1]}"
    word = "largest" if op == "max" else "smallest"
    return {**problem, "problem": f"What is the {word} of the numbers {numbers}?"}


def write_chat_task(out: Path, seed: int = 0, heldout_per_level: int = 64) -> dict:
    """The task's problems and held-out split (as :func:`write_task`) phrased for a chat model."""
    out.mkdir(parents=True, exist_ok=True)
    held, rest = split(problems(seed), heldout_per_level)
    _jsonl(out / "train.jsonl", [chat_phrasing(p) for p in rest])
    _jsonl(out / "heldout.jsonl", [chat_phrasing(p) for p in held])
    return {"train": len(rest), "heldout": len(held)}


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", choices=sorted(TASKS), default="maxmin")
    ap.add_argument(
        "--chat", action="store_true", help="only the problems, phrased for a chat model"
    )
    args = ap.parse_args()
    if args.chat and args.task != "maxmin":
        ap.error("--chat: only the max / min task has a chat phrasing")
    written = (
        write_chat_task(args.out, args.seed)
        if args.chat
        else write_task(args.out, args.seed, task=args.task)
    )
    print(json.dumps(written))


if __name__ == "__main__":
    main()
