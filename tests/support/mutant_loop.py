"""pytest plugin: the selected tests run once unmutated, then once per mutmut mutant named in
``$MUTANTS_FILE`` (whitespace-separated names), all in this one process, each mutant switched on
by ``MUTANT_UNDER_TEST`` (mutmut's trampolines read it on every call); one line per mutant to
``$MUT_OUT``: ``name: killed|survived [first failing test] seconds``.

A quick re-check of the verdicts of scripts/mutation_score.sh after tests were added (mutmut
forks a fresh pytest per mutant: minutes per module on a loaded 2-core machine; this: seconds),
run in its mutated tree::

    cd $MUTATION_WORK/mutants && MUTANTS_FILE=names MUT_OUT=out PYTHONPATH=. \\
        python3 -m pytest -q -p no:cacheprovider -p tests.support.mutant_loop tests/test_X.py

Each test item runs its whole protocol (fixtures set up and torn down) per mutant; a test that
keeps state across items outside its fixtures can still carry one mutant's effect into the next:
mutmut's own run is the reference (bench/results/mutation_score.md says which verdict is which).
"""

from __future__ import annotations

import os
import signal
import time

from _pytest.runner import runtestprotocol


class _Timeout(Exception):
    pass


def _alarm(*_) -> None:
    raise _Timeout()


def _first_failure(session) -> str | None:
    """The node id of the first item that fails (or runs over $MUT_TIMEOUT s), else None."""
    items = session.items
    for k, item in enumerate(items):
        signal.alarm(int(os.environ.get("MUT_TIMEOUT", "60")))
        try:
            nextitem = items[k + 1] if k + 1 < len(items) else None
            reports = runtestprotocol(item, log=False, nextitem=nextitem)
        except _Timeout:
            session._setupstate.teardown_exact(None)
            return f"{item.nodeid} (timeout)"
        finally:
            signal.alarm(0)
        if any(r.failed for r in reports):
            session._setupstate.teardown_exact(None)
            return item.nodeid
    return None


def pytest_runtestloop(session) -> bool:
    if not session.items:
        raise SystemExit("mutant_loop: no test selected")
    names = open(os.environ["MUTANTS_FILE"]).read().split()
    signal.signal(signal.SIGALRM, _alarm)
    with open(os.environ["MUT_OUT"], "a") as out:
        for name in ["", *names]:  # "": the unmutated tests, which must pass
            os.environ["MUTANT_UNDER_TEST"] = name
            start = time.time()
            first = _first_failure(session)
            verdict = f"killed {first}" if first else "survived"
            out.write(f"{name or 'UNMUTATED'}: {verdict} {time.time() - start:.1f}s\n")
            out.flush()
            if not name and first:
                out.write("the unmutated tests fail: stopped\n")
                break
    return True
