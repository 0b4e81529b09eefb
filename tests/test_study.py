"""The study script end to end at toy size: 2 arms × 2 seeds × 2 GRPO steps (its real run is
examples/study/RESULTS.md), then its statistics on hand-made inputs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from examples.study import mixing_report, passk_study, run_study

REPO = Path(__file__).resolve().parents[1]


def test_study_runs_arms_and_seeds_and_writes_table_and_plot(tmp_path):
    out = tmp_path / "study"
    cmd = [
        sys.executable,
        "-m",
        "examples.study.run_study",
        "--out",
        str(out),
        "--arms",
        "grpo,ngrpo",
        "--seeds",
        "2",
        "--steps",
        "2",
        "train.warmstart.steps=4",
        "validation.every=1",
        "validation.limit=8",
        "train.prompts_per_step=8",
        "train.mini_batch_prompts=8",
        "train.save_every=0",
        "train.dump_generations=true",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    agg = results["aggregate"]
    assert agg["seeds"] == [0, 1] and set(agg["arms"]) == {"grpo", "ngrpo"}
    for arm in ("grpo", "ngrpo"):
        for seed in ("0", "1"):
            run = results["runs"][arm][seed]
            # validation.at_start (the study sets it): step 0 is the warm-started policy.
            assert sorted(int(s) for s in run["curve"]) == [0, 1, 2]
            assert 0.0 <= run["mean"] <= 1.0 and 1.0 <= run["distinct_answers"] <= 4.0
    assert "p_vs_grpo" in agg["arms"]["ngrpo"] and "p_vs_grpo" not in agg["arms"]["grpo"]
    assert "| ngrpo |" in (out / "table.md").read_text()
    assert (out / "heldout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "passk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # pass@k from step 0 (start) and the last step (end); both arms share the warm-start.
    start = {arm: results["curves"][arm]["0"]["start"] for arm in ("grpo", "ngrpo")}
    assert start["grpo"]["step"] == 0 and results["curves"]["grpo"]["0"]["end"]["step"] == 2
    assert start["grpo"]["mean"] == start["ngrpo"]["mean"] and start["grpo"]["ks"] == [1, 2, 4]
    assert "end pass@4" in results["passk"]["paired"]["ngrpo"]
    assert "MDD (80 % power)" in (out / "table.md").read_text()
    # Mixing happened in the N-GRPO arm only (the step-0 row is validation only).
    rows = {
        arm: [
            json.loads(line)
            for line in (out / "runs" / f"{arm}_seed0" / "metrics.jsonl").read_text().splitlines()
        ]
        for arm in ("grpo", "ngrpo")
    }
    assert all(
        set(rs[0]) == {"step"} | {k for k in rs[0] if k.startswith("val/")} for rs in rows.values()
    )
    mixed = {arm: [r["mixing/mixed_token_frac"] for r in rs[1:]] for arm, rs in rows.items()}
    assert all(x == 0 for x in mixed["grpo"]) and any(x > 0 for x in mixed["ngrpo"])
    # The mixing report reads the dumped records back: every mix counted, classes are shares.
    report = mixing_report.report([out / "runs" / "ngrpo_seed0"], top=3)
    dumped = [
        json.loads(line)["mixes"]["pos"]
        for path in (out / "runs" / "ngrpo_seed0" / "generations").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert report["mixes"] == sum(map(len, dumped)) > 0
    assert sum(v["mixed"] for v in report["clustering"].values()) == pytest.approx(1.0)
    assert 0.0 < report["alpha0"]["median"] <= 1.0 and len(report["examples"]) <= 3


def test_diversity_and_paired_test():
    records = [
        {"problem": 0, "response": r, "extracted": e}
        for r, e in [
            ("\\boxed{12}", "12"),
            ("\\boxed{12}", "12"),
            ("\\boxed{13}", "13"),
            ("\\boxed{7}", "7"),
        ]
    ]
    records += [{"problem": 1, "response": "\\boxed{5}", "extracted": "5"}] * 4
    d = run_study.diversity(records)
    assert d["distinct_answers"] == pytest.approx((3 + 1) / 2)
    p = [0.5, 0.25, 0.25]
    assert d["answer_entropy"] == pytest.approx(-sum(x * math.log(x) for x in p) / 2)
    # problem 0: pairs (12,12)=0, (12,13)=1 ×2, (12,7)=2 ×2, (13,7)=2 → 8 / 6; problem 1: 0.
    assert d["edit_distance"] == pytest.approx((8 / 6) / 2)
    assert run_study.edit_distance("kitten", "sitting") == 3
    # differences 0.2, 0.25, 0.2: t = 13 with 2 degrees of freedom, two-sided p = 1 - t / sqrt(t² + 2).
    assert run_study.paired_test([0.3, 0.45, 0.5], [0.1, 0.2, 0.3]) == pytest.approx(
        1 - 13 / math.sqrt(171), rel=1e-6
    )
    assert math.isnan(run_study.paired_test([0.3, 0.4], [0.3, 0.4]))


def _records(counts: list[int], n: int) -> list[dict]:
    """Validation records of problems with counts[i] correct of n samples each."""
    return [
        {"benchmark": "heldout", "problem": i, "sample": j, "score": float(j < c)}
        for i, c in enumerate(counts)
        for j in range(n)
    ]


def test_passk_analysis_on_synthetic_seeds():
    """pass@k curves from per-seed records, the paired differences at pass@1 and pass@n with
    their t interval, and the minimum detectable difference from the observed paired std."""
    n = 8
    # Arm "wide" solves one more problem (at n, not at 1) than "grpo" in every seed at the end;
    # the start (shared warm-start) is the same.
    start = [0, 1, 2, 8]
    ends = {"grpo": [[0, 1, 4, 8], [0, 0, 4, 8], [1, 1, 4, 8]]}
    ends["wide"] = [[1, 1, 4, 8], [0, 1, 4, 8], [1, 1, 4, 8]]
    curves = {
        arm: {
            s: {
                "start": passk_study.run_curve(_records(start, n)),
                "end": passk_study.run_curve(_records(e, n)),
            }
            for s, e in enumerate(per_seed)
        }
        for arm, per_seed in ends.items()
    }
    end = curves["grpo"][0]["end"]
    assert end["ks"] == [1, 2, 4, 8] and end["n"] == n
    # pass@1 is mean@n; pass@8 is the share of problems with any correct sample.
    assert end["mean"][0] == pytest.approx((0 + 1 + 4 + 8) / 8 / 4)
    assert end["mean"][-1] == pytest.approx(3 / 4)
    assert all(lo <= m <= hi for lo, m, hi in zip(end["low"], end["mean"], end["high"]))
    agg = passk_study.aggregate(curves)
    assert agg["seeds"] == [0, 1, 2]
    assert agg["arms"]["grpo"]["start"]["std"] == pytest.approx([0.0] * 4)
    pairs = agg["paired"]["wide"]
    # pass@8 differences per seed: 1/4, 1/4, 0 → mean 1/6, sd = √(1/48).
    d = np.array([0.25, 0.25, 0.0])
    r = pairs["end pass@8"]
    sd, se = d.std(ddof=1), d.std(ddof=1) / math.sqrt(3)
    assert r["mean"] == pytest.approx(1 / 6) and r["sd"] == pytest.approx(sd)
    t975, t80 = stats.t.ppf(0.975, 2), stats.t.ppf(0.8, 2)
    assert r["ci"] == pytest.approx([1 / 6 - t975 * se, 1 / 6 + t975 * se])
    assert r["mdd"] == pytest.approx((t975 + t80) * se)
    t975_8, t80_8 = stats.t.ppf(0.975, 7), stats.t.ppf(0.8, 7)
    assert passk_study.mdd(sd, 8) == pytest.approx((t975_8 + t80_8) * sd / math.sqrt(8))
    assert r["p"] == pytest.approx(stats.ttest_rel(d, np.zeros(3)).pvalue)
    # pass@1 differences: (1/8)/4, (1/8)/4, 0.
    assert pairs["end pass@1"]["mean"] == pytest.approx(1 / 48)
    assert pairs["start pass@1"]["mean"] == 0 and math.isnan(pairs["start pass@1"]["p"])
    text = passk_study.table(agg)
    assert "| wide | end pass@8 | +0.167 |" in text and "MDD at 8 seeds" in text
    # The z-based rule of thumb is the large-sample limit of the t-based MDD.
    big = passk_study.paired(list(np.random.default_rng(0).normal(0.1, 0.05, 400)))
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert big["mdd"] == pytest.approx(z * big["sd"] / 20, rel=0.01)


def test_passk_plot_has_three_panels(tmp_path):
    curves = {
        arm: {
            s: {p: passk_study.run_curve(_records([s, 2, 4], 4)) for p in ("start", "end")}
            for s in range(2)
        }
        for arm in ("grpo", "ngrpo")
    }
    agg = passk_study.aggregate(curves)
    heldout = {arm: {s: {0: 0.1, 5: 0.2 + s / 10} for s in range(2)} for arm in curves}
    passk_study.plot(agg, heldout, tmp_path / "passk.png", "synthetic")
    assert (tmp_path / "passk.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smollm2_validates_an_even_share_of_each_list_length(tmp_path):
    """``--heldout-per-level`` strides the chat task's 64 held-out problems per list length: every
    length keeps the same share (a plain limit would keep the shortest lists only)."""
    run_study.write_smollm2(tmp_path, "maxmin", 8)
    rows = [json.loads(r) for r in (tmp_path / "heldout_study.jsonl").read_text().splitlines()]
    levels = sorted({r["level"] for r in rows})
    assert len(levels) == 3 and [sum(r["level"] == lv for r in rows) for lv in levels] == [8] * 3
    with pytest.raises(SystemExit, match="--heldout-per-level in"):
        run_study.write_smollm2(tmp_path, "maxmin", 12)
