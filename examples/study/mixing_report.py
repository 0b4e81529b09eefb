"""What neighbour mixing does in real text: the mix records a run dumped (``train.dump_generations``)
read back through the model's tokenizer.

For every N-GRPO run directory given: the share of mixed response tokens (the metrics' own
``mixing/mixed_token_frac``), how far a mix moves from its anchor (the anchor's weight α₀: a row of
weights ``[α₀, α₁, α₂]`` with α₀ ≈ 1 is the anchor's own embedding), the anchors mixed most often
with the neighbours they were mixed with, and whether mixed positions cluster: the class of each
anchor (number, punctuation, connective, other word piece) against the same classes over all
response tokens (re-tokenised text: the base rate).

    python -m examples.study.mixing_report RUN_DIR [RUN_DIR ...] [--top 15] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import yaml
from transformers import AutoTokenizer

# Words that join steps of an argument; a token is one of them when its text, stripped and
# lower-cased, is in this set.
CONNECTIVES = frozenset(
    "so therefore thus hence then because since and but or if which that first next finally "
    "however also answer".split()
)
CLASSES = ("number", "punctuation", "connective", "other")


def token_class(text: str) -> str:
    """The class of one decoded token's text."""
    stripped = text.strip()
    if any(c.isdigit() for c in stripped):
        return "number"
    if not stripped or not any(c.isalnum() for c in stripped):
        return "punctuation"
    if stripped.lower() in CONNECTIVES:
        return "connective"
    return "other"


def read_run(run_dir: Path) -> tuple[list[dict], list[float], str]:
    """(generation rows of every dumped step, per-step mixed token fractions, tokenizer path)."""
    rows = [
        json.loads(line)
        for path in sorted((run_dir / "generations").glob("step*_dp*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    metrics = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line
    ]
    fracs = [m["mixing/mixed_token_frac"] for m in metrics if "mixing/mixed_token_frac" in m]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return rows, fracs, cfg.get("tokenizer") or cfg["model"]["hf_path"]


def report(run_dirs: list[Path], top: int) -> dict:
    rows, fracs, tok_path = [], [], None
    for run_dir in run_dirs:
        r, f, tok_path = read_run(run_dir)
        rows += r
        fracs += f
    if not rows:
        raise SystemExit(f"{run_dirs[0]}: no generations dumped (train.dump_generations=true)")
    tok = AutoTokenizer.from_pretrained(tok_path)
    decode = lambda i: tok.decode([i])  # noqa: E731

    alpha0, anchors, pairs, anchor_classes, positions = [], collections.Counter(), {}, [], []
    for row in rows:
        m = row["mixes"]
        for pos, ids, w in zip(m["pos"], m["ids"], m["weights"]):
            alpha0.append(w[0])
            anchors[ids[0]] += 1
            pairs.setdefault(ids[0], collections.Counter()).update(ids[1:])
            anchor_classes.append(token_class(decode(ids[0])))
            positions.append(pos)
    base = [
        token_class(decode(i))
        for row in rows
        for i in tok(row["text"], add_special_tokens=False)["input_ids"]
    ]
    share = lambda xs, c: xs.count(c) / max(len(xs), 1)  # noqa: E731
    clustering = {
        c: {
            "mixed": share(anchor_classes, c),
            "all": share(base, c),
            "ratio": share(anchor_classes, c) / max(share(base, c), 1e-12),
        }
        for c in CLASSES
    }
    examples = [
        {
            "anchor": decode(a),
            "count": n,
            "neighbours": [decode(b) for b, _ in pairs[a].most_common(2)],
        }
        for a, n in anchors.most_common(top)
    ]
    return {
        "runs": [str(d) for d in run_dirs],
        "responses": len(rows),
        "mixes": len(alpha0),
        "mixed_token_frac": statistics.fmean(fracs) if fracs else float("nan"),
        "alpha0": {
            "median": statistics.median(alpha0),
            "mean": statistics.fmean(alpha0),
            "below_0.9": sum(a < 0.9 for a in alpha0) / len(alpha0),
            "below_0.5": sum(a < 0.5 for a in alpha0) / len(alpha0),
        },
        "median_position": statistics.median(positions),
        "clustering": clustering,
        "examples": examples,
    }


def markdown(r: dict) -> str:
    a = r["alpha0"]
    lines = [
        f"{r['mixes']} mixes in {r['responses']} responses; mixed share of response tokens "
        f"{r['mixed_token_frac']:.3f} (mean over steps); anchor weight α₀: median {a['median']:.3f}, "
        f"mean {a['mean']:.3f}, {100 * a['below_0.9']:.1f}% of mixes below 0.9, "
        f"{100 * a['below_0.5']:.1f}% below 0.5; median response position {r['median_position']}.",
        "",
        "| anchor class | share of mixed anchors | share of all response tokens | ratio |",
        "|---|---|---|---|",
    ]
    for c, v in r["clustering"].items():
        lines.append(f"| {c} | {v['mixed']:.3f} | {v['all']:.3f} | {v['ratio']:.2f} |")
    lines += ["", "| anchor | mixes | most frequent neighbours |", "|---|---|---|"]
    for e in r["examples"]:
        lines.append(
            f"| `{e['anchor']!r}` | {e['count']} | {', '.join(f'`{n!r}`' for n in e['neighbours'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    r = report(args.run_dirs, args.top)
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
