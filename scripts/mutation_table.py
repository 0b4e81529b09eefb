"""Per-module table of a mutmut run (scripts/mutation_score.sh): killed, survived and the rest.

Usage: python3 scripts/mutation_table.py RESULTS MODULE... (RESULTS: ``mutmut results --all true``;
MODULE: a path under megatron_ngrpo/ without .py, e.g. grpo/kl). Prints a markdown table and the
surviving mutants' names.
"""

from __future__ import annotations

import collections
import sys


def main(results: str, modules: list[str]) -> None:
    counts = {m: collections.Counter() for m in modules}
    survivors = []
    with open(results) as f:
        for line in f:
            name, _, status = line.strip().rpartition(": ")
            for m in modules:
                if name.startswith(f"megatron_ngrpo.{m.replace('/', '.')}."):
                    counts[m][status] += 1
                    if status != "killed":
                        survivors.append(f"{name}: {status}")
    print("| module | mutants | killed | survived | other | score |")
    print("|---|---|---|---|---|---|")
    total = collections.Counter()
    for m, c in counts.items():
        total.update(c)
        print(_row(f"`{m}.py`", c))
    print(_row("**all**", total))
    print("\n".join(survivors))


def _row(label: str, c: collections.Counter) -> str:
    n = sum(c.values())
    other = n - c["killed"] - c["survived"]
    score = f"{100 * c['killed'] / n:.1f} %" if n else "not run"
    return f"| {label} | {n} | {c['killed']} | {c['survived']} | {other} | {score} |"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
