"""config_loader: a field's ``Literal`` (or ``Enum``) annotation is the one list of its allowed
values, checked in YAML files, overrides and configs built in Python, with one line naming the
field's whole path, the value and the allowed ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

import pytest

from megatron_ngrpo.config_loader import ConfigError, choices, load, validate
from megatron_ngrpo.data.config import DataConfig, SourceConfig
from megatron_ngrpo.mixing.config import MixingConfig


class Colour(StrEnum):
    red = "red"
    blue = "blue"


@dataclass
class Item:
    kind: Literal["a", "b"] = "a"


@dataclass
class Inner:
    mode: Literal["x", "y"] | None = None
    colour: Colour = Colour.red
    items: list[Item] = field(default_factory=list)


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    name: str = ""


def test_choices_of_an_annotation():
    assert choices(Literal["a", "b"]) == ("a", "b")
    assert choices(Literal["a"] | None) == ("a", None)
    assert choices(Colour) == ("red", "blue")
    assert choices(str) is None and choices(int | None) is None


def test_yaml_and_override_errors_name_the_whole_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  items:\n    - {kind: a}\n    - {kind: c}\n")
    with pytest.raises(ConfigError) as e:
        load(Outer, path)
    assert str(e.value) == "config field 'inner.items[1].kind' = 'c': expected one of ('a', 'b')"
    with pytest.raises(ConfigError, match=r"^config field 'inner.mode' = 'z': expected one of "):
        load(Outer, overrides=["inner.mode=z"])
    with pytest.raises(ConfigError, match=r"'inner.colour' = 'green': expected one of \('red',"):
        load(Outer, overrides=["inner.colour=green"])
    cfg = load(Outer, overrides=["inner.mode=null", "inner.colour=blue", "inner.items=[{kind: b}]"])
    assert cfg.inner.mode is None and cfg.inner.colour == Colour.blue
    assert cfg.inner.items[0].kind == "b"


def test_configs_built_in_python_are_checked():
    with pytest.raises(ConfigError, match=r"^config field 'inner.items\[0\].kind' = 'c'"):
        validate(Outer(Inner(items=[Item("c")])))
    with pytest.raises(ConfigError, match=r"^config field 'neighbor_lookup' = 'lazy': expected"):
        validate(MixingConfig(neighbor_lookup="lazy"))
    with pytest.raises(ConfigError, match=r"^config field 'train\[0\].kind' = 'text'"):
        validate(DataConfig(train=[SourceConfig(name="aime24", kind="text")]))
    validate(MixingConfig(strategy="gumbel", metric="l1"))
