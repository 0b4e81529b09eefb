"""Configuration of problem sources and of the training prompt set."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_ngrpo.config_loader import fail
from megatron_ngrpo.data.templates import TemplateConfig


@dataclass
class SourceConfig:
    """One file (or hub dataset) of problems.

    ``name`` alone picks a registry entry (``megatron_ngrpo.data.datasets.REGISTRY``); fields
    set next to it override the entry. Without a registry name, ``path`` is required.
    """

    name: str = ""
    # Local .json/.jsonl/.parquet (relative: to the working directory, else the data folder, megatron_ngrpo/data/paths.py), else a hub
    # dataset name loaded with `datasets.load_dataset(path, split=split)`.
    path: str = ""
    split: str = "train"
    # Dotted field paths; integer parts index lists ("prompt.0.content").
    problem_key: str = ""
    answer_key: str = ""
    # A list-valued answer: "alternatives" (each one accepted, e.g. Minerva), "first", "join".
    answer_list: Literal["", "alternatives", "first", "join"] = ""
    # AIME/AMC: answers are integers ("025" → "25", 142.0 → "142", "336^\circ" → "336").
    integer_answers: bool | None = None
    # The gold is the text after the last occurrence of this marker in the answer field, thousands
    # commas dropped (GSM8K: "####"); "" = the whole field.
    answer_after: str = ""
    # Grader of the source's answers: "math" or "mcq".
    kind: Literal["", "math", "mcq"] = ""
    # Keep only the first `limit` rows (0 = all).
    limit: int = 0

    def validate(self) -> None:
        if not self.name and not self.path:
            fail("path", self.path, "a source needs a registry name or a path")
        if self.limit < 0:
            fail("limit", self.limit, "must be >= 0")


def _default_train() -> list[SourceConfig]:
    # DeepScaleR-Preview is not obtainable here; its AIME part + MATH levels 3-5 + MATH train
    # are the best stand-ins (data/README.md), deduplicated.
    return [
        SourceConfig(name="deepscaler_aime"),
        SourceConfig(name="simplerl_math_lv3to5"),
        SourceConfig(name="deepscaler_math_train"),
    ]


@dataclass
class DataConfig:
    train: list[SourceConfig] = field(default_factory=_default_train)
    # Prompts longer than this (tokens, after templating) are dropped (paper: 4096).
    max_prompt_tokens: int = 4096
    # Drop repeated problems across and within the train files (whitespace/case-normalised).
    dedup: bool = True
    # Drop train problems that appear in these benchmarks (same normalisation).
    decontaminate: list[str] = field(
        default_factory=lambda: ["aime24", "aime25", "amc23", "amc22_23", "math500"]
    )
    # Refuse a file when more than this fraction of its rows is malformed (0: any bad row stops
    # the run before it starts).
    max_bad_fraction: float = 0.01
    # Prompts over max_prompt_tokens: "drop" them (logged) or "refuse" the data set (one line:
    # file, row, field, length).
    long_prompts: Literal["drop", "refuse"] = "drop"
    template: TemplateConfig = field(default_factory=TemplateConfig)
    # Shuffling of the prompt batches (per epoch, reproducible from seed and epoch).
    shuffle: bool = True
    seed: int = 1234
    # `datasets` cache folder (None = its default).
    cache_dir: str | None = None

    def validate(self) -> None:
        if not self.train:
            fail("train", self.train, "at least one training source is needed")
        if self.max_prompt_tokens < 1:
            fail("max_prompt_tokens", self.max_prompt_tokens, "must be >= 1")
        if not 0 <= self.max_bad_fraction <= 1:
            fail("max_bad_fraction", self.max_bad_fraction, "must be in [0, 1]")
