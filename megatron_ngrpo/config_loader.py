"""Typed configuration: dataclasses, YAML files and dotted command-line overrides.

Each package owns the dataclass of its section (``mixing/config.py``, ``grpo/config.py``, ...);
:mod:`megatron_ngrpo.training.job_config` composes them. This module only loads and validates: OmegaConf does
the type checking and merging (structured configs), and every section may define ``validate()``
which raises :class:`ConfigError` with a one-line message naming the field and value. Everything
here runs before any process group starts. A field whose name is a Python keyword is declared with
a trailing underscore (``async_``) and read, written and named in messages without it (``async``).

A field annotated ``Literal[...]`` (or an ``Enum``, optionally ``| None``) takes one of those values:
the annotation is the one list of what is allowed (:func:`choices`), checked in every YAML file and
override before OmegaConf merges it (so that the message names the field's whole path, list
indices included) and in :func:`validate` for configs built in Python.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import keyword
import os
import sys
import types
import typing
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")
# Deepest nesting of mappings and lists a config file or override may have (the trainer's: 4).
MAX_DEPTH = 32


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the source, field and value."""


def launch_world_size() -> int:
    """The world size a config is validated against before any process group starts
    (torchrun's ``WORLD_SIZE``; 1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def fail(field: str, value, why: str) -> None:
    raise ConfigError(f"config field '{field}' = {value!r}: {why}")


def load(
    cls: type[T],
    yaml_paths: list[str | Path] | str | Path | None = None,
    overrides: list[str] | None = None,
) -> T:
    """Defaults of ``cls`` ← each YAML file in order ← ``key.sub=value`` overrides; validated.

    Raises :class:`ConfigError` (one line) on unknown keys, wrong types or invalid values.
    Top-level sections renamed in ``cls.RENAMED`` (old → new) are still read under their old
    name, with a one-line deprecation message on stderr.
    """
    obj = compose(cls, yaml_paths, overrides)
    validate(obj)
    return obj


def compose(
    cls: type[T],
    yaml_paths: list[str | Path] | str | Path | None = None,
    overrides: list[str] | None = None,
) -> T:
    """:func:`load` without the ``validate()`` calls (types and keys are still checked): for a
    launcher reading a job's fields where the files the config names live on the cluster."""
    renamed = getattr(cls, "RENAMED", {})
    if isinstance(yaml_paths, (str, Path)):
        yaml_paths = [yaml_paths]
    merged = _structured(cls)
    for path in yaml_paths or []:
        source = f"config file {str(path)!r}"
        data = _keyword_fields(_rename_sections(_read_yaml(Path(path)), renamed, source))
        _check_input(cls, data)
        merged = _merge(merged, data, source)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        head = item.split("=", 1)[0].split(".", 1)[0]
        if head in renamed:
            _deprecated(head, renamed[head], f"override {item!r}")
            item = renamed[head] + item[len(head) :]
        key, value = item.split("=", 1)
        item = ".".join(_field_name(k) for k in key.split(".")) + "=" + value
        _check_events(value, f"override {item!r}")
        try:
            parsed = OmegaConf.from_dotlist([item])
        except (yaml.YAMLError, OmegaConfBaseException) as e:
            raise ConfigError(
                f"override {item!r}: cannot parse the value: {_one_line(e)}"
            ) from None
        _check_input(cls, OmegaConf.to_container(parsed))
        merged = _merge(merged, parsed, f"override {item!r}")
    return OmegaConf.to_object(merged)


@functools.cache
def _structured(cls: type):
    """``cls``'s defaults as a structured config, built once (a few hundred ms for the trainer's):
    merging copies it, nothing here changes it."""
    return OmegaConf.structured(cls)


def _read_yaml(path: Path) -> dict:
    """A config file's top-level mapping; every problem one :class:`ConfigError` line naming the
    file (missing, not UTF-8, invalid YAML, an alias, too deeply nested, not a mapping)."""
    source = f"config file {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{source} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{source}: not UTF-8 text: byte {raw[e.start]:#04x} at offset {e.start}"
        ) from None
    _check_events(text, source)
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping")
    return data


def _check_events(text: str, source: str) -> None:
    """Refuses YAML aliases (``*name``) and nesting deeper than :data:`MAX_DEPTH` before anything
    builds the data: OmegaConf copies each alias, so a few hundred bytes of nested aliases (an
    "alias bomb") would expand without end, and deep nesting overflows the recursive builders.
    The event stream is read iteratively; syntax errors are left to the parser that reads the
    text next."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise ConfigError(
                    f"{source}: YAML alias '*{event.anchor}' (line {event.start_mark.line + 1}): "
                    "aliases are not read, write the value out"
                )
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise ConfigError(
                        f"{source}: nested deeper than {MAX_DEPTH} levels "
                        f"(line {event.start_mark.line + 1})"
                    )
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError:
        pass


def validate(obj, prefix: str = "") -> None:
    """Check ``obj``'s :func:`choices` fields and call its ``validate()``, and so for every nested
    dataclass (lists of them included: ``name[i].field`` in messages), innermost first."""
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{_key_name(f.name)}"
        if dataclasses.is_dataclass(value):
            validate(value, f"{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    validate(item, f"{name}[{i}].")
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        _check_choice(hints[f.name], getattr(obj, f.name), f"{prefix}{_key_name(f.name)}")
    if hasattr(obj, "validate"):
        try:
            obj.validate()
        except ConfigError as e:
            msg = str(e)
            if prefix and msg.startswith("config field '"):
                msg = msg.replace("config field '", f"config field '{prefix}", 1)
            raise ConfigError(msg) from None


def choices(annotation) -> tuple | None:
    """The values a field annotated ``annotation`` may take: a ``Literal``'s, an ``Enum``'s (its
    values), plus None when it is optional (``| None``); None for any other annotation."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return tuple(m.value for m in annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        parts = [(None,) if a is type(None) else choices(a) for a in typing.get_args(annotation)]
        if all(p is not None for p in parts):
            return tuple(v for p in parts for v in p)
    return None


def _check_choice(annotation, value, field: str) -> None:
    allowed = choices(annotation)
    if allowed is not None and value not in allowed:
        fail(field, value, f"expected one of {allowed}")


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _dataclass_of(annotation) -> type | None:
    """The dataclass an annotation holds directly or as ``X | None``."""
    args = (
        typing.get_args(annotation)
        if typing.get_origin(annotation)
        in (
            typing.Union,
            types.UnionType,
        )
        else (annotation,)
    )
    found = [a for a in args if dataclasses.is_dataclass(a)]
    return found[0] if found else None


def _check_input(cls: type, data, path: str = "") -> None:
    """The :func:`choices` fields of ``cls`` in ``data`` (a YAML file's or an override's plain
    mapping, field names as declared); unknown keys are left to OmegaConf. The message is the one
    :func:`validate` gives (the field's whole path, list indices included)."""
    if not isinstance(data, dict):
        return
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, field, annotation = data[f.name], f"{path}{_key_name(f.name)}", hints[f.name]
        if isinstance(value, str) and value.startswith("${"):
            continue  # an interpolation: OmegaConf resolves (and checks) it
        _check_choice(annotation, value, field)
        inner = _dataclass_of(annotation)
        if inner is not None:
            _check_input(inner, value, f"{field}.")
        elif typing.get_origin(annotation) is list and isinstance(value, list):
            item = typing.get_args(annotation)[0]
            if dataclasses.is_dataclass(item):
                for i, v in enumerate(value):
                    _check_input(item, v, f"{field}[{i}].")


def to_yaml(obj) -> str:
    """The resolved config as YAML (saved next to checkpoints and runs)."""
    plain = OmegaConf.to_container(OmegaConf.structured(obj))
    return OmegaConf.to_yaml(OmegaConf.create(_keyword_fields(plain, _key_name)))


def _field_name(key: str) -> str:
    return key + "_" if keyword.iskeyword(key) else key


def _key_name(name: str) -> str:
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def _keyword_fields(data, rename=_field_name):
    """Nested mapping with every key renamed by ``rename`` (YAML keys -> field names or back)."""
    if isinstance(data, dict):
        return {
            rename(k) if isinstance(k, str) else k: _keyword_fields(v, rename)
            for k, v in data.items()
        }
    return data


def _rename_sections(data: dict, renamed: dict[str, str], source: str) -> dict:
    for old, new in renamed.items():
        if old in data:
            if new in data:
                raise ConfigError(
                    f"{source}: both {old!r} (the old name) and {new!r}; keep {new!r}"
                )
            _deprecated(old, new, source)
            data = {(new if k == old else k): v for k, v in data.items()}
    return data


def _deprecated(old: str, new: str, source: str) -> None:
    print(f"deprecated: {source}: section {old!r} is now {new!r}", file=sys.stderr)


def _merge(base, other, source: str):
    try:
        return OmegaConf.merge(
            base, other if OmegaConf.is_config(other) else OmegaConf.create(other)
        )
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        raise ConfigError(
            f"{source}: field {key!r}: {_one_line(e).split(' full_key:')[0]}"
        ) from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())
