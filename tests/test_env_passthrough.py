"""``ngrpo-launch run --env``: ``--env NAME`` passes the launcher's own value to the job without
writing it into the rendered script or anything NeMo-Run writes; an inline value of a name that
looks like a credential is refused in one line (launch/passthrough.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import nemo_run
import pytest

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.launch import cli, passthrough

REPO = Path(__file__).resolve().parents[1]
SECRET = "sk-test-4f1d9c2b7e"
ARGV = [
    "run",
    "r1-7b",
    "--executor",
    "slurm",
    "--config",
    str(REPO / "configs" / "ngrpo_r1_7b.yaml"),
    "--account",
    "acct",
    "--partition",
    "gpu",
    "--container-image",
    "img",
    "--mount",
    "/lustre:/lustre",
    "train.run_dir=/lustre/ngrpo/runs/r1-7b",
]


def test_split_refuses_inline_credentials_and_missing_names():
    env = {"WANDB_API_KEY": SECRET}
    assert passthrough.split([("NCCL_IB_HCA", "mlx5"), ("WANDB_API_KEY", None)], env) == (
        {"NCCL_IB_HCA": "mlx5"},
        ("WANDB_API_KEY",),
    )
    for name in ("WANDB_API_KEY", "hf_token", "MY_SECRET", "DB_PASSWORD"):
        with pytest.raises(ConfigError, match=rf"^--env {name}=\.\.\.: looks like a credential"):
            passthrough.split([(name, SECRET)], env)
    with pytest.raises(ConfigError, match=r"^--env HF_TOKEN: not set in this environment"):
        passthrough.split([("HF_TOKEN", None)], env)
    with pytest.raises(ConfigError, match=r"not an environment variable name"):
        passthrough.split([("A-B", None)], env)


def test_inline_credential_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nemo_run.config, "_NEMORUN_HOME", str(tmp_path))  # read at its import
    with (tmp_path / "stdin").open("w+") as stdin:  # git packaging (invoke) reads stdin
        monkeypatch.setattr("sys.stdin", stdin)
        assert cli.main([*ARGV, "--env", f"WANDB_API_KEY={SECRET}", "--dryrun"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--env WANDB_API_KEY" in err and SECRET not in err, err


def test_passed_through_value_is_in_no_script_and_no_file(tmp_path, monkeypatch, capsys):
    home = tmp_path / "nemorun_home"
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    monkeypatch.setattr(nemo_run.config, "_NEMORUN_HOME", str(home))  # read at its import
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    with (tmp_path / "stdin").open("w+") as stdin:  # git packaging (invoke) reads stdin
        monkeypatch.setattr("sys.stdin", stdin)
        assert (
            cli.main([*ARGV, "--env", "WANDB_API_KEY", "--env", "NCCL_IB_HCA=mlx5", "--dryrun"])
            == 0
        )
    script = capsys.readouterr().out
    assert "export NCCL_IB_HCA=mlx5" in script  # plain values are still written
    assert SECRET not in script and "export WANDB_API_KEY" not in script
    check = passthrough.check_lines(("WANDB_API_KEY",))[0]
    assert check in script
    written = [p for p in home.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert home.is_dir() and written == []
    # The check under the script's `set -evx`: silent about the value, stops a job without it.
    run = lambda env: subprocess.run(  # noqa: E731
        ["bash", "-c", f"set -evx\n{check}\necho arrived"], env=env, capture_output=True, text=True
    )
    ok = run({"WANDB_API_KEY": SECRET})
    assert ok.returncode == 0 and "arrived" in ok.stdout and SECRET not in ok.stdout + ok.stderr
    missing = run({})
    assert missing.returncode == 1 and "--env WANDB_API_KEY: not in the job" in missing.stdout
