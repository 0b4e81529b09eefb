"""The live switches' mutants (tests/mutants.py, scripts/mutants.py): every mutant still applies
to the source and names a live entry and a test that exists, and a rotating sample of 2 fast
mutants (a window over them that moves every day) is killed by its test: about 1 to 3 minutes on
a loaded 2-core machine. The whole set runs outside the suite: ``python3 scripts/mutants.py``."""

from __future__ import annotations

import ast
import datetime
import importlib.util
from pathlib import Path

from tests.live_switches import SWITCHES, TEST
from tests.mutants import MUTANTS

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutants_runner", REPO / "scripts" / "mutants.py")
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)


def test_every_mutant_applies_and_names_a_live_entry_and_a_real_test():
    bad = []
    for name, mutants in MUTANTS.items():
        if SWITCHES.get(name, ("", ""))[0] != TEST:
            bad.append(f"{name}: not a live entry of tests/live_switches.py")
            continue
        for m in mutants:
            found = (REPO / m.file).read_text().count(m.old)
            if found != 1:
                bad.append(f"{name}: {m.file} has its text {found} times")
            path, _, func = runner.test_of(name, m).partition("::")
            tree = ast.parse((REPO / path).read_text())
            if func.split("[")[0] not in {
                n.name for n in tree.body if isinstance(n, ast.FunctionDef)
            }:
                bad.append(f"{name}: no test {path}::{func}")
    assert not bad, "\n".join(bad)
    assert sum(m.fast for ms in MUTANTS.values() for m in ms) >= 2


def test_a_rotating_sample_of_mutants_is_killed():
    pairs = runner.selected([], 2, datetime.date.today())
    assert len(pairs) == 2
    for name, mutant in pairs:
        verdict, detail, _ = runner.run_one(name, mutant, timeout=600)
        assert verdict == "killed", (name, mutant, verdict, detail)
