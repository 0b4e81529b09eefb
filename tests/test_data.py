"""Data: tokenizers (README encodings), templates, every shared file loads with its README row
count and no answer lost, malformed-row reporting, dedup/decontamination, prompt filtering,
resumable prompt batches."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml

from megatron_ngrpo.config_loader import ConfigError, load
from megatron_ngrpo.data import (
    EVAL_INSTRUCTION,
    MCQ_INSTRUCTION,
    REGISTRY,
    TRAIN_INSTRUCTION,
    DataConfig,
    DataError,
    PromptBatches,
    SourceConfig,
    TemplateConfig,
    build_prompts,
    load_source,
    load_tokenizer,
    load_train_set,
)
from megatron_ngrpo.data.datasets import as_source, clean_answers, dedup, resolve_source
from megatron_ngrpo.data.paths import REPO_DATA, data_dirs, find_data
from megatron_ngrpo.data.templates import (
    encode_prompt,
    math_message,
    mcq_message,
    render,
)
from megatron_ngrpo.data.tokenizer import QWEN2, R1_DISTILL, tokenizer_folder
from megatron_ngrpo.eval.config import EvalConfig
from megatron_ngrpo.training.config import ValidationConfig

README_ROWS = {
    "aime24": 30,
    "amc22_23": 83,
    "math500": 500,
    "minerva": 272,
    "olympiad_bench": 675,
    "aime25": 30,
    "aime25_areal": 30,
    "amc23": 40,
    "simplerl_math_lv3to5": 8523,
    "deepscaler_math_train": 7474,
    "deepscaler_aime": 975,
}
# (row, why) of the known bad rows (README: 2 empty simpleRL answers, 2 null MATH answers; the
# MATH file also has 2 empty strings).
KNOWN_BAD = {
    "simplerl_math_lv3to5": [(5054, "answer is empty"), (5158, "answer is empty")],
    "deepscaler_math_train": [
        (886, "answer is null"),
        (1009, "answer is null"),
        (5328, "answer is empty"),
        (5330, "answer is empty"),
    ],
}
REPO = Path(__file__).resolve().parents[1]
R1_PROMPT_IDS = [
    151646,
    151644,
    3838,
    374,
    220,
    16,
    10,
    16,
    30,
    6771,
    594,
    1744,
    3019,
    553,
    3019,
    323,
    2550,
    279,
    1590,
    4226,
    2878,
    1124,
    79075,
    46391,
    151645,
]


@pytest.fixture(scope="module")
def r1():
    return load_tokenizer("deepseek-r1-distill-qwen")


# ---- tokenizers -----------------------------------------------------------------------------


def test_r1_tokenizer_recipe(r1, shared_data):
    assert len(r1) == 151665
    assert r1("Hello, world!").input_ids == [151646, 9707, 11, 1879, 0]
    assert r1("你好").input_ids == [151646, 108386]
    assert (r1.bos_token_id, r1.eos_token_id, r1.pad_token_id) == (151646, 151643, 151643)
    assert r1.convert_tokens_to_ids(
        ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<|file_sep|>"]
    ) == [151644, 151645, 151648, 151649, 151664]
    # Special tokens are dropped by skip_special_tokens, plain added ones survive.
    assert (
        r1.decode([151646, 9707, 151648, 151650, 151643], skip_special_tokens=True)
        == "Hello<think>"
    )
    message = "What is 1+1? " + EVAL_INSTRUCTION
    text = r1.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    assert text == f"<｜begin▁of▁sentence｜><｜User｜>{message}<｜Assistant｜>"
    assert r1(text, add_special_tokens=False).input_ids == R1_PROMPT_IDS
    # A folder with the parts is rebuilt the same way.
    assert (
        load_tokenizer(shared_data / "tokenizers" / "deepseek-r1-distill-qwen")("Hi").input_ids
        == r1("Hi").input_ids
    )


def test_qwen2_tokenizer():
    tok = load_tokenizer("qwen2")
    assert tok("Hello, world!").input_ids == [9707, 11, 1879, 0]
    assert tok("<|im_start|>hello<|im_end|>").input_ids == [151644, 14990, 151645]
    assert tok("你好").input_ids == [108386]
    assert tok.chat_template is None  # the fixture's altered template is dropped


def test_unknown_tokenizer():
    with pytest.raises(
        ConfigError,
        match=r"^config field 'tokenizer' = 'no-such-tokenizer': neither a known "
        r"tokenizer name .* nor a folder \(looked for /",
    ):
        load_tokenizer("no-such-tokenizer")


# ---- the repository's data folder ------------------------------------------------------------

REPO = REPO_DATA.parent


def _config_sources(path: Path) -> list:
    """Data sources and benchmarks a shipped config names (training, validation or evaluation)."""
    cfg = yaml.safe_load(path.read_text()) or {}
    sources = list(cfg.get("data", {}).get("train", [])) + list(
        cfg.get("data", {}).get("decontaminate", [])
    )
    sources += list((cfg.get("validation") or cfg.get("eval") or {}).get("benchmarks", []))
    sources += list(cfg.get("benchmarks", [])) + list(cfg.get("extra_benchmarks", []))
    return [s if isinstance(s, str) else SourceConfig(**s) for s in sources]


def test_every_data_path_lies_inside_the_repository(monkeypatch):
    """A fresh clone needs nothing beside it: without NGRPO_SHARED, every registry file, shipped
    tokenizer, default source and every source of the shipped configs resolves inside the
    repository (the configs' runs/ paths are written by the project), and git ignores none of data/."""
    monkeypatch.delenv("NGRPO_SHARED", raising=False)
    monkeypatch.chdir(REPO)
    assert data_dirs() == [REPO_DATA]
    names = (
        list(REGISTRY)
        + [s.name for s in DataConfig().train]
        + DataConfig().decontaminate
        + ValidationConfig().benchmarks
        + EvalConfig().benchmarks
    )
    for name in names:
        path = Path(resolve_source(name).path)
        assert path.is_file() and path.is_relative_to(REPO_DATA), (name, path)
    for name in (R1_DISTILL, QWEN2):
        assert tokenizer_folder(name).is_relative_to(REPO_DATA)
    assert (REPO_DATA / "gsm8k" / "train.jsonl").is_file() and (
        REPO_DATA / "gsm8k" / "test.jsonl"
    ).is_file()
    configs = sorted((REPO / "configs").rglob("*.yaml"))
    assert len(configs) >= 7
    seen = 0
    for config in configs:
        for source in _config_sources(config):
            path = Path(resolve_source(as_source(source)).path)
            assert path.resolve().is_relative_to(REPO), (config.name, source, path)
            seen += 1
        tokenizer = (yaml.safe_load(config.read_text()) or {}).get("tokenizer")
        if tokenizer in (R1_DISTILL, QWEN2):
            assert tokenizer_folder(tokenizer).is_relative_to(REPO_DATA)
    assert seen >= 10
    ignored = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "data"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "!!" not in ignored, ignored


def test_shared_folder_is_an_optional_extra(monkeypatch, tmp_path):
    extra = tmp_path / "data" / "eval" / "mine.jsonl"
    extra.parent.mkdir(parents=True)
    extra.write_text('{"problem": "1+1", "answer": "2"}\n')
    monkeypatch.setenv("NGRPO_SHARED", str(tmp_path))
    assert data_dirs() == [REPO_DATA, tmp_path / "data"]
    assert find_data("eval/mine.jsonl") == extra
    assert (
        find_data("eval/amc23/amc23.jsonl") == REPO_DATA / "eval/amc23/amc23.jsonl"
    )  # the repository's first
    assert load_source(SourceConfig(path="eval/mine.jsonl"))[0][0].answers == ("2",)


# ---- templates ------------------------------------------------------------------------------


def test_templates(r1):
    assert (
        TRAIN_INSTRUCTION == "Let's think step by step and output the final answer within \\boxed{}"
    )
    assert EVAL_INSTRUCTION == TRAIN_INSTRUCTION + "."
    message = math_message("What is 1+1?", EVAL_INSTRUCTION)
    assert message == "What is 1+1? " + EVAL_INSTRUCTION
    forced = render(message, r1, TemplateConfig())
    assert forced.endswith("<｜Assistant｜><think>\n")
    original = render(message, r1, TemplateConfig(think="original"))
    assert original.endswith("<｜Assistant｜>") and forced == original + "<think>\n"
    ids = encode_prompt(message, r1, TemplateConfig())
    assert ids[: len(R1_PROMPT_IDS)] == R1_PROMPT_IDS and ids[len(R1_PROMPT_IDS) :] == [151648, 198]
    assert ids.count(151646) == 1  # bos once
    plain = encode_prompt("Q", r1, TemplateConfig(kind="plain"))
    assert plain == [151646] + r1("Q\n", add_special_tokens=False).input_ids
    assert mcq_message("Which?", ["x", "y"]) == "Which?\nA) x\nB) y\n\n" + MCQ_INSTRUCTION
    assert MCQ_INSTRUCTION.endswith("in the last line as:\nAnswer: <A/B/C/D>")
    with pytest.raises(ValueError, match="plain"):
        render("Q", load_tokenizer("qwen2"), TemplateConfig(kind="chat"))


# ---- the shared files -----------------------------------------------------------------------


def _raw_answers(shared_data, name):
    path = shared_data / REGISTRY[name].path
    if path.suffix == ".parquet":
        return [r["ground_truth"] for r in pd.read_parquet(path).reward_model]
    if path.suffix == ".jsonl":
        return [
            json.loads(line)["answer"] for line in path.read_text().splitlines() if line.strip()
        ]
    return [r["answer"] for r in json.loads(path.read_text())]


@pytest.mark.parametrize("name", sorted(README_ROWS))
def test_every_file_loads_with_readme_row_count(name, shared_data):
    problems, report = load_source(name)
    assert report.rows == README_ROWS[name]
    assert report.bad == KNOWN_BAD.get(name, [])
    assert len(problems) == README_ROWS[name] - len(report.bad)
    raw = _raw_answers(shared_data, name)
    for p in problems:
        value = raw[p.row]
        if REGISTRY[name].integer_answers:  # "025" → "25", 142.0 → "142", "336^\circ" → "336"
            expected = str(int(float(str(value).replace("^\\circ", ""))))
            assert p.answers == (expected,), (name, p.row, value)
        elif isinstance(value, list):  # every alternative kept, newlines stripped
            assert set(p.answers) == {v.strip() for v in value} or p.answers == (
                ", ".join(v.strip() for v in value),
            )
        else:
            assert p.answers == (str(value).strip(),)
        assert p.problem and not p.problem[0].isspace()


def test_answer_cleanup_details():
    aime25, _ = load_source("aime25")
    areal, _ = load_source("aime25_areal")
    assert aime25[19].answer == "336"  # Skywork row 19 "336^\circ"
    assert [p.answer for p in aime25] == [p.answer for p in areal]  # the two copies agree
    assert load_source("aime24")[0][1].answer == "25"  # "025"
    assert load_source("amc22_23")[0][0].answer == "142"  # 142.0
    minerva, _ = load_source("minerva")
    assert minerva[0].answers == ("9.6",)  # "9.6\n"
    assert minerva[17].answers == ("6630.65", "6630")
    olympiad, _ = load_source("olympiad_bench")
    assert sum("," in p.answer for p in olympiad) >= 60  # multi-answer strings kept whole
    assert clean_answers([1.0, "2\n"], "join") == ("1, 2",)
    assert clean_answers(["a", "b"], "first") == ("a",)


def test_overlaps_dedup_and_decontamination():
    aime_train, _ = load_source("deepscaler_aime")
    math500, _ = load_source("math500")
    amc23, _ = load_source("amc23")
    amc22_23, _ = load_source("amc22_23")
    assert dedup(aime_train, exclude=math500)[1] == 3  # README: 3 AIME items are in MATH-500
    assert dedup(amc23, exclude=amc22_23)[1] == 40  # README: AMC23 ⊂ AMC22+23
    simplerl, _ = load_source("simplerl_math_lv3to5")
    math_train, _ = load_source("deepscaler_math_train")
    kept, dropped = dedup(simplerl + math_train)
    # README: 5564 shared (raw rows); one of them has an empty answer in a bad row; plus repeats
    # inside each file (simpleRL 2, MATH 1 after case/whitespace normalisation).
    assert dedup(simplerl)[1] == 2 and dedup(math_train)[1] == 1
    assert dropped == 5563 and len(kept) == len(simplerl) + len(math_train) - 5563


def test_gsm8k_sources_and_held_out_set(shared_data):
    train, report = load_source("gsm8k_train")
    held, _ = load_source("gsm8k_heldout")
    assert (report.rows, len(train), report.bad) == (7473, 7473, [])
    raw = [
        json.loads(line) for line in (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()
    ]
    assert len(held) == 256 and [p.row for p in held] == list(
        range(256)
    )  # the first 256 test problems
    assert held[0].problem == raw[0]["question"] and held[0].answers == ("18",)
    assert held[146].answers == ("2125",) and held[201].answers == (
        "114200",
    )  # "#### 2,125", "#### 114,200"
    # Every gold is the integer after the last "####", thousands commas dropped.
    for p in held:
        text = raw[p.row]["answer"].rsplit("####", 1)[1].strip()
        assert p.answers == (str(int(text.replace(",", ""))),)
    assert dedup(held, exclude=train)[1] == 0  # never trained on


def test_chat_arithmetic_task_keeps_the_held_out_split(tmp_path):
    from examples.arithmetic.task import chat_phrasing, problems, split, write_chat_task

    counts = write_chat_task(tmp_path, seed=0)
    held = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert counts == {"train": len(train), "heldout": 192}
    assert held == [chat_phrasing(p) for p in split(problems(0), 64)[0]]
    assert not {p["problem"] for p in held} & {p["problem"] for p in train}
    assert chat_phrasing({"problem": "max(37,52,18)=", "answer": "52", "level": 2})["problem"] == (
        "What is the largest of the numbers 37, 52 and 18?"
    )
    assert chat_phrasing({"problem": "min(40,11)=", "answer": "11", "level": 1})["problem"] == (
        "What is the smallest of the numbers 40 and 11?"
    )


@pytest.mark.parametrize(
    "rows, why",
    [
        (
            [{"question": "Q0", "answer": "so 1 #### 1"}, {"question": "Q1"}],
            "row 1: answer is null",
        ),
        (
            [{"question": "Q0", "answer": "so 1 #### 1"}, {"question": "Q1", "answer": "so 2"}],
            "row 1: answer has no '####'",
        ),
        (
            [{"question": "Q0", "answer": "#### 1"}, {"question": "Q1", "answer": "#### two"}],
            "row 1: answer 'two' is not an integer",
        ),
    ],
    ids=["missing-answer", "no-marker", "unparseable"],
)
def test_task_file_errors_name_file_row_field(tmp_path, r1, rows, why):
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = {
        "path": str(path),
        "problem_key": "question",
        "answer_after": "####",
        "integer_answers": True,
    }
    cfg = load(
        DataConfig,
        overrides=[f"train=[{json.dumps(source)}]", "decontaminate=[]", "max_bad_fraction=0"],
    )
    with pytest.raises(DataError) as err:  # the run does not start on a partial data set
        load_train_set(cfg, r1)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and why in msg


def test_ungradable_math_answer_and_long_prompt_refused(tmp_path, r1):
    path = tmp_path / "task.jsonl"
    path.write_text(
        json.dumps({"problem": "P0", "answer": "1"})
        + "\n"
        + json.dumps({"problem": "P1", "answer": "{" * 30 + "}" * 30})
        + "\n"
    )
    with pytest.raises(
        DataError, match=r"task.jsonl: 1 of 2 rows malformed: row 1: answer .* cannot be graded"
    ):
        load_source(SourceConfig(path=str(path)), max_bad_fraction=0)
    path.write_text(
        json.dumps({"problem": "short", "answer": "1"})
        + "\n"
        + json.dumps({"problem": "long " * 200, "answer": "2"})
        + "\n"
    )
    base = [f"train=[{{path: {path}}}]", "decontaminate=[]", "max_prompt_tokens=64"]
    assert len(load_train_set(load(DataConfig, overrides=base), r1)) == 1  # drop (the default)
    with pytest.raises(DataError) as err:
        load_train_set(load(DataConfig, overrides=[*base, "long_prompts=refuse"]), r1)
    msg = str(err.value)
    assert (
        "\n" not in msg
        and str(path) in msg
        and "row 1: field 'problem': prompt of" in msg
        and "> data.max_prompt_tokens = 64" in msg
    )
    with pytest.raises(ConfigError, match="'long_prompts'"):
        load(DataConfig, overrides=["long_prompts=truncate"])


# ---- malformed rows -------------------------------------------------------------------------


def test_malformed_rows_reported_and_refused(tmp_path):
    # Mixed types: the rows are judged as written (not as `datasets` decodes a mixed column).
    rows = [
        {"problem": "ok 1", "answer": "1"},
        {"problem": "null", "answer": None},
        {"problem": "no answer"},
        {"problem": "dict", "answer": {"x": 1}},
        {"problem": "", "answer": "2"},
        {"problem": "list", "answer": ["1", True]},
        {"problem": "nan", "answer": float("nan")},
        {"problem": "ok 2", "answer": 3.0},
        {"problem": 5, "answer": "5"},
        {"problem": "ok 3", "answer": ["4\n", 4.0]},
    ]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(DataError) as err:
        load_source(SourceConfig(path=str(path)), max_bad_fraction=0.5)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "7 of 10 rows malformed" in msg
    assert "row 1: answer is null; row 2: no field 'answer'; row 3: answer has type dict" in msg
    problems, report = load_source(SourceConfig(path=str(path)), max_bad_fraction=1.0)
    assert [p.answers for p in problems] == [("1",), ("3",), ("4",)]
    # A string answer that looks like JSON stays a string.
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        '{"problem": "a", "answer": "[1, 2]"}\n{"problem": "b", "answer": 5}\n'
        '{"problem": "c", "answer": "null"}\n'
    )
    assert [p.answers for p in load_source(SourceConfig(path=str(mixed)))[0]] == [
        ("[1, 2]",),
        ("5",),
        ("null",),
    ]
    assert report.bad == [
        (1, "answer is null"),
        (2, "no field 'answer'"),
        (3, "answer has type dict"),
        (4, "problem is empty"),
        (5, "answer has type bool"),
        (6, "answer is nan"),
        (8, "problem is int"),
    ]


def test_nested_keys_and_missing_fields(tmp_path):
    table = pd.DataFrame(
        {
            "prompt": [
                [{"role": "user", "content": "P0"}],
                [{"role": "user", "content": "P1"}],
                [],
            ],
            "reward_model": [{"ground_truth": "7"}, {"ground_truth": "8\n"}, {"ground_truth": "9"}],
        }
    )
    path = tmp_path / "verl.parquet"
    table.to_parquet(path)
    problems, report = load_source(
        SourceConfig(
            path=str(path), problem_key="prompt.0.content", answer_key="reward_model.ground_truth"
        ),
        max_bad_fraction=0.5,
    )
    assert [(p.problem, p.answer) for p in problems] == [("P0", "7"), ("P1", "8")]
    assert report.bad == [(2, "no field 'prompt.0.content'")]
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('{"question": "Q", "answer": 1}\n')
    with pytest.raises(DataError, match="no field 'problem'.*fields: question, answer"):
        load_source(SourceConfig(path=str(jsonl)))
    with pytest.raises(DataError, match="neither a local file"):
        load_source(SourceConfig(path=str(tmp_path / "missing.json")))
    with pytest.raises(ConfigError, match="not in the registry"):
        load_source("aime26")


# ---- prompts and config ---------------------------------------------------------------------


def test_train_set_filters_long_prompts(r1):
    cfg = load(
        DataConfig,
        overrides=[
            "train=[{name: deepscaler_aime, limit: 200}]",
            "decontaminate=[math500]",
            "max_prompt_tokens=120",
        ],
    )
    examples = load_train_set(cfg, r1)
    problems, _ = load_source(SourceConfig(name="deepscaler_aime", limit=200))
    lengths = {
        e.problem.row: len(e.prompt_ids)
        for e in build_prompts(problems, r1, cfg.template, TRAIN_INSTRUCTION)[0]
    }
    expected = [
        p for p in dedup(problems, exclude=load_source("math500")[0])[0] if lengths[p.row] <= 120
    ]
    assert 0 < len(expected) < 200
    assert [e.problem for e in examples] == expected
    assert r1.decode(examples[0].prompt_ids).endswith(
        TRAIN_INSTRUCTION + "<｜Assistant｜><think>\n"
    )


@pytest.mark.parametrize("dedup", [True, False])
def test_decontaminate_drops_the_named_benchmarks_only(tmp_path, r1, dedup):
    """data.decontaminate: a training problem copied from a listed benchmark is dropped, one from
    a benchmark left off the list (here one of the default list's) is kept, with and without
    data.dedup (two code paths)."""
    aime, math500 = load_source("aime24")[0][0], load_source("math500")[0][0]
    rows = [{"problem": p.problem, "answer": p.answer} for p in (aime, math500)]
    rows.append({"problem": "What is 1 + 1?", "answer": "2"})
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [f"train=[{{path: {path}}}]", f"dedup={str(dedup).lower()}"]
    kept = {
        names: [
            e.problem.problem
            for e in load_train_set(
                load(DataConfig, overrides=[*base, f"decontaminate={names}"]), r1
            )
        ]
        for names in ("[math500]", "[]", "[aime24,math500]")
    }
    assert kept == {
        "[math500]": [aime.problem, "What is 1 + 1?"],
        "[]": [aime.problem, math500.problem, "What is 1 + 1?"],
        "[aime24,math500]": ["What is 1 + 1?"],
    }


def test_dedup_bad_rows_cache_and_split_switches(tmp_path, r1, monkeypatch):
    """data.max_bad_fraction lets a file with a malformed row in, data.dedup off keeps a repeated
    problem, data.cache_dir is where `datasets` caches a file, and a hub source's split is the
    one asked for (the hub's loader recorded, not reached)."""
    import datasets

    path = tmp_path / "task.jsonl"
    rows = [{"problem": "What is 1 + 1?", "answer": "2"}] * 2
    rows += [{"problem": "What is 2 + 2?", "answer": "4"}, {"problem": "no answer"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [f"train=[{{path: {path}}}]", "decontaminate=[]", f"cache_dir={tmp_path / 'cache'}"]
    with pytest.raises(DataError, match="1 of 4 rows malformed"):
        load_train_set(load(DataConfig, overrides=base), r1)
    lenient = [*base, "max_bad_fraction=0.5"]
    assert len(load_train_set(load(DataConfig, overrides=lenient), r1)) == 2
    assert len(load_train_set(load(DataConfig, overrides=[*lenient, "dedup=false"]), r1)) == 3
    assert list((tmp_path / "cache").iterdir())
    asked = []
    hub = lambda *args, **kwargs: asked.append(kwargs) or datasets.Dataset.from_list(rows[:3])  # noqa: E731
    monkeypatch.setattr(datasets, "load_dataset", hub)
    cfg = load(DataConfig, overrides=["train=[{path: org/none, split: test}]", "decontaminate=[]"])
    assert len(load_train_set(cfg, r1)) == 2 and [a["split"] for a in asked] == ["test"]


def test_answer_list_reaches_the_problems(tmp_path):
    """data.train[].answer_list on a row whose answer is a list: every form accepted (the
    default), the first only, or one joined string (no shipped file tells them apart: minerva's
    lists take the default, olympiad_bench's hold one string each)."""
    path = tmp_path / "lists.jsonl"
    path.write_text(json.dumps({"problem": "Roots?", "answer": ["2\n", 3.0, "2"]}) + "\n")
    seen = {}
    for mode in ("", "alternatives", "first", "join"):
        extra = f", answer_list: {mode}" if mode else ""
        cfg = load(DataConfig, overrides=[f"train=[{{path: {path}{extra}}}]"])
        seen[mode] = load_source(cfg.train[0])[0][0].answers
    assert seen == {
        "": ("2", "3"),
        "alternatives": ("2", "3"),
        "first": ("2",),
        "join": ("2, 3, 2",),
    }


def test_data_config_errors():
    with pytest.raises(ConfigError, match=r"'train\[0\].answer_list'"):
        load(DataConfig, overrides=["train=[{name: aime24, answer_list: all}]"])
    with pytest.raises(ConfigError, match="'max_prompt_tokens'"):
        load(DataConfig, overrides=["max_prompt_tokens=0"])


# ---- resumable batches ----------------------------------------------------------------------


def test_prompt_batches_resume_and_epochs():
    items = list(range(10))
    ref = PromptBatches(items, batch_size=3, seed=7)
    expected = [next(ref) for _ in range(8)]
    assert ref.batches_per_epoch == 3 and ref.epoch == 2
    epoch0 = [x for b in expected[:3] for x in b]
    assert len(set(epoch0)) == 9 and all(len(b) == 3 for b in expected)  # drop_last: 1 left out
    assert expected[:3] != expected[3:6]  # a new order each epoch
    run = PromptBatches(items, batch_size=3, seed=7)
    first = [next(run) for _ in range(4)]
    state = json.loads(json.dumps(run.state_dict()))
    resumed = PromptBatches(items, batch_size=3, seed=7)
    resumed.load_state_dict(state)
    assert first + [next(resumed) for _ in range(4)] == expected
    with pytest.raises(ValueError, match="num_items"):
        PromptBatches(list(range(11)), batch_size=3, seed=7).load_state_dict(state)
    tail = PromptBatches(items, batch_size=4, shuffle=False, drop_last=False)
    assert [next(tail) for _ in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]


@pytest.mark.parametrize(
    "config, train_source, heldout, rule",
    [
        (
            "smollm2_135m_arith.yaml",
            "runs/arith_chat/train.jsonl",
            "runs/arith_chat/heldout.jsonl",
            "last_number",
        ),
        ("smollm2_135m_gsm8k.yaml", "gsm8k_train", "gsm8k_heldout", "phrases"),
    ],
)
def test_chat_model_recipes_grade_free_text_and_refuse_partial_data(
    config, train_source, heldout, rule, tmp_path
):
    import yaml

    from megatron_ngrpo.rewards import RewardConfig

    raw = yaml.safe_load((REPO / "configs" / config).read_text())
    sections = {}
    for name, cls in (
        ("data", DataConfig),
        ("reward", RewardConfig),
    ):  # each section as the trainer reads it
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw[name]))
        sections[name] = load(cls, [tmp_path / f"{name}.yaml"])
    data, reward = sections["data"], sections["reward"]
    assert (
        reward.free_text == rule
        and data.template.kind == "chat"
        and "\\boxed{}" in data.template.instruction
    )
    assert data.max_bad_fraction == 0.0 and data.long_prompts == "refuse"
    assert (data.train[0].path or data.train[0].name) == train_source and raw["validation"][
        "benchmarks"
    ] == [heldout]
