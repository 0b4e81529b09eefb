"""Launchers without Slurm: the recipe table and its memory model, the rendered sbatch scripts
(golden files), CLI input errors, and a real 2-rank torchrun job through NeMo-Run's LocalExecutor.

Regenerate the golden files after an intended change with ``NGRPO_UPDATE_GOLDEN=1 pytest
tests/test_launchers.py -k golden`` and review the diff.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import nemo_run
import pytest
from slurm_harness import (
    REPO,
    SMOKE_MODULE,
    experiment_id,
    smoke_env,
    start_cli,
    write_smoke_inputs,
)

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.launch import cli, job_files, memory, recipes
from megatron_ngrpo.launch.experiment import TORCHRUN_INFO, QuietLog

GOLDEN = Path(__file__).parent / "golden"


# ---- recipes and the memory model -----------------------------------------------------------


@pytest.mark.parametrize(
    "name,params",
    [("r1-1.5b", 1_777_088_000), ("r1-7b", 7_615_616_512), ("r1-14b", 14_770_033_664)],
)
def test_parameter_count_matches_the_published_models(name, params):
    # R1-Distill-Qwen-1.5B (untied: Qwen2.5-1.5B's 1,543,714,304 + its own output matrix),
    # Qwen2.5-7B and Qwen2.5-14B parameter counts.
    assert memory.model_params(recipes.get(name).spec) == params


def test_parameter_count_matches_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.harness.tiny import tiny_hf_config

    cfg = {k: v for k, v in tiny_hf_config().items() if k != "architectures"}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg)
        )
    assert memory.model_params(recipes.get("tiny").spec) == sum(
        p.numel() for p in model.parameters()
    )


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 2), (8, 4)])
def test_shards_add_up_to_the_model(tp, pp):
    """Σ over TP×PP ranks of the per-rank parameters = the model + the norms replicated on every
    TP rank + vocabulary padding + the last stage's copy of a tied output matrix."""
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import check_layout

    for name in ("r1-1.5b", "r1-7b", "r1-14b"):
        spec = recipes.get(name).spec
        try:
            check_layout(spec, ModelConfig(tensor_parallel=tp, pipeline_parallel=pp))
        except ValueError:
            continue
        h, v = spec.hidden_size, spec.vocab_size
        padded = memory.padded_vocab_size(v, tp, 128)
        total = sum(tp * memory.stage_params(spec, tp, pp, s) for s in range(pp))
        replicated = (tp - 1) * (2 * h * spec.num_layers + h)
        padding = (padded - v) * h * (1 if spec.tied_embeddings else 2)
        tied_copy = padded * h if spec.tied_embeddings and pp > 1 else 0
        assert total == memory.model_params(spec) + replicated + padding + tied_copy, name


def test_optimizer_is_sharded_and_the_rest_is_not():
    r = recipes.get("r1-7b")
    m2, m4 = r.train_memory(2), r.train_memory(4)
    assert m2.weights == m4.weights == 2 * m2.params and m2.grads == 4 * m2.params
    assert m2.optimizer == pytest.approx(12 * m2.params / r.data_parallel(2), abs=1)
    assert m4.optimizer == pytest.approx(m2.optimizer / 2, abs=1)


def test_pipeline_first_stage_keeps_all_layers_in_flight():
    spec = recipes.get("r1-14b").spec
    no_recompute = memory.TrainLayout(tp=4, pp=4, dp=2, tokens=4096, recompute=False)
    one = memory.layer_activation_bytes(spec, no_recompute)
    assert memory.activation_bytes(spec, no_recompute, 0) == spec.num_layers * one
    assert memory.activation_bytes(spec, no_recompute, 3) == spec.num_layers // 4 * one


@pytest.mark.parametrize("name", ["r1-1.5b", "r1-7b", "r1-14b"])
def test_recipes_fit_an_h100(name):
    """Every node count of the range validates, and training plus vLLM's reservation fit in 95%
    of an H100 even if vLLM keeps its memory during the update."""
    r = recipes.get(name)
    for nodes in range(r.min_nodes, r.max_nodes + 1):
        if r.world_size(nodes) % (r.tensor_parallel * r.pipeline_parallel):
            continue
        r.validate(nodes)
        t, v = r.train_memory(nodes), r.vllm_memory()
        assert t.total + v.reserved < memory.H100_USABLE_BYTES, (
            name,
            nodes,
            t.total / 2**30,
            v.reserved / 2**30,
        )
        assert v.kv_tokens >= 16 * r.seq_len  # at least 16 full-length sequences per engine


def test_docs_show_the_computed_tables():
    docs = (REPO / "docs" / "LAUNCHING.md").read_text()
    for name in ("r1-1.5b", "r1-7b", "r1-14b"):
        assert cli.memory_table(recipes.get(name)) in docs, (
            f"docs/LAUNCHING.md: refresh the {name} table"
        )


# ---- CLI input errors (one line, exit 2, nothing submitted) ---------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", "r1-70b"], "recipe 'r1-70b': unknown"),
        (["run", "r1-7b", "--nodes", "9", "--config", "setup.py"], "nodes = 9: expected 2..4"),
        (["run", "r1-7b", "--executor", "slurm"], "--config FILE.yaml is required"),
        (["run", "r1-7b", "--config", "nope.yaml"], "--config 'nope.yaml': no such file"),
        (["run", "r1-7b", "--task", "convert-hf"], "--output DIR is required"),
        (
            ["run", "tiny", "--procs-per-node", "3", "--config", "setup.py"],
            "not divisible by TP×PP = 2",
        ),
        (["run", "r1-7b", "--config", "setup.py", "--disaggregated"], "--disaggregated: only for"),
        # Slurm: checkpoints on shared storage, visible in the container
        (
            ["run", "r1-7b", "--executor", "slurm", "--config", "configs/ngrpo_r1_7b.yaml"],
            "train.run_dir = 'runs/ngrpo_r1_7b': relative, so a Slurm job would write it inside its own job folder",
        ),
        (
            [
                "run",
                "r1-7b",
                "--executor",
                "slurm",
                "--config",
                "configs/ngrpo_r1_7b.yaml",
                "--container-image",
                "img",
                "--mount",
                "/lustre:/lustre",
                "train.run_dir=/scratch/run",
            ],
            "train.run_dir = '/scratch/run': not under any --mount of the container",
        ),
        (
            ["run", "r1-7b", "--executor", "slurm", "--task", "convert-hf", "--output", "out"],
            "--output = 'out': relative",
        ),
        (
            ["run", "r1-7b", "--config", "configs/tiny_test.yaml"],
            "configs/tiny_test.yaml: model.tensor_parallel = 1: recipe r1-7b sets 4",
        ),
    ],
)
def test_cli_rejects_bad_input(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("name", ["r1-1.5b", "r1-7b", "r1-14b"])
def test_recipe_is_the_layouts_one_source(name, tmp_path):
    """The recipe's YAML states none of the keys the recipe sets; another file may state them
    only with the recipe's values, or under an explicit command-line override."""
    from omegaconf import OmegaConf

    recipe = recipes.get(name)
    layout = recipe.layout()
    assert {"model.tensor_parallel", "rollout.vllm.tensor_parallel"} <= set(layout)
    own = OmegaConf.load(REPO / recipe.config)
    assert [k for k in layout if OmegaConf.select(own, k) is not None] == []
    same = tmp_path / "same.yaml"
    same.write_text(f"model:\n  tensor_parallel: {recipe.tensor_parallel}\n")
    other = tmp_path / "other.yaml"
    other.write_text(f"model:\n  tensor_parallel: {recipe.tensor_parallel * 2}\n")
    recipes.check_configs(recipe, [REPO / recipe.config, same])
    recipes.check_configs(recipe, [other], ["model.tensor_parallel=2"])
    with pytest.raises(ConfigError, match=f"^{other}: model.tensor_parallel = "):
        recipes.check_configs(recipe, [other])


# ---- rendered sbatch scripts (golden files) -------------------------------------------------

GOLDEN_CASES = {
    # one node, 8 ranks per node under one torchrun (the nproc trap), git-packaged code
    "r1-1.5b": [
        "run",
        "r1-1.5b",
        "--executor",
        "slurm",
        "train.run_dir=/lustre/ngrpo/runs/r1-1.5b",
    ],
    # four nodes, c10d rendezvous on the head node, pyxis container + mounts (the model folder
    # mounted because the config names it), NCCL env
    "r1-7b": [
        "run",
        "r1-7b",
        "--executor",
        "slurm",
        "--nodes",
        "4",
        "--container-image",
        "nvcr.io/nvidia/pytorch:25.01-py3",
        "--mount",
        "/lustre:/lustre",
        "--env",
        "NCCL_SOCKET_IFNAME=ib0",
        "--env",
        "NCCL_IB_HCA=mlx5",
        "grpo.kl_coef=0.01",
        "train.run_dir=/lustre/ngrpo/runs/r1-7b",
    ],
    # heterogeneous job: vLLM rollout servers + the training group with its own rendezvous
    "r1-14b": [
        "run",
        "r1-14b",
        "--executor",
        "slurm",
        "--disaggregated",
        "--rollout-nodes",
        "2",
        "train.run_dir=/lustre/ngrpo/runs/r1-14b",
    ],
}


def normalise(text: str, home: Path) -> str:
    text = text.replace(str(home), "<NEMORUN_HOME>").replace(str(REPO), "<REPO>")
    return re.sub(r"(ngrpo-[\w.-]+?)_\d{12,}", r"\1_<ID>", text)


@pytest.fixture(scope="module")
def dryruns(tmp_path_factory):
    """``ngrpo-launch run ... --dryrun`` of every golden case, all at once."""
    tmp = tmp_path_factory.mktemp("dryrun")
    env = {**os.environ, "NEMORUN_HOME": str(tmp / "nemorun_home")}
    runs = {
        name: start_cli(
            [
                *argv,
                "--config",
                str(REPO / "configs" / f"ngrpo_{name.replace('-', '_')}.yaml"),
                "--account",
                "acct",
                "--partition",
                "gpu",
                "--dryrun",
            ],
            env,
            tmp / f"{name}.log",
        )
        for name, argv in GOLDEN_CASES.items()
    }
    yield tmp / "nemorun_home", runs
    for launch in runs.values():
        launch.kill()


@pytest.mark.parametrize("name", list(GOLDEN_CASES))
def test_golden_sbatch(name, dryruns):
    home, runs = dryruns
    rc, out = runs[name].finish()
    assert rc == 0, out[-4000:]
    check_golden(name, out, home)


def check_golden(name: str, out: str, home: Path) -> None:
    """``out`` of a dry run, from its first script on, equals tests/golden/<name>.sbatch."""
    marker = "# ---- "  # the CLI prints each script after a header line; NeMo-Run's logs precede it
    script = out[out.index(marker) :].split("\n", 1)[1]
    got = normalise(script, home)
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("NGRPO_UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text(), f"{path} differs (NGRPO_UPDATE_GOLDEN=1 to regenerate)"


# The user scripts launchers/*.py with their site variables set to a golden case's options
# (GOLDEN_CASES): each renders that case's sbatch; the colocated 14B has its own golden file.
LAUNCHERS = {
    "r1_1_5b": ("r1-1.5b", {}),
    "r1_7b": (
        "r1-7b",
        dict(
            NODES=4,
            CONTAINER_IMAGE="nvcr.io/nvidia/pytorch:25.01-py3",
            MOUNTS=["/lustre:/lustre"],
            ENV={"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5"},
            OVERRIDES=["grpo.kl_coef=0.01", "train.run_dir=/lustre/ngrpo/runs/r1-7b"],
        ),
    ),
    "r1_14b": ("r1-14b-colocated", {}),
    "r1_14b_disaggregated": ("r1-14b", {}),
}


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_launcher_renders_its_golden_sbatch(name, tmp_path, monkeypatch, capsys):
    golden, settings = LAUNCHERS[name]
    home = tmp_path / "nemorun_home"
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    monkeypatch.setattr(nemo_run.config, "_NEMORUN_HOME", str(home))  # read at its import
    spec = importlib.util.spec_from_file_location(name, REPO / "launchers" / f"{name}.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    for key, value in dict(ACCOUNT="acct", PARTITION="gpu", **settings).items():
        assert hasattr(launcher, key), (name, key)
        setattr(launcher, key, value)
    with (tmp_path / "stdin").open("w+") as stdin:
        # git packaging (invoke) reads stdin, which pytest's capture forbids
        monkeypatch.setattr("sys.stdin", stdin)
        assert launcher.main(["--dryrun"]) == 0
    check_golden(golden, capsys.readouterr().out, home)


@pytest.mark.parametrize("name", ["r1-7b", "r1-14b"])
def test_cluster_options_reach_the_script(name, tmp_path, monkeypatch, capsys):
    """--time, --mem, --no-exclusive, --rdzv-port, --packager none and (hetjob)
    --group-start-wait and --group-monitor-wait (told apart by their values), launch.Cluster's
    fields, in a one-group job's and a hetjob's script (each renders its torchrun its own way),
    where the golden ones have their defaults."""
    home = tmp_path / "nemorun_home"
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    monkeypatch.setattr(nemo_run.config, "_NEMORUN_HOME", str(home))  # read at its import
    config = REPO / "configs" / f"ngrpo_{name.replace('-', '_')}.yaml"
    flags = ["--time", "02:03:04", "--mem", "100G", "--no-exclusive", "--rdzv-port", "23456"]
    flags += ["--group-start-wait", "7", "--group-monitor-wait", "9", "--packager", "none"]
    argv = [*GOLDEN_CASES[name], "--config", str(config), "--dryrun", *flags]
    with (tmp_path / "stdin").open("w+") as stdin:  # git packaging reads stdin
        monkeypatch.setattr("sys.stdin", stdin)
        assert cli.main(argv) == 0
    script, golden = capsys.readouterr().out, (GOLDEN / f"{name}.sbatch").read_text()
    changes = [
        (re.search(r"#SBATCH --time=\S+", golden).group(0), "#SBATCH --time=02:03:04"),
        ("#SBATCH --mem=0", "#SBATCH --mem=100G"),
        (":29500 ", ":23456 "),
    ]
    if name == "r1-14b":
        changes += [
            ("\nsleep 30\n", "\nsleep 7\n"),  # between the groups' starts
            ("    sleep 60\n", "    sleep 9\n"),  # the monitor's checks
        ]
    # packager none: the jobs import this checkout in place, not the archive in the job directory
    if name == "r1-7b":  # in a container: the checkout mounted at its own path
        changes += [("PYTHONPATH=/nemo_run/code", f"PYTHONPATH={REPO}")]
        assert f",{REPO}:{REPO}," in script and f"{REPO}:{REPO}" not in golden
    else:
        changes += [("/rollout-train/code${PYTHONPATH", f"PYTHONPATH={REPO}${{PYTHONPATH")]
    for default, flipped in changes:
        assert default in golden and default not in script and flipped in script, flipped
    assert "#SBATCH --exclusive" in golden and "#SBATCH --exclusive" not in script


def test_torchrun_gets_one_rank_per_gpu():
    """The NeMo-Run trap: one Slurm task per node, torchrun starts 8 ranks (not 1) on it."""
    text = (GOLDEN / "r1-1.5b.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --gpus-per-node=8" in text
    assert "--nproc-per-node 8" in text
    het = (GOLDEN / "r1-14b.sbatch").read_text()
    assert (
        "--nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $het_group_host_1:"
        in het
    )
    assert "#SBATCH hetjob" in het and "python -m megatron_ngrpo.rollout.remote.server" in het
    assert "rollout.engine=remote rollout.remote.url_dir=<NEMORUN_HOME>/experiments/" in het
    # GPU disaggregated defaults: weights over NCCL, rollout-only GPUs at 0.9 (not the colocated 0.4)
    assert "rollout.remote.num_servers=4 rollout.remote.weight_transfer=nccl" in het
    assert "--gpu-memory-utilization 0.9 " in het


# ---- a real job through NeMo-Run's LocalExecutor --------------------------------------------


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """Two CLI runs at once: the smoke forward (tests/smoke_workload.py) under torchrun (2 gloo
    ranks, TP 2) and one with a bad config value."""
    tmp = tmp_path_factory.mktemp("local")
    hf, config = write_smoke_inputs(tmp)
    env = {**smoke_env(), "NEMORUN_HOME": str(tmp / "nemorun_home"), "OMP_NUM_THREADS": "1"}
    base = [
        "run",
        "tiny",
        "--executor",
        "local",
        "--config",
        str(config),
        "--module",
        SMOKE_MODULE,
        "--hf-path",
        str(hf),
    ]
    ok = start_cli(
        [*base, f"smoke.out={tmp / 'out.json'}", "--title", "local-ok"], env, tmp / "ok.log"
    )
    bad = start_cli(
        [*base, "model.pipeline_parallel=2", "--title", "local-bad"], env, tmp / "bad.log"
    )
    yield tmp, ok, bad
    ok.kill()
    bad.kill()


def test_local_torchrun_job(local_runs):
    tmp, ok, _ = local_runs
    rc, out = ok.finish()
    assert rc == 0, out[-4000:]
    assert "train: SUCCEEDED" in out and experiment_id(out).startswith("local-ok_")
    result = json.loads((tmp / "out.json").read_text())
    assert result["world_size"] == 2 and result["tp"] == 2
    # megatron's own parameter count on a TP rank = the memory model's
    spec = recipes.get("tiny").spec
    assert result["params"] == memory.stage_params(spec, 2, 1, 0)
    assert abs(result["loss"] - math.log(spec.vocab_size)) < 0.5  # random init: ≈ ln V
    # The job's output follows in the terminal, torchrun's INFO lines only in its log file.
    assert "SMOKE loss=" in out
    assert not [line for line in out.splitlines() if TORCHRUN_INFO.match(line.encode())]
    stderr_log = next(f for f in tmp.rglob("nemo_run/*/*/0/stderr.log") if "local-ok" in str(f))
    assert (
        sum(bool(TORCHRUN_INFO.match(line)) for line in stderr_log.read_bytes().splitlines()) > 10
    )


def test_quiet_log_drops_torchrun_info_lines_in_any_chunking():
    """QuietLog on a torchrun log fed in chunks split at every offset: INFO lines (glog format,
    torch.distributed.elastic) go, the rest comes through whole, a progress bar's partial line at
    once."""
    info = [
        b"I1126 17:29:15.097000 9791 site-packages/torch/distributed/launcher/api.py:254] "
        b"Starting elastic_operator with launch configs:",
        b"I1126 17:29:15.097000 9791 site-packages/torch/distributed/launcher/api.py:254]   nproc_per_node : 2",
        b"I1126 17:29:15.174000 9791 site-packages/torch/distributed/elastic/agent/server/api.py:553] ",
    ]
    kept = [
        b"W1126 17:29:15.000000 9791 site-packages/torch/distributed/run.py:803] a warning stays",
        b"[default0]:train:  10%|#   | 1/10 [00:01<00:09, reward=0.31 kl=0.00]",
        b"Iteration 5 ] not torchrun",
        b"I like lines that start with I",
    ]
    log = b"\n".join([info[0], kept[0], info[1], kept[1], info[2], kept[2], kept[3]]) + b"\n"
    expected = b"\n".join(kept) + b"\n"
    for cut in range(len(log)):
        quiet = QuietLog()
        assert quiet.feed(log[:cut]) + quiet.feed(log[cut:]) + quiet.flush() == expected, cut
    quiet = QuietLog()  # a progress bar redraw (no newline) is not held back
    assert quiet.feed(b"\rtrain:  20%|##  | 2/10") == b"\rtrain:  20%|##  | 2/10"
    assert quiet.feed(info[1][:30]) == b"" and quiet.feed(info[1][30:] + b"\n") == b""


def _job_log_lines(logger: str, level: int, message: str) -> list[bytes]:
    """A record as the trainer logs it (train.py's formatter), behind torchrun's rank prefix."""
    import logging

    from megatron_ngrpo.train import HeadEveryLine

    record = logging.LogRecord(logger, level, __file__, 1, message, None, None)
    text = HeadEveryLine("%(asctime)s %(levelname)s %(name)s: %(message)s").format(record)
    return [b"[default0]:" + line.encode() for line in text.split("\n")]


def test_quiet_log_drops_megatrons_info_records_in_any_chunking():
    """megatron-core's INFO records (the DDP config dump, the gradient buckets' parameter list as
    one multi-line record, FSDP notices) stay in the job's log only; its warnings, the trainer's
    own INFO lines (the stages) and the progress bar come through."""
    import logging

    info = [
        *_job_log_lines(
            "megatron.core.distributed.param_and_grad_buffer",
            logging.INFO,
            "Number of buckets for gradient all-reduce / reduce-scatter: 1\n"
            "Params for bucket 1 (39360 elements, 39360 padded size):\n"
            "\tdecoder.layers.1.pre_mlp_layernorm.weight\n\tembedding.word_embeddings.weight",
        ),
        *_job_log_lines(
            "megatron.core.optimizer",
            logging.INFO,
            "Setting up optimizer with config OptimizerConfig(lr=0.0003, " + "x=1, " * 300 + ")",
        ),
    ]
    kept = [
        *_job_log_lines("megatron.core.optimizer", logging.WARNING, "a warning stays"),
        *_job_log_lines("megatron_ngrpo.training.trainer", logging.INFO, "warm-start: 2 steps"),
        b"[default0]:train: 100%|##########| 1/1 [00:02<00:00, kl=0.0000, reward=0.000]",
        b"[default1]:2026 is a year",
    ]
    assert len(info) == 5
    log = b"\n".join([info[0], kept[0], *info[1:3], kept[1], kept[2], *info[3:], kept[3]]) + b"\n"
    expected = b"\n".join(kept) + b"\n"
    for cut in range(0, len(log), 7):
        quiet = QuietLog()
        assert quiet.feed(log[:cut]) + quiet.feed(log[cut:]) + quiet.flush() == expected, cut
    quiet = QuietLog()  # a progress bar redraw behind the rank prefix is not held back
    assert quiet.feed(b"[default0]:\rtrain:  20%|##") == b"[default0]:\rtrain:  20%|##"


def test_local_failure_exits_nonzero(local_runs):
    _, _, bad = local_runs
    rc, out = bad.finish()
    assert rc == 1, out[-4000:]
    assert "train: FAILED" in out and "did not succeed" in out


# ---- what a Slurm job reads and writes (launch/job_files.py), conversions' command line --------


def test_container_mounts_what_the_job_reads_and_refuses_uncovered_writes():
    files = job_files.JobFiles(
        reads={"model.hf_path": "/models/m", "train.load": "/lustre/ckpt/iter_10"},
        writes={"train.run_dir": "/lustre/runs/a"},
    )
    assert job_files.container_mounts(["/lustre:/lustre"], files) == [
        "/lustre:/lustre",
        "/models/m:/models/m",
    ]
    assert job_files.container_mounts(["/data/models:/models:ro", "/lustre:/lustre"], files) == [
        "/data/models:/models:ro",
        "/lustre:/lustre",
    ]
    with pytest.raises(
        ConfigError, match=r"^train.run_dir = '/lustre/runs/a': not under any --mount"
    ):
        job_files.container_mounts(
            ["/lustre2:/lustre2", "/lus:/lus"], files
        )  # a prefix is not a parent
    with pytest.raises(ConfigError, match=r"^train.run_dir = 'runs/a': relative"):
        job_files.require_absolute(job_files.JobFiles(writes={"train.run_dir": "runs/a"}))


def test_train_files_are_the_configs_absolute_paths(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "tokenizer: deepseek-r1-distill-qwen\ndata:\n  train:\n    - path: /lustre/d.jsonl\n"
        "    - path: rel.jsonl\ntrain:\n  run_dir: /lustre/run\n  load: /ckpt/iter_1\n"
    )
    files = job_files.train_files([str(config)], ["model.hf_path=/models/m"])
    assert files.reads == {
        "model.hf_path": "/models/m",
        "data.train[0].path": "/lustre/d.jsonl",
        "train.load": "/ckpt/iter_1",
    }
    assert files.writes == {"train.run_dir": "/lustre/run"}


def test_conversions_run_the_installed_package():
    """Rendered conversions are ``python -m`` of the package (no checkout path: the bug was a
    tools/ path under the package folder), and the launcher's checkout is the repository root."""
    from megatron_ngrpo.launch import executors

    assert (executors.REPO / "setup.py").is_file()
    tiny = recipes.get("tiny")
    hf = recipes.render(tiny, "convert-hf", hf_path="/m", output="/o")
    assert hf.command.argv == (
        "python",
        "-m",
        "megatron_ngrpo.conversion",
        "hf-to-megatron",
        "--input",
        "/m",
        "--output",
        "/o",
        "--tp",
        "2",
        "--pp",
        "1",
    )
    back = recipes.render(tiny, "convert-megatron", hf_path="/m", output="/o", checkpoint="/c")
    assert back.command.argv[:4] == ("python", "-m", "megatron_ngrpo.conversion", "megatron-to-hf")
    assert not any(a.endswith(".py") for t in (hf, back) for a in t.command.argv)


CONVERSION_MODULE = importlib.util.find_spec("megatron_ngrpo.conversion.__main__") is not None


@pytest.mark.skipif(
    not CONVERSION_MODULE,
    reason="python -m megatron_ngrpo.conversion comes with branch 'standalone' (ngrpo-convert)",
)
def test_local_conversion_job_with_packager_none(tmp_path):
    """A real conversion job through the launcher (local torchrun, 2 ranks = the tiny recipe's TP 2,
    the checkout in place): the HF model becomes a Megatron checkpoint."""
    from tests.harness.tiny import write_tiny_hf

    hf = write_tiny_hf(tmp_path / "hf")
    env = {**smoke_env(), "NEMORUN_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    rc, out = start_cli(
        [
            "run",
            "tiny",
            "--task",
            "convert-hf",
            "--executor",
            "local",
            "--packager",
            "none",
            "--hf-path",
            str(hf),
            "--output",
            str(tmp_path / "ckpt"),
            "--title",
            "convert",
        ],
        env,
        tmp_path / "convert.log",
    ).finish()
    assert rc == 0 and "convert-hf: SUCCEEDED" in out, out[-4000:]
    meta = json.loads((tmp_path / "ckpt" / "megatron_ngrpo.json").read_text())
    assert meta["tensor_parallel"] == 2


def test_git_packaged_job_finds_what_the_recipes_need(tmp_path):
    """The default packager (NeMo-Run's GitArchivePackager: ``git archive`` of a commit) must carry
    everything the GPU recipes' configs name besides the model: the archive of this working tree's
    tracked files (``git stash create``), unpacked alone and run from there with no shared data
    folder (NGRPO_SHARED unset), validates each recipe's training config at its world size
    (tokenizer, data files, benchmarks; the model folder is a config.json of the recipe's shape)."""
    import subprocess
    import tarfile

    def git(*a):
        return subprocess.run(
            ["git", *a], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()

    ref = git("stash", "create") or "HEAD"
    # In its own process: NeMo-Run's shell runner reads stdin, which pytest captures.
    pack = (
        "import sys; from pathlib import Path; import nemo_run as run\n"
        "print(run.GitArchivePackager(ref=sys.argv[1]).package(Path(sys.argv[2]), sys.argv[3], 'code'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", pack, ref, str(REPO), str(tmp_path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    archive = out.strip().splitlines()[-1]
    code = tmp_path / "job" / "code"
    code.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(code, filter="data")
    names = ["r1-1.5b", "r1-7b", "r1-14b"]
    # The R1 tokenizer by name (the repository's copy), not the model folder's (a config.json only).
    check = (
        "import sys\nfrom megatron_ngrpo.launch import plan, recipes\n"
        "for name in sys.argv[1:]:\n"
        "    plan.recipe_config(recipes.get(name), recipes.get(name).nodes, ('tokenizer=deepseek-r1-distill-qwen',))\n"
        "print(plan.__file__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "NGRPO_SHARED"}
    p = subprocess.run(
        [sys.executable, "-c", check, *names],
        cwd=code,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHONPATH": str(code)},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == str(
        code / "megatron_ngrpo" / "launch" / "plan.py"
    )  # the archive's code ran


@pytest.mark.parametrize(
    "rollout_args,refused",
    [
        ("--quantization fp8", "'--quantization'"),
        ("--max-num-seqs 8 -qfp8", "'-qfp8'"),
        ("--kv_cache_dtype=fp8_e4m3", "'--kv_cache_dtype=fp8_e4m3'"),
        ("--no-enforce-eager", "'--no-enforce-eager'"),
        ("-O3", "'-O3'"),
    ],
)
def test_rollout_servers_refuse_what_the_colocated_engine_refuses(
    rollout_args, refused, tmp_path, monkeypatch, capsys
):
    """FP8 (and the other options the colocated engine refuses or the hook needs fixed) through
    ``--rollout-args``: one line from ``ngrpo-launch run`` before it plans the job, and from the
    rollout server before vLLM starts."""
    from megatron_ngrpo.rollout.remote import server

    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "home"))
    config = REPO / "configs" / "ngrpo_r1_14b.yaml"
    argv = [*GOLDEN_CASES["r1-14b"], "--config", str(config), "--dryrun"]
    argv.append(f"--rollout-args={rollout_args}")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --rollout-args: rollout server option {refused} is refused")
    assert "\n" not in err
    model = tmp_path / "model"
    assert server.main(["--model", str(model), "--port", "1", *rollout_args.split()]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: rollout server: ")
    assert f"rollout server option {refused} is refused" in err
    assert "\n" not in err and not model.exists()
