"""Problems with verifiable answers: loading, answer clean-up, validation, dedup, prompt filtering.

Files are read with the ``datasets`` library (json/jsonl/parquet, or a hub name when one is
reachable). Every row is checked: a missing/null/empty/ill-typed problem or answer is reported
with its file and 0-based row number and skipped; a file with more than ``max_bad_fraction``
bad rows is refused with a one-line :class:`DataError`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.data.config import DataConfig, SourceConfig
from megatron_ngrpo.data.paths import find_data, searched
from megatron_ngrpo.data.templates import (
    TRAIN_INSTRUCTION,
    TemplateConfig,
    encode_prompt,
    math_message,
)
from megatron_ngrpo.rewards.equivalence import is_parseable

logger = logging.getLogger(__name__)


class DataError(ConfigError):
    """Unusable data (one line: file, rows, reason)."""


# Every file of the repository's data/ (data/README.md tables). Paths are relative to the data folder.
REGISTRY: dict[str, SourceConfig] = {
    # --- evaluation ---
    "aime24": SourceConfig(path="eval/deepscaler/aime24.json", integer_answers=True),
    # The clean AIME 2025 copy (rows 0-14: I, 15-29: II); row 19's "336^\circ" becomes "336".
    "aime25": SourceConfig(
        path="eval/aime25/aime25_skywork_or1.parquet",
        problem_key="prompt.0.content",
        answer_key="reward_model.ground_truth",
        integer_answers=True,
    ),
    # Cross-check only: rows 18, 19, 27 have \f/\t escapes turned into control characters.
    "aime25_areal": SourceConfig(path="eval/aime25/aime25_areal.jsonl", integer_answers=True),
    # The 40-problem AMC 2023 set (Qwen2.5-Math harness); most papers' "AMC23".
    "amc23": SourceConfig(path="eval/amc23/amc23.jsonl", integer_answers=True),
    # The 83-problem AMC 2022+2023 set DeepScaleR reports as "AMC".
    "amc22_23": SourceConfig(path="eval/deepscaler/amc22_23.json", integer_answers=True),
    "math500": SourceConfig(path="eval/deepscaler/math500.json"),
    # 1-3 equivalent forms per answer, each accepted.
    "minerva": SourceConfig(path="eval/deepscaler/minerva.json", answer_list="alternatives"),
    # One string per answer; multi-answer problems list them inside it ("$69$,$84$").
    "olympiad_bench": SourceConfig(path="eval/deepscaler/olympiad_bench.json", answer_list="join"),
    # --- training ---
    "simplerl_math_lv3to5": SourceConfig(
        path="train/simplerl_math_lv3to5_8523.parquet", problem_key="question"
    ),
    "deepscaler_math_train": SourceConfig(path="train/deepscaler_math_train.json"),
    "deepscaler_aime": SourceConfig(
        path="train/deepscaler_aime_1983_2023.json", integer_answers=True
    ),
    # --- GSM8K (openai/grade-school-math, MIT): the solution ends in "#### <integer>" ---
    "gsm8k_train": SourceConfig(
        path="gsm8k/train.jsonl", problem_key="question", answer_after="####", integer_answers=True
    ),
    # The fixed held-out set: the first 256 test problems (never trained on: training uses gsm8k_train).
    "gsm8k_heldout": SourceConfig(
        path="gsm8k/test.jsonl",
        problem_key="question",
        answer_after="####",
        integer_answers=True,
        limit=256,
    ),
}
_DEFAULTS = SourceConfig(
    problem_key="problem",
    answer_key="answer",
    answer_list="alternatives",
    integer_answers=False,
    kind="math",
)
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")


@dataclass(frozen=True)
class Problem:
    """One problem: ``answers`` are the accepted gold forms (the first is canonical)."""

    source: str
    row: int
    problem: str
    answers: tuple[str, ...]
    kind: str = "math"

    @property
    def answer(self) -> str:
        return self.answers[0]


@dataclass
class LoadReport:
    source: str
    path: str
    rows: int
    bad: list[tuple[int, str]]

    def summary(self) -> str:
        head = "; ".join(f"row {r}: {why}" for r, why in self.bad[:5])
        more = f" (+{len(self.bad) - 5} more)" if len(self.bad) > 5 else ""
        return f"{self.path}: {len(self.bad)} of {self.rows} rows malformed: {head}{more}"


def resolve_source(source: SourceConfig | str) -> SourceConfig:
    """Registry entry ← fields set in ``source`` ← defaults; the path made absolute if local."""
    if isinstance(source, str):
        source = SourceConfig(name=source)
    base = SourceConfig()
    if source.name:
        if source.name not in REGISTRY and not source.path:
            raise ConfigError(
                f"data source {source.name!r}: not in the registry "
                f"({', '.join(sorted(REGISTRY))}) and no path given"
            )
        base = REGISTRY.get(source.name, base)
    merged = {}
    for f in dataclasses.fields(SourceConfig):
        value = getattr(source, f.name)
        if _unset(value):
            value = getattr(base, f.name)
        if _unset(value):
            value = getattr(_DEFAULTS, f.name)
        merged[f.name] = value
    resolved = SourceConfig(**merged)
    resolved.name = resolved.name or Path(resolved.path).stem
    local = Path(resolved.path)
    if not local.exists() and not local.is_absolute():
        local = find_data(local) or local
    if local.exists():
        resolved.path = str(local.resolve())
    return resolved


def as_source(name: SourceConfig | str) -> SourceConfig:
    """A benchmark entry as a source: a string with a file suffix is a path, else a registry name."""
    if isinstance(name, SourceConfig):
        return name
    return SourceConfig(path=name) if Path(name).suffix else SourceConfig(name=name)


def require_local_files(sources: Sequence[SourceConfig | str], field: str) -> None:
    """Each source that names a local file (.json/.jsonl/.parquet) has it; hub datasets are
    checked when they load. A one-line ConfigError names ``field[i]``, the value and where it was
    looked for."""
    for i, source in enumerate(sources):
        resolved = resolve_source(as_source(source))
        path = Path(resolved.path)
        if path.suffix in (".json", ".jsonl", ".parquet") and not path.is_file():
            name = f"{field}[{i}]" + ("" if isinstance(source, str) or not source.path else ".path")
            value = source if isinstance(source, str) else source.path or source.name
            where = str(path) if path.is_absolute() else f"{Path.cwd() / path}, {searched(path)}"
            raise ConfigError(
                f"config field '{name}' = {value!r}: file not found (looked for {where})"
            )


def _unset(value) -> bool:
    return value is None or value == "" or (type(value) is int and value == 0)


def _read_rows(source: SourceConfig, cache_dir: str | None) -> list[dict]:
    # lazy: the datasets library takes seconds to import; only hub sources need it
    import datasets

    path = Path(source.path)
    columns = sorted({source.problem_key.split(".")[0], source.answer_key.split(".")[0]})
    if path.exists():
        builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(path.suffix)
        if builder is None:
            raise DataError(
                f"data source {source.name!r}: {path}: unsupported file type "
                f"(expected .json, .jsonl or .parquet)"
            )
        try:
            ds = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache_dir
            )
        except Exception as e:  # noqa: BLE001 - report any reader failure in one line
            raise DataError(
                f"data source {source.name!r}: {path}: unreadable: {' '.join(str(e).split())[:300]}"
            ) from None
    else:
        try:
            ds = datasets.load_dataset(source.path, split=source.split, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001
            raise DataError(
                f"data source {source.name!r}: {source.path!r} is neither a local file "
                f"nor a loadable hub dataset: {' '.join(str(e).split())[:300]}"
            ) from None
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise DataError(
            f"data source {source.name!r}: {source.path}: no field {missing[0]!r} "
            f"(fields: {', '.join(ds.column_names)})"
        )
    if source.limit:
        ds = ds.select(range(min(source.limit, len(ds))))
    if path.suffix in (".json", ".jsonl") and any(
        isinstance(ds.features[c], datasets.Json) for c in columns
    ):
        # A column of mixed types comes back JSON-decoded, strings included ("5" → 5,
        # "null" → None, "[1, 2]" → a list): re-read the rows as written to judge each one.
        logger.warning(
            "data source %r: mixed value types in %s; reading rows with the json module",
            source.name,
            path,
        )
        return _read_json_rows(path)[: source.limit or None]
    return ds.select_columns(columns).to_list()


def _read_json_rows(path: Path) -> list:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def _lookup(row, dotted: str):
    value = row
    for part in dotted.split("."):
        if isinstance(value, dict):
            if part not in value:
                raise KeyError(dotted)
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.lstrip("-").isdigit():
            index = int(part)
            if not -len(value) <= index < len(value):
                raise KeyError(dotted)
            value = value[index]
        else:
            raise KeyError(dotted)
    return value


def _scalar_answer(value, integer: bool) -> str:
    """One answer as a clean string; raises ValueError(why)."""
    if value is None:
        raise ValueError("answer is null")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"answer has type {type(value).__name__}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"answer is {value}")
        text = str(int(value)) if value.is_integer() else repr(value)
    else:
        text = str(value).strip()
    if not text:
        raise ValueError("answer is empty")
    if integer:
        stripped = _DEGREES.sub("", text).strip().strip("$").strip()
        try:
            number = float(stripped)
        except ValueError:
            raise ValueError(f"answer {text!r} is not an integer") from None
        if not number.is_integer():
            raise ValueError(f"answer {text!r} is not an integer")
        text = str(int(number))
    return text


def _answer_after(value, marker: str) -> str:
    """The text after the last ``marker`` of an answer field (GSM8K "... #### 1,250" → "1250")."""
    if not isinstance(value, str) or marker not in value:
        raise ValueError(f"answer has no {marker!r}")
    return _THOUSANDS_COMMA.sub("", value.rsplit(marker, 1)[1].strip())


def clean_answers(
    value, answer_list: str = "alternatives", integer: bool = False
) -> tuple[str, ...]:
    """Gold answer(s) of a row as strings: floats 142.0 → "142", whitespace/newlines stripped,
    lists kept as alternatives / first / joined; integer sets: "025" → "25", "336^\\circ" → "336".
    Raises ValueError(why) for unusable values."""
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("answer list is empty")
        answers = [_scalar_answer(v, integer) for v in value]
        if answer_list == "first":
            answers = answers[:1]
        elif answer_list == "join":
            answers = [", ".join(answers)]
        return tuple(dict.fromkeys(answers))
    return (_scalar_answer(value, integer),)


def load_source(
    source: SourceConfig | str, max_bad_fraction: float = 0.01, cache_dir: str | None = None
) -> tuple[list[Problem], LoadReport]:
    """Problems of one source and the report of its malformed rows (skipped). Raises
    :class:`DataError` when more than ``max_bad_fraction`` of the rows are malformed."""
    source = resolve_source(source)
    rows = _read_rows(source, cache_dir)
    problems, bad = [], []
    for i, row in enumerate(rows):
        try:
            try:
                problem = _lookup(row, source.problem_key)
            except KeyError:
                raise ValueError(f"no field {source.problem_key!r}") from None
            if not isinstance(problem, str) or not problem.strip():
                raise ValueError(
                    f"problem is {'empty' if isinstance(problem, str) else type(problem).__name__}"
                )
            try:
                raw_answer = _lookup(row, source.answer_key)
            except KeyError:
                raise ValueError(f"no field {source.answer_key!r}") from None
            if source.answer_after and raw_answer is not None:
                raw_answer = _answer_after(raw_answer, source.answer_after)
            answers = clean_answers(raw_answer, source.answer_list, bool(source.integer_answers))
            if source.kind == "math":
                for answer in answers:
                    if not is_parseable(answer):
                        raise ValueError(
                            f"answer {answer[:40]!r} cannot be graded (over 1000 characters, "
                            f"nested too deep or control characters)"
                        )
        except ValueError as e:
            bad.append((i, str(e)))
            continue
        problems.append(Problem(source.name, i, problem.strip(), answers, source.kind))
    report = LoadReport(source.name, source.path, len(rows), bad)
    if not rows:
        raise DataError(f"data source {source.name!r}: {source.path}: no rows")
    if bad:
        if len(bad) > max_bad_fraction * len(rows):
            raise DataError(
                f"data source {source.name!r}: {report.summary()} "
                f"(more than max_bad_fraction = {max_bad_fraction})"
            )
        logger.warning("data source %r: %s (skipped)", source.name, report.summary())
    return problems, report


def problem_key(text: str) -> str:
    """Dedup key: whitespace collapsed, lower-cased."""
    return " ".join(text.split()).lower()


def dedup(
    problems: Iterable[Problem], exclude: Iterable[Problem] = ()
) -> tuple[list[Problem], int]:
    """First occurrence of each problem, minus those also in ``exclude``; and the number dropped."""
    seen = {problem_key(p.problem) for p in exclude}
    kept = []
    total = 0
    for p in problems:
        total += 1
        key = problem_key(p.problem)
        if key not in seen:
            seen.add(key)
            kept.append(p)
    return kept, total - len(kept)


@dataclass(frozen=True)
class PromptExample:
    """A problem and its tokenised prompt."""

    problem: Problem
    prompt_ids: list[int]


def build_prompts(
    problems: Sequence[Problem],
    tokenizer,
    template: TemplateConfig,
    instruction: str,
    max_prompt_tokens: int | None = None,
    long_prompts: str = "drop",
    paths: dict[str, str] | None = None,
) -> tuple[list[PromptExample], int]:
    """Tokenised prompts (``problem + " " + instruction`` in the template); prompts longer than
    ``max_prompt_tokens`` are dropped (``long_prompts`` "drop") or raise a one-line
    :class:`DataError` naming the file (``paths``: source name → file), row and field ("refuse");
    returns the examples and the number dropped."""
    examples = []
    for p in problems:
        ids = encode_prompt(math_message(p.problem, instruction), tokenizer, template)
        if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
            examples.append(PromptExample(p, ids))
        elif long_prompts == "refuse":
            raise prompt_too_long(
                p,
                (paths or {}).get(p.source, p.source),
                len(ids),
                f"data.max_prompt_tokens = {max_prompt_tokens} (data.long_prompts = refuse)",
            )
    return examples, len(problems) - len(examples)


def prompt_too_long(problem: Problem, path: str, length: int, limit: str) -> DataError:
    """The one-line error of a templated prompt over a limit (``limit``: its value and name)."""
    return DataError(
        f"data source {problem.source!r}: {path}: row {problem.row}: field 'problem': "
        f"prompt of {length} tokens (templated) > {limit}"
    )


def load_train_set(cfg: DataConfig, tokenizer) -> list[PromptExample]:
    """The training prompts: every ``cfg.train`` source, deduplicated and decontaminated against
    ``cfg.decontaminate`` benchmarks, templated with the training instruction, long prompts
    dropped. Counts are logged."""
    problems, paths = [], {}
    for source in cfg.train:
        loaded, report = load_source(source, cfg.max_bad_fraction, cfg.cache_dir)
        problems.extend(loaded)
        paths[report.source] = report.path
    if cfg.dedup or cfg.decontaminate:
        held_out = [
            p
            for name in cfg.decontaminate
            for p in load_source(name, cfg.max_bad_fraction, cfg.cache_dir)[0]
        ]
        if not cfg.dedup:
            exclude = {problem_key(p.problem) for p in held_out}
            before = len(problems)
            problems = [p for p in problems if problem_key(p.problem) not in exclude]
            dropped = before - len(problems)
        else:
            problems, dropped = dedup(problems, exclude=held_out)
        logger.info(
            "train data: %d problems after dropping %d duplicates/benchmark overlaps",
            len(problems),
            dropped,
        )
    instruction = cfg.template.instruction_or(TRAIN_INSTRUCTION)
    examples, too_long = build_prompts(
        problems,
        tokenizer,
        cfg.template,
        instruction,
        cfg.max_prompt_tokens,
        cfg.long_prompts,
        paths,
    )
    logger.info(
        "train data: %d prompts, %d dropped as longer than %d tokens",
        len(examples),
        too_long,
        cfg.max_prompt_tokens,
    )
    if not examples:
        raise DataError("train data: no prompts left after dedup and length filtering")
    return examples
