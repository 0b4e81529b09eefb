"""Apply each mutant of tests/mutants.py to a copy of this tree and run the test that must kill
it; print killed / survived per mutant, the total and the time (issue #45 item 2).

    python3 scripts/mutants.py                       # every mutant
    python3 scripts/mutants.py --prefix mixing. grpo.  # the entries under these prefixes
    python3 scripts/mutants.py --fast                # the mutants marked fast
    python3 scripts/mutants.py --sample 2            # CI's draw: 2 fast mutants, by date
    python3 scripts/mutants.py --out bench/results/mutants.md

A mutant whose text is not found once is an error (the registry went stale), as is a test run
that neither passes nor fails (skipped, not collected, timed out). Exit 1 unless every mutant
run is killed. One mutant at a time; each test runs with OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.live_switches import SWITCHES, TEST  # noqa: E402 (the repository on the path first)
from tests.mutants import MUTANTS, Mutant  # noqa: E402


def selected(
    prefixes: list[str], sample: int, day: datetime.date, fast: bool = False
) -> list[tuple[str, Mutant]]:
    """(entry, mutant) pairs under ``prefixes`` (all when empty; ``fast``: the fast ones);
    ``sample`` > 0: that many fast ones, a window that moves by ``sample`` every day."""
    pairs = [
        (name, m)
        for name, mutants in MUTANTS.items()
        for m in mutants
        if (not prefixes or name.startswith(tuple(prefixes))) and (m.fast or not fast)
    ]
    if sample:
        fast = [p for p in pairs if p[1].fast]
        start = day.toordinal() * sample % len(fast)
        pairs = [fast[(start + i) % len(fast)] for i in range(min(sample, len(fast)))]
    return pairs


def test_of(name: str, mutant: Mutant) -> str:
    if mutant.test:
        return mutant.test
    kind, what = SWITCHES[name]
    if kind != TEST:
        raise ValueError(f"{name}: validated only, name the mutant's test")
    return what


def copy_tree(dest: Path) -> None:
    """This checkout's tracked and untracked (not ignored) files, as the working tree has them."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in filter(None, files):
        src, dst = REPO / f.decode(), dest / f.decode()
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def run_one(name: str, mutant: Mutant, timeout: float) -> tuple[str, str, float]:
    """(verdict, detail, seconds): killed | survived | error."""
    test = test_of(name, mutant)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutant_") as tmp:
        root = Path(tmp)
        copy_tree(root)
        path = root / mutant.file
        text = path.read_text()
        if text.count(mutant.old) != 1:
            return "error", f"{mutant.file}: text found {text.count(mutant.old)} times", 0.0
        path.write_text(text.replace(mutant.old, mutant.new))
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test]
        try:
            out = subprocess.run(
                cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return "error", f"timed out after {timeout:.0f} s", time.monotonic() - start
    seconds = time.monotonic() - start
    tail = (out.stdout.strip().splitlines() or [""])[-1]
    if out.returncode == 1 and re.search(r"\d+ failed", tail):
        return "killed", tail, seconds
    if out.returncode == 0 and re.search(r"\d+ passed", tail):
        return "survived", tail, seconds
    return "error", f"rc {out.returncode}: {tail}", seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", nargs="*", default=[], help="registry entry prefixes")
    p.add_argument("--sample", type=int, default=0, help="that many fast mutants, by date")
    p.add_argument("--fast", action="store_true", help="only the mutants marked fast")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per test run")
    p.add_argument("--out", help="also write the table here (markdown)")
    args = p.parse_args(argv)
    pairs = selected(args.prefix, args.sample, datetime.date.today(), args.fast)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"Mutants at {commit} ({len(pairs)} run)\n",
        "| entry | file | mutation | test | verdict | s |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    start, verdicts = time.monotonic(), []
    for name, m in pairs:
        verdict, detail, seconds = run_one(name, m, args.timeout)
        verdicts.append(verdict)
        change = f"`{m.old.strip()}` → `{m.new.strip()}`".replace("|", "\\|")
        row = f"| {name} | {m.file} | {change} | {test_of(name, m)} | {verdict}: {detail} | {seconds:.0f} |"
        lines.append(row)
        print(row, flush=True)
    killed = verdicts.count("killed")
    total = f"\n{killed} of {len(pairs)} killed, {verdicts.count('survived')} survived, "
    total += f"{verdicts.count('error')} errors; {time.monotonic() - start:.0f} s"
    lines.append(total)
    print(total)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if killed == len(pairs) else 1


if __name__ == "__main__":
    sys.exit(main())
