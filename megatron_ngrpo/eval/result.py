"""The outcome of an evaluation run (:class:`EvalResult`) and the saved generations it was
computed from (``<run>/generations/*.jsonl``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

GENERATIONS_DIR = "generations"


@dataclass
class EvalResult:
    """``metrics[benchmark]``: problems, mean@n, pass@k...; ``average``: their macro average
    over benchmarks; ``generations[benchmark]``: one record per response (see :func:`megatron_ngrpo.eval.runner.evaluate`)."""

    n: int
    metrics: dict[str, dict[str, float]]
    average: dict[str, float]
    generations: dict[str, list[dict]] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)


def read_generations(run_dir: str | Path) -> dict[str, list[dict]]:
    folder = Path(run_dir) / GENERATIONS_DIR
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no generations (*.jsonl) in {folder}")
    generations = {}
    for path in files:
        with path.open() as f:
            records = [json.loads(line) for line in f if line.strip()]
        if records:
            generations[records[0]["benchmark"]] = records
    return generations
