"""The generic mutant of a live-switch entry (scripts/mutants.py, issue #45 item 2): the option is
ignored. The runner copies this file into the root of a copy of the tree with ``ignored_field.json``
beside it (``{"module", "cls", "field"}``); every Python process whose path holds that root
(pytest, torchrun workers, servers and CLIs the tests start) then keeps that dataclass's field at
its default, whatever a config file, an override or a test gives it (the config dataclasses are
not frozen: every assignment, ``__init__``'s included, goes through ``__setattr__``). Each value
replaced appends a line to ``ignored_field.hits`` beside it, so the runner can tell a test that
never sets the field. Nothing in the package carries a hook for it."""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPEC = json.loads((HERE / "ignored_field.json").read_text())


def _ignore(module) -> None:
    """Wrap the dataclass's ``__setattr__``: the field always takes its default, in ``__init__``
    (so ``__post_init__`` sees the default), ``dataclasses.replace`` and later assignments."""
    cls = getattr(module, SPEC["cls"])
    field = next(f for f in dataclasses.fields(cls) if f.name == SPEC["field"])
    setattr_ = cls.__setattr__

    def __setattr__(self, name, value):
        if name == field.name:
            default = (
                field.default_factory() if field.default is dataclasses.MISSING else field.default
            )
            if value != default:
                with open(HERE / "ignored_field.hits", "a") as hits:
                    hits.write(f"{cls.__name__}.{name}: {value!r} -> {default!r}\n")
            value = default
        setattr_(self, name, value)

    cls.__setattr__ = __setattr__


class _Patcher(importlib.abc.MetaPathFinder):
    """Patches the dataclass's module right after it is first executed."""

    def find_spec(self, name, path, target=None):
        if name != SPEC["module"]:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _ignore(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patcher())
