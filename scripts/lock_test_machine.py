"""The test machine's lock: every distribution scripts/setup.sh installs (megatron_ngrpo's
requirements with its vllm, dev, launch, trackers and peer extras, torch, and their requirements,
recursively) at the version installed here, as the pip constraints file setup.sh installs with.

    python3 scripts/lock_test_machine.py > scripts/constraints.txt   # after an upgrade that passed

A fresh machine then gets the versions the suite last passed with, not each dependency's newest
release (a new mlflow-skinny on a fresh CI machine left the job image's pin unread, 2026-12-02).
Local version tags (torch's ``+cpu``) are dropped: ``==2.13.0`` admits ``2.13.0+cpu``. Package
metadata only: nothing is imported.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_ngrpo import pins  # noqa: E402 (standard library only; the checkout's, first on the path)

EXTRAS = ("vllm", "dev", "launch", "trackers", "peer")  # scripts/setup.sh's
REMOVED = {"torchvision", "torchaudio", "torchcodec"}  # setup.sh uninstalls them


def installed_closure() -> dict[str, str]:
    """Name → installed version of every distribution the roots need on this machine."""
    roots = ["torch", *pins.INSTALL_REQUIRES, *(r for e in EXTRAS for r in pins.EXTRAS[e])]
    todo = [Requirement(r) for r in roots]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    found: dict[str, str] = {}
    while todo:
        req = todo.pop()
        name, extras = canonicalize_name(req.name), sorted(req.extras)
        if name in REMOVED or (name, tuple(extras)) in seen:
            continue
        seen.add((name, tuple(extras)))
        try:
            found[name] = md.version(name)
            texts = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # a marker that does not hold here (e.g. another platform's)
        for text in texts:
            dep = Requirement(text)
            if not dep.marker or any(dep.marker.evaluate({"extra": e}) for e in ["", *extras]):
                todo.append(dep)
    return found


if __name__ == "__main__":
    lock = installed_closure()
    sys.stdout.write(
        "# The test machine's exact versions (Linux x86_64, Python 3.11, CPU): scripts/setup.sh\n"
        "# installs with this constraints file. Written by scripts/lock_test_machine.py.\n"
        + "".join(f"{n}=={v.split('+')[0]}\n" for n, v in sorted(lock.items()))
    )
