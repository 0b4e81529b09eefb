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
                    if status not in ("killed", "timeout", "not checked"):
                        survivors.append(f"{name}: {status}")
    print("| module | mutants | run | killed | timeout | survived | no tests | score |")
    print("|---|---|---|---|---|---|---|---|")
    total = collections.Counter()
    for m, c in counts.items():
        total.update(c)
        print(_row(f"`{m}.py`", c))
    print(_row("**all**", total))
    print("\n".join(survivors))


def _row(label: str, c: collections.Counter) -> str:
    """Score: killed (a test failed, or the tests ran past mutmut's time limit) over mutants run;
    "no tests": no selected test reaches the mutated function (counted as not killed)."""
    n = sum(c.values())
    run = n - c["not checked"]
    dead = c["killed"] + c["timeout"]
    score = f"{100 * dead / run:.1f} %" if run else "not run"
    cells = [n, run, c["killed"], c["timeout"], c["survived"], c["no tests"], score]
    return f"| {label} | " + " | ".join(map(str, cells)) + " |"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
