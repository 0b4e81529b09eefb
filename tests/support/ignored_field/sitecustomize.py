"""The generic mutant of a live-switch entry (scripts/mutants.py, issue #45 item 2): the option is
ignored. The runner copies this file into the root of a copy of the tree with ``ignored_field.json``
beside it (``{"module", "cls", "field"}``); every Python process whose path holds that root
(pytest, torchrun workers, servers and CLIs the tests start) then builds that dataclass with the
field at its default, whatever a config file, an override or a test passes. Each build that
replaced another value appends a line to ``ignored_field.hits`` beside it, so the runner can tell
a test that never sets the field. Nothing in the package carries a hook for it."""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import inspect
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPEC = json.loads((HERE / "ignored_field.json").read_text())


def _ignore(module) -> None:
    """Wrap the dataclass's ``__init__``: the field gets its default before ``__post_init__``."""
    cls = getattr(module, SPEC["cls"])
    field = next(f for f in dataclasses.fields(cls) if f.name == SPEC["field"])
    init = cls.__init__
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        given = bound.arguments.get(field.name, default)
        if given != default:
            with open(HERE / "ignored_field.hits", "a") as hits:
                hits.write(f"{cls.__name__}.{field.name}: {given!r} -> {default!r}\n")
        bound.arguments[field.name] = default
        init(*bound.args, **bound.kwargs)

    cls.__init__ = __init__


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
