"""Every field of every config dataclass, named as tests/live_switches.py names it: the walker of
the live-switch registry (tests/test_live_switches.py) and of its mutants (scripts/mutants.py)."""

from __future__ import annotations

import dataclasses
import typing

from megatron_ngrpo.eval.config import EvalConfig
from megatron_ngrpo.launch.executors import Cluster
from megatron_ngrpo.training.job_config import NGRPOConfig

# The config roots and the prefix of their fields' names in the registry.
ROOTS = {"": NGRPOConfig, "eval.": EvalConfig, "launch.cluster.": Cluster}


def _dataclass_in(tp) -> type | None:
    """The dataclass a field's type holds (itself, in a list, or optional), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    return next(filter(None, map(_dataclass_in, typing.get_args(tp))), None)


def config_fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every field of every config dataclass reachable from the roots, named by its first path
    (a dataclass reached again, e.g. the evaluation's ``model``, is not listed twice): dotted
    name → the dataclass and its field. A field whose type is a dataclass is a section (its fields
    are listed instead); a list or optional of one is a field itself, and its fields are listed
    too."""
    out: dict[str, tuple[type, dataclasses.Field]] = {}
    seen: set[type] = set()

    def walk(cls: type, prefix: str) -> None:
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name = prefix + f.name.removesuffix("_")  # train.async_ is written train.async
            inner = _dataclass_in(hints[f.name])
            if inner is None or inner is not hints[f.name]:
                out[name] = (cls, f)
            if inner is not None and inner not in seen:
                walk(inner, name + ".")

    for prefix, root in ROOTS.items():
        walk(root, prefix)
    return out
