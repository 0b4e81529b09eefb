"""scripts/smollm2.sh (the README's real-model command) without running it: the script parses,
the configs and overrides of its stages load as the stages load them, its tools parse their
arguments, and its quiet stages show progress bars only while the log keeps everything."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_ngrpo.config_loader import load
from megatron_ngrpo.eval.__main__ import main as eval_main
from megatron_ngrpo.eval.config import EvalConfig
from megatron_ngrpo.train import main as train_main
from megatron_ngrpo.training.job_config import load_config
from tools.show_progress import follow

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "smollm2.sh"


def test_script_parses_and_names_its_configs():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    for path in ("configs/smollm2_135m_arith.yaml", "configs/eval/smollm2_arith.yaml"):
        assert f"={path}\n" in text and (REPO / path).is_file()


def test_stage_configs_load(real_model, tmp_path, monkeypatch):
    # The task files the configs name (stage 2 writes them; only their existence is checked here).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "arith_chat").mkdir(parents=True)
    for name in ("train.jsonl", "heldout.jsonl"):
        (tmp_path / "runs" / "arith_chat" / name).write_text('{"problem": "1+1", "answer": "2"}\n')
    monkeypatch.setenv("NGRPO_MODELS", str(real_model.parent))
    cfg = load_config(
        [REPO / "configs" / "smollm2_135m_arith.yaml"],
        ["train.run_dir=runs/e2e", "train.max_steps=2", "validation.every=1"],
    )
    assert cfg.train.run_dir == "runs/e2e" and cfg.rollout.engine == "vllm"
    for extra in ([], ["checkpoint=runs/e2e/iter_0000002"]):
        ev = load(
            EvalConfig,
            [REPO / "configs" / "eval" / "smollm2_arith.yaml"],
            ["limit=8", "output_dir=out", *extra],
        )
        assert ev.limit == 8 and ev.sampling.n == 4


@pytest.mark.parametrize(
    "argv",
    [
        ["tools/plot_metrics.py", "--help"],
        ["tools/convert_megatron_to_hf.py", "--help"],
        ["tools/show_progress.py", "--help"],
        ["-m", "examples.arithmetic.task", "--help"],
    ],
)
def test_stage_tools_parse(argv):
    out = subprocess.run(
        [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr


def test_show_progress_keeps_bars_only():
    stream = (
        b"2026-11-26 22:04:41,676 INFO megatron_ngrpo.rollout.vllm.engine: weight sync\n"
        b"(MainProcess pid=1) WARNING 11-26 22:04:33 [cpu_worker.py:114] libtcmalloc\n"
        b"Loading safetensors checkpoint shards: 100% Completed | 1/1\n"
        b"heldout:   0%|          | 0/8 [00:00<?, ?prompt/s]"
        b"\rheldout: 100%|##########| 8/8 [00:43<00:00]\n"
        b"train:   0%|          | 0/2 [00:00<?, ?step/s]"
        b"INFO interleaved without a newline\n"
        b"\rtrain:  50%|#####     | 1/2 [04:24<04:24, reward=0.172]"
    )
    source, log, terminal = io.BytesIO(stream), io.BytesIO(), io.BytesIO()
    follow(source, log, terminal)
    assert log.getvalue() == stream
    assert terminal.getvalue() == (
        b"\rheldout:   0%|          | 0/8 [00:00<?, ?prompt/s]"
        b"\rheldout: 100%|##########| 8/8 [00:43<00:00]\n"
        b"\rtrain:   0%|          | 0/2 [00:00<?, ?step/s]"
        b"\rtrain:  50%|#####     | 1/2 [04:24<04:24, reward=0.172]\n"
    )


BAD_ROWS = {
    "missing": (
        {"problem": "What is 9 + 1?"},
        "row 3: answer is null",
    ),  # JSON lines: a missing key reads as null
    "ungradable": ({"problem": "What is 9 + 1?", "answer": "{" * 30 + "}" * 30}, "row 3: answer"),
    # over the training config's 96-token prompts and the eval engine's 512 - 64 alike
    "long": ({"problem": "long " * 600, "answer": "2"}, "row 3: field 'problem': prompt of"),
}


@pytest.mark.parametrize("cli", ["train", "eval"])
@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_clis_refuse_a_bad_task_file_in_one_line(
    cli, case, real_model, tmp_path, monkeypatch, capsys
):
    """Issue #28's bad input on the recipe's CLIs: one line naming the file, row and field, exit
    status 2, before any process group starts (so nothing runs on a partial data set). A prompt
    too long for the eval engine's context with room for the response is refused likewise."""
    bad, why = BAD_ROWS[case]
    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]
    rows.insert(3, bad)
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("NGRPO_MODELS", str(real_model.parent))
    if cli == "train":
        status = train_main(
            [
                "--config",
                str(REPO / "configs" / "smollm2_135m_arith.yaml"),
                f"data.train=[{{path: {path}}}]",
                f"validation.benchmarks=[{path}]" if case != "long" else "validation.every=0",
                f"train.run_dir={tmp_path / 'run'}",
            ]
        )
    else:
        status = eval_main(
            [
                "--config",
                str(REPO / "configs" / "eval" / "smollm2_arith.yaml"),
                f"benchmarks=[{path}]",
                f"output_dir={tmp_path / 'out'}",
            ]
        )
    # (stderr also has the `datasets` library's progress bar of reading the file)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert status == 2 and len(err) == 1 and str(path) in err[0] and why in err[0], err
    assert not dist.is_initialized() and not (tmp_path / "out").exists()
