"""Apply each mutant of tests/mutants.py to a copy of this tree and run the test that must kill
it; print killed / survived per mutant (its registry entry first), the total and the time
(issue #45 item 2).

    python3 scripts/mutants.py                         # every mutant of every live entry
    python3 scripts/mutants.py --prefix mixing. grpo.  # the entries under these prefixes
    python3 scripts/mutants.py --exact --prefix data.train # that entry only, not data.train.split
    python3 scripts/mutants.py --kind ignored          # the generic mutants only (or: patch)
    python3 scripts/mutants.py --fast                  # the mutants marked fast
    python3 scripts/mutants.py --sample 1              # CI's draw: 1 generic FAST mutant, by date
    python3 scripts/mutants.py --out bench/results/mutants_registry.md

Runs go in the order of the prefixes given, cheapest first under each (the fast tests, then
the unit-level ones, the trainer-level tests/test_live_switches.py ones last); --out is rewritten after every run, so a run stopped
early keeps its table. A patch whose text is not found once is an error (the registry went
stale), as is a test run that neither passes nor fails (skipped, not collected, timed out). Exit
1 unless every mutant run is killed. One mutant per run, never batched (entries that share a
test each get their own run); each test runs with OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import datetime
import json
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

from tests.harness.config_fields import config_fields  # noqa: E402 (the repository on the path first)
from tests.live_switches import LIVE, SWITCHES, TEST  # noqa: E402
from tests.mutants import FAST, Ignored, Mutant, mutants_of  # noqa: E402

SITE = REPO / "tests" / "support" / "ignored_field" / "sitecustomize.py"
KINDS = {"ignored": Ignored, "patch": Mutant}


def test_of(name: str, mutant: Mutant | Ignored) -> str:
    if mutant.test:
        return mutant.test
    kind, what = SWITCHES[name]
    if kind != TEST:
        raise ValueError(f"{name}: validated only, name the mutant's test")
    return what


def _cost(pair: tuple[str, Mutant | Ignored]) -> tuple[bool, bool]:
    test = test_of(*pair)
    return (test not in FAST and not pair[1].fast, test.startswith(LIVE))


def selected(
    prefixes: list[str],
    sample: int,
    day: datetime.date,
    fast: bool = False,
    kind: str = "",
    exact: bool = False,
) -> list[tuple[str, Mutant | Ignored]]:
    """(entry, mutant) pairs under ``prefixes`` (all when empty; ``exact``: the entries so named
    only; ``fast``: the fast ones; ``kind``: one kind), in the prefixes' order, cheapest first
    under each; ``sample`` > 0: that many generic mutants of ``FAST`` tests, a window that moves
    by ``sample`` every day."""

    def under(name: str, prefix: str) -> bool:
        return name == prefix if exact else name.startswith(prefix)

    pairs = [
        (name, m)
        for name in SWITCHES
        for m in mutants_of(name)
        if (not prefixes or any(under(name, x) for x in prefixes))
        and (m.fast or not fast)
        and (not kind or isinstance(m, KINDS[kind]))
    ]
    if sample:
        fast_ones = [p for p in pairs if isinstance(p[1], Ignored) and p[1].fast]
        start = day.toordinal() * sample % len(fast_ones)
        return [fast_ones[(start + i) % len(fast_ones)] for i in range(min(sample, len(fast_ones)))]
    first = [next((i for i, x in enumerate(prefixes) if under(n, x)), 0) for n, _ in pairs]
    return [p for _, p in sorted(zip(first, pairs), key=lambda fp: (fp[0], *_cost(fp[1])))]


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


def apply(name: str, mutant: Mutant | Ignored, root: Path) -> str:
    """Mutate the copy at ``root``; an error line, or "" when applied."""
    if isinstance(mutant, Ignored):
        cls, field = config_fields()[name]
        spec = {"module": cls.__module__, "cls": cls.__qualname__, "field": field.name}
        (root / "ignored_field.json").write_text(json.dumps(spec))
        shutil.copy2(SITE, root / "sitecustomize.py")
        return ""
    path = root / mutant.file
    text = path.read_text()
    if text.count(mutant.old) != 1:
        return f"{mutant.file}: text found {text.count(mutant.old)} times"
    path.write_text(text.replace(mutant.old, mutant.new))
    return ""


def run_one(name: str, mutant: Mutant | Ignored, timeout: float) -> tuple[str, str, float]:
    """(verdict, detail, seconds): killed | survived | error."""
    test = test_of(name, mutant)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutant_") as tmp:
        root = Path(tmp)
        copy_tree(root)
        error = apply(name, mutant, root)
        if error:
            return "error", error, 0.0
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test]
        try:
            out = subprocess.run(
                cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return "error", f"timed out after {timeout:.0f} s", time.monotonic() - start
        hits = root / "ignored_field.hits"
        replaced = len(hits.read_text().splitlines()) if hits.exists() else 0
    seconds = time.monotonic() - start
    tail = (out.stdout.strip().splitlines() or [""])[-1]
    if isinstance(mutant, Ignored):
        tail += f"; {replaced} values replaced" if replaced else "; never given another value"
    if out.returncode == 1 and re.search(r"\d+ failed", tail):
        # The first error line: what the test saw change (or a crash, for the reader to judge).
        seen = next((ln[1:].strip() for ln in out.stdout.splitlines() if ln.startswith("E ")), "")
        return "killed", f"{tail}; {seen[:160]}".replace("|", "\\|"), seconds
    if out.returncode == 0 and re.search(r"\d+ passed", tail):
        return "survived", tail, seconds
    return "error", f"rc {out.returncode}: {tail}", seconds


def describe(mutant: Mutant | Ignored) -> tuple[str, str]:
    """The table's file and mutation cells."""
    if isinstance(mutant, Ignored):
        return "(the field's dataclass)", "ignored: kept at its default"
    change = f"`{mutant.old.strip()}` → `{mutant.new.strip()}`".replace("|", "\\|")
    return mutant.file, change


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", nargs="*", default=[], help="registry entry prefixes")
    p.add_argument("--exact", action="store_true", help="the prefixes are whole entry names")
    p.add_argument("--kind", choices=sorted(KINDS), default="", help="one kind of mutant")
    p.add_argument("--sample", type=int, default=0, help="that many generic FAST mutants, by date")
    p.add_argument("--fast", action="store_true", help="only the mutants marked fast")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per test run")
    p.add_argument("--out", help="also write the table here (markdown), after every run")
    args = p.parse_args(argv)
    pairs = selected(
        args.prefix, args.sample, datetime.date.today(), args.fast, args.kind, args.exact
    )
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"Mutants at {commit} ({len(pairs)} to run: {' '.join(sys.argv[1:]) or 'all'})\n",
        "| entry | file | mutation | test | verdict | s |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    start, verdicts = time.monotonic(), []
    for name, m in pairs:
        verdict, detail, seconds = run_one(name, m, args.timeout)
        verdicts.append(verdict)
        file, change = describe(m)
        test = test_of(name, m)
        lines.append(
            f"| {name} | {file} | {change} | {test} | {verdict}: {detail} | {seconds:.0f} |"
        )
        print(lines[-1], flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text("\n".join(lines) + "\n")
    killed = verdicts.count("killed")
    total = f"\n{killed} of {len(pairs)} killed, {verdicts.count('survived')} survived, "
    total += f"{verdicts.count('error')} errors; {time.monotonic() - start:.0f} s"
    lines.append(total)
    print(total)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if killed == len(pairs) else 1


if __name__ == "__main__":
    sys.exit(main())
