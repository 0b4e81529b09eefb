"""The live switches' mutants (tests/mutants.py, scripts/mutants.py): every live entry carries its
generic mutant (the field, found by the registry's walker, kept at its default), every
hand-written mutant still applies to the source and names a live entry and a test that exists,
and a rotating sample of 1 generic mutant of a FAST test (a window over them that moves every
day) is killed by its test: about 20 s of CPU (a fresh interpreter, its imports, a unit test).
The whole set runs outside the suite: ``python3 scripts/mutants.py``."""

from __future__ import annotations

import ast
import datetime
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.harness.config_fields import config_fields
from tests.live_switches import SWITCHES, TEST
from tests.mutants import MUTANTS, Ignored, mutants_of

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutants_runner", REPO / "scripts" / "mutants.py")
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)


def test_every_live_entry_carries_its_generic_mutant():
    fields = config_fields()
    bad = []
    for name, (kind, _) in SWITCHES.items():
        kinds = [type(m) for m in mutants_of(name)]
        if kind == TEST and kinds[:1] != [Ignored]:
            bad.append(f"{name}: live, no generic mutant")
        elif kind == TEST and fields[name][0].__dataclass_params__.frozen:
            bad.append(f"{name}: a frozen dataclass's field, the generic mutant cannot reach it")
        elif kind != TEST and kinds:
            bad.append(f"{name}: validated only, but carries mutants")
    assert not bad, "\n".join(bad)


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
    assert sum(m.fast for name in SWITCHES for m in mutants_of(name)) >= 2


TOY = """
import dataclasses

@dataclasses.dataclass
class Toy:
    rate: float = 0.5
    ids: list = dataclasses.field(default_factory=lambda: [1])

    def __post_init__(self):
        self.seen = (self.rate, self.ids)
"""


def test_the_generic_mutant_builds_the_field_at_its_default(tmp_path):
    """In a process with the mutant's root on its path, the dataclass's field keeps its default
    (keyword, positional, default factory, ``replace``, assignment; ``__post_init__`` sees it),
    other fields untouched, and each replaced value is recorded."""
    (tmp_path / "toy.py").write_text(TOY)
    (tmp_path / "sitecustomize.py").write_text(runner.SITE.read_text())
    code = (
        "import dataclasses, toy; t = toy.Toy(rate=0.9, ids=[7]); t.rate, t.ids = 0.8, [8]\n"
        "print(t.seen, toy.Toy(0.1).seen, dataclasses.replace(t, rate=0.2).seen, (t.rate, t.ids))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    seen = {}
    for field in ("rate", "ids"):
        spec = {"module": "toy", "cls": "Toy", "field": field}
        (tmp_path / "ignored_field.json").write_text(json.dumps(spec))
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr[-2000:]
        seen[field] = out.stdout.strip()
    assert seen == {
        "rate": "(0.5, [7]) (0.5, [1]) (0.5, [8]) (0.5, [8])",
        "ids": "(0.9, [1]) (0.1, [1]) (0.2, [1]) (0.8, [1])",
    }
    hits = (tmp_path / "ignored_field.hits").read_text().splitlines()
    assert hits == [
        *("Toy.rate: 0.9 -> 0.5", "Toy.rate: 0.8 -> 0.5", "Toy.rate: 0.1 -> 0.5"),
        *("Toy.rate: 0.2 -> 0.5", "Toy.ids: [7] -> [1]", "Toy.ids: [8] -> [1]"),
    ]


def test_a_rotating_sample_of_mutants_is_killed():
    pairs = runner.selected([], 1, datetime.date.today())
    assert len(pairs) == 1
    for name, mutant in pairs:
        verdict, detail, _ = runner.run_one(name, mutant, timeout=600)
        assert verdict == "killed", (name, mutant, verdict, detail)


def test_exact_selects_the_named_entries_in_their_order():
    day = datetime.date.today()
    under = {name for name, _ in runner.selected(["data.train"], 0, day, kind="ignored")}
    assert {"data.train", "data.train.split"} <= under
    exact = runner.selected(["optim.lr", "data.train"], 0, day, kind="ignored", exact=True)
    assert [name for name, _ in exact] == ["optim.lr", "data.train"]
