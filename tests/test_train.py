"""The training entry point: configuration errors (one line each, before any process group), and
2-process runs of configs/tiny_test.yaml that are SIGKILLed after a checkpoint, or stopped by a
signal or the allocation's deadline (training/stop.py), and resumed, which must end bit-identical
(fp32, CPU) to uninterrupted runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.parallel import free_port
from megatron_ngrpo.training.job_config import load_config
from megatron_ngrpo.training.stop import ALLOCATIONS_FILE, EXIT_CONTINUE
from tests.harness.checkpoint import written_bytes
from tests.support.probed_train import GATE_VAR, SIGNAL_VAR, SaveGatekeeper

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny_test.yaml"
STEPS = ("train.max_steps=6", "train.save_every=2")
PROBED = "tests.support.probed_train"
# TP 2, one-step-off rollouts: a checkpoint holds the in-flight batch and its weights
ONE_STEP_OFF = ("train.async.max_staleness=1", "model.tensor_parallel=2")


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    """The arithmetic task (character tokenizer, tiny Qwen2 config, problems) and ``paths.yaml``,
    an overlay pointing configs/tiny_test.yaml at it."""
    from slurm_harness import write_arithmetic_task

    root = tmp_path_factory.mktemp("arith")
    write_arithmetic_task(root)
    return root


def _cfg(task: Path, *overrides: str, world: int = 1, monkeypatch=None):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return load_config([TINY, task / "paths.yaml"], list(overrides))


# ---- configuration errors ----------------------------------------------------------------------
ERRORS = [
    (["model.tensor_parallel=3"], 3, "does not divide num_attention_heads = 4"),
    (["model.pipeline_parallel=3"], 3, "does not divide num_hidden_layers = 2"),
    (["model.tensor_parallel=2"], 3, "does not divide the world size 3"),
    (
        ["train.prompts_per_step=6", "train.mini_batch_prompts=3"],
        4,
        "'train.prompts_per_step' = 6: must be divisible by the data-parallel size 4",
    ),
    (
        ["train.prompts_per_step=5"],
        1,
        "'train.mini_batch_prompts' = 2: must divide prompts_per_step = 5",
    ),
    (["train.micro_batch_size=3"], 1, "'train.micro_batch_size' = 3: must divide the 8 responses"),
    (
        ["train.load=/nonexistent/ckpt"],
        1,
        "'train.load' = '/nonexistent/ckpt': not a megatron_ngrpo checkpoint",
    ),
    (["train.load=''"], 1, "has no *.safetensors"),
    (["tokenizer=/nonexistent/tok"], 1, "'tokenizer' = '/nonexistent/tok'"),
    (
        ["data.train=[{path: /nonexistent/x.jsonl}]"],
        1,
        "'data.train[0].path' = '/nonexistent/x.jsonl': file not found",
    ),
    (
        ["model.hf_path=/nonexistent"],
        1,
        "'model.hf_path' = '/nonexistent': no config.json in this directory "
        "(looked for /nonexistent/config.json)",
    ),
    (
        ["tokenizer=no-such-name"],
        1,
        "'tokenizer' = 'no-such-name': neither a known tokenizer name "
        "(deepseek-r1-distill-qwen, qwen2) nor a folder (looked for /",
    ),
    (["tokenizer=''"], 1, "'tokenizer' = '': empty means the tokenizer of the model folder, but "),
    (
        ["data.train=[{path: no/such.jsonl}]"],
        1,
        "'data.train[0].path' = 'no/such.jsonl': file not found (looked for "
        f"{REPO / 'no/such.jsonl'}, {REPO / 'data/no/such.jsonl'})",
    ),
    (
        ["validation.every=5", "validation.benchmarks=[/no/such.jsonl]"],
        1,
        "'validation.benchmarks[0]' = '/no/such.jsonl': file not found (looked for /no/such.jsonl)",
    ),
    # The arithmetic model's positions: 64 (vLLM's own error is a pydantic traceback on every rank).
    (
        ["rollout.engine=vllm", "rollout.vllm.max_model_len=4096"],
        1,
        "'rollout.vllm.max_model_len' = 4096: above the model's max_position_embeddings 64",
    ),
    (["grpo.loss_agg=mean"], 1, "'grpo.loss_agg' = 'mean'"),
    (
        ["rollout.max_new_tokens=4"],
        1,
        "'reward.overlong_buffer' = 4: the soft overlong penalty's buffer must be shorter than "
        "the length it counts to (rollout.max_new_tokens = 4)",
    ),
    (
        ["train.pack_sequences=true", "model.pipeline_parallel=2"],
        2,
        "'train.pack_sequences' = True: needs model.pipeline_parallel = 1",
    ),
    (
        ["train.async_save=true", "train.async.max_staleness=1"],
        1,
        "'train.async_save' = True: forks a writer",
    ),
    (
        ["train.dynamic_sampling.enabled=true", "train.async.max_staleness=1"],
        1,
        "'train.dynamic_sampling.enabled' = True: refills",
    ),
    (
        ["train.dynamic_sampling.max_gen_batches=0"],
        1,
        "'train.dynamic_sampling.max_gen_batches' = 0",
    ),
    (["grpo.advantage=rloo"], 1, "'grpo.advantage' = 'rloo'"),
    (["grpo.loss_mode=seq"], 1, "'grpo.loss_mode' = 'seq'"),
    (["grpo.kl_estimator=k4"], 1, "'grpo.kl_estimator' = 'k4'"),
    (["grpo.kl_mode=reward"], 1, "'grpo.kl_mode' = 'reward'"),
    (["grpo.dual_clip=0.5"], 1, "'grpo.dual_clip' = 0.5"),
    (["grpo.clip_low=1.5"], 1, "'grpo.clip_low' = 1.5"),
    (["grpo.tis_cap=0"], 1, "'grpo.tis_cap' = 0"),
    (["grpo.old_logprobs=engine"], 1, "'grpo.old_logprobs' = 'engine'"),
    (["grpo.dra.embedder=jina"], 1, "'grpo.dra.embedder' = 'jina'"),
    (["grpo.dra.scope=device"], 1, "'grpo.dra.scope' = 'device'"),
    (["optim.lr=0"], 1, "'optim.lr' = 0"),
    (["optim.lr_schedule=step"], 1, "'optim.lr_schedule' = 'step'"),
    (["optim.min_lr=1.0"], 1, "'optim.min_lr' = 1.0"),
    (["train.micro_batch_size=0"], 1, "'train.micro_batch_size' = 0"),
    (["train.reference=cpu"], 1, "'train.reference' = 'cpu'"),
    (["validation.every=-1"], 1, "'validation.every' = -1"),
    (["train.warmstart.steps=2"], 1, "'train.warmstart.path' = '': file does not exist"),
    (["mixing.k=40"], 1, "'mixing.k' = 40: larger than the vocabulary"),
    (
        ["rollout.engine=vllm", "rollout.vllm.tensor_parallel=4"],
        2,
        "'rollout.vllm.tensor_parallel' = 4: must divide the world size 2",
    ),
    (
        ["rollout.engine=vllm", "rollout.vllm.in_process=false"],
        2,
        "'rollout.vllm.in_process' = False",
    ),
    (["rollout.vllm.enforce_eager=false"], 1, "CUDA graphs bypass the mixing hook"),
    (
        ["train.async.max_staleness=2"],
        1,
        "'train.async.max_staleness' = 2: expected 0 (synchronous) or 1",
    ),
    (["train.async.on_stale=skip"], 1, "'train.async.on_stale' = 'skip'"),
    (
        ["rollout.engine=vllm", "train.async.max_staleness=1"],
        1,
        "'train.async.max_staleness' = 1: one-step-off rollouts need an engine beside the trainer's groups",
    ),
    (
        [
            "rollout.engine=remote",
            "rollout.remote.urls=[http://127.0.0.1:1]",
            "mixing.neighbor_lookup=on_demand",
            "mixing.refresh_every=1",
        ],
        1,
        "'mixing.neighbor_lookup' = 'on_demand': rollout servers mix with the trainer's table only",
    ),
    (["train.no_such_field=1"], 1, "no_such_field"),
]


@pytest.mark.parametrize("overrides,world,message", ERRORS, ids=[e[0][0] for e in ERRORS])
def test_config_error_messages(task, monkeypatch, overrides, world, message):
    with pytest.raises(ConfigError) as err:
        _cfg(task, *overrides, world=world, monkeypatch=monkeypatch)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_async_megatron_engine_is_refused_on_gpu(task, monkeypatch):
    """Valid on CPU (tests/test_async.py runs it); on a GPU refused until measured."""
    assert _cfg(
        task, "train.async.max_staleness=1", world=2, monkeypatch=monkeypatch
    ).train.async_.max_staleness
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(
        ConfigError,
        match=r"^config field 'train.async.max_staleness' = 1: the one-step-off "
        r"Megatron engine is not measured on GPU .*use rollout.engine=remote",
    ):
        _cfg(task, "train.async.max_staleness=1", world=2, monkeypatch=monkeypatch)
    _cfg(
        task,
        "train.async.max_staleness=1",
        "rollout.engine=remote",
        "rollout.remote.urls=[http://x:1]",
        world=2,
        monkeypatch=monkeypatch,
    )  # rollout servers stay allowed


def test_tiny_config_is_valid_and_main_exits_2_on_errors(task, monkeypatch, capsys):
    cfg = _cfg(task, world=2, monkeypatch=monkeypatch)
    assert cfg.mixing.enabled and cfg.rollout.n == 4
    from megatron_ngrpo.train import main

    assert (
        main(["--config", str(TINY), "--config", str(task / "paths.yaml"), "grpo.kl_estimator=k9"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: config field 'grpo.kl_estimator' = 'k9'") and "\n" not in err


def test_vllm_max_model_len_defaults_to_the_models_limit(task, monkeypatch):
    from megatron_ngrpo.rollout.config import vllm_max_model_len

    cfg = _cfg(task, "rollout.engine=vllm", monkeypatch=monkeypatch)
    assert cfg.rollout.vllm.max_model_len == 0
    assert (
        vllm_max_model_len(cfg.rollout.vllm, 64) == 64
        and vllm_max_model_len(cfg.rollout.vllm, 10**5) == 4096
    )
    # set: the vLLM engine's length (the engine, the trainer's and the eval CLI's checks ask this
    # resolver), within the model's positions
    cfg = _cfg(
        task, "rollout.engine=vllm", "rollout.vllm.max_model_len=48", monkeypatch=monkeypatch
    )
    assert vllm_max_model_len(cfg.rollout.vllm, 64) == 48
    with pytest.raises(ConfigError, match=r"'rollout.vllm.max_model_len' = 48: above the model's"):
        vllm_max_model_len(cfg.rollout.vllm, 32)


def test_model_folder_tokenizer_is_the_default(task, monkeypatch, tmp_path):
    """tokenizer '' (the default) = the model folder's own tokenizer and chat template; a model
    folder holding only the R1-Distill parts gets the recipe's rebuild."""
    import shutil

    from megatron_ngrpo.data.paths import REPO_DATA
    from megatron_ngrpo.data.tokenizer import load_tokenizer
    from megatron_ngrpo.training.job_config import NGRPOConfig

    assert NGRPOConfig.tokenizer == ""
    model = shutil.copytree(task / "model", tmp_path / "model")
    template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    own = load_tokenizer(task / "tokenizer")
    own.chat_template = template
    own.save_pretrained(model)
    cfg = _cfg(task, "tokenizer=''", f"model.hf_path={model}", monkeypatch=monkeypatch)
    tok = load_tokenizer(cfg.tokenizer, cfg.model.hf_path)
    assert len(tok) == len(own) < 100 and tok("max(1,2)=").input_ids == own("max(1,2)=").input_ids
    assert (
        tok.apply_chat_template([{"role": "user", "content": "max(1,2)="}], tokenize=False)
        == "Q: max(1,2)=\nA:"
    )
    # A named tokenizer (the config's field) still wins over the folder's.
    named = _cfg(
        task, f"tokenizer={task / 'tokenizer'}", f"model.hf_path={model}", monkeypatch=monkeypatch
    )
    tok = load_tokenizer(named.tokenizer, named.model.hf_path)
    assert tok.chat_template != template and len(tok) == len(own)
    assert len(load_tokenizer("qwen2", model)) == 151646
    r1_model = shutil.copytree(
        REPO_DATA / "tokenizers" / "deepseek-r1-distill-qwen", tmp_path / "r1"
    )
    r1 = load_tokenizer("", r1_model)
    assert len(r1) == 151665 and r1.bos_token_id == 151646
    assert (
        r1.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
        )
        == "<｜begin▁of▁sentence｜><｜User｜>x<｜Assistant｜>"
    )


def test_old_eval_section_is_read_as_validation(task, monkeypatch, capsys, tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("eval:\n  every: 3\n  limit: 2\n")
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = load_config([TINY, task / "paths.yaml", old], ["eval.limit=5"])
    assert (cfg.validation.every, cfg.validation.limit) == (3, 5)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"deprecated: config file {str(old)!r}: section 'eval' is now 'validation'",
        "deprecated: override 'eval.limit=5': section 'eval' is now 'validation'",
    ], lines
    old.write_text("eval:\n  every: 3\nvalidation:\n  every: 4\n")
    with pytest.raises(ConfigError, match="both 'eval' .* and 'validation'"):
        load_config([TINY, task / "paths.yaml", old])


@pytest.mark.parametrize("name", ["ngrpo_r1_1.5b", "ngrpo_r1_7b", "ngrpo_r1_14b"])
def test_paper_configs_carry_paper_defaults(name):
    from omegaconf import OmegaConf

    from megatron_ngrpo.training.job_config import NGRPOConfig

    # Structure and types only (the HF checkpoints are not here): merge without validating.
    cfg = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(NGRPOConfig), OmegaConf.load(REPO / "configs" / f"{name}.yaml")
        )
    )
    assert (cfg.optim.lr, cfg.grpo.kl_coef, cfg.train.prompts_per_step, cfg.rollout.n) == (
        1e-6,
        0.001,
        64,
        4,
    )
    assert (cfg.mixing.rate, cfg.mixing.k, cfg.train.epochs_per_rollout) == (0.1, 3, 1)


# ---- kill and resume ------------------------------------------------------------------------------
def _launch(
    task: Path,
    run_dir: Path,
    *overrides: str,
    module: str = "megatron_ngrpo.train",
    env: dict | None = None,
    launcher: str = "torch.distributed.run",
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        launcher,
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        module,
        "--config",
        str(TINY),
        "--config",
        str(task / "paths.yaml"),
        f"train.run_dir={run_dir}",
        *overrides,
    ]
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _sigkill(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every process under it, by id (torchrun starts its workers in
    sessions of their own, so a process-group kill would miss them)."""

    try:
        family = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=30)


def _finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _sigkill(proc)
        raise
    assert rc == 0, (run_dir.parent / f"{run_dir.name}.log").read_text()[-4000:]


def _latest(run_dir: Path) -> str | None:
    f = run_dir / "latest"
    return f.read_text().strip() if f.is_file() else None


def _tensors(ckpt: Path, scratch: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{ckpt.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


def _losses(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["reward/mean"]) for r in rows]


def _allocations(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / ALLOCATIONS_FILE).read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(task, tmp_path_factory):
    """Uninterrupted 6-step runs (saves every 2 steps) by their overrides, each run once."""
    runs = {}

    def run(*overrides: str) -> Path:
        if overrides not in runs:
            run_dir = tmp_path_factory.mktemp("straight") / "run"
            run_dir.mkdir()
            _finish(_launch(task, run_dir, *STEPS, *overrides), run_dir)
            runs[overrides] = run_dir
        return runs[overrides]

    return run


def _same_run(straight: Path, resumed: Path, scratch: Path, what: str) -> None:
    """The final checkpoints' tensors (model, both optimizers' state) and the metrics rows."""
    assert _latest(straight) == _latest(resumed) == "iter_0000006"
    a = _tensors(straight / "iter_0000006", scratch)
    b = _tensors(resumed / "iter_0000006", scratch)
    assert a.keys() == b.keys() and len(a) > 0
    different = [k for k in a if not torch.equal(a[k], b[k])]
    # (step, loss, grad norm, mean reward) of both runs: where a (rare, untraced) difference starts
    assert not different, (
        f"{what}: tensors differ after resume: {different[:5]}; "
        f"straight {_losses(straight)}, resumed {_losses(resumed)}"
    )
    assert any(k.startswith("optimizer.state.exp_avg.") for k in a)  # both optimizers, model space
    assert _losses(straight) == _losses(resumed)


def _gated(run_dir: Path) -> tuple[dict, SaveGatekeeper]:
    """``_launch`` arguments holding the checkpoint writers of a 6-step run with saves every 2
    steps (tests/support/probed_train.py), and the gatekeeper that opens them."""
    gate = run_dir.parent / f"{run_dir.name}_gate"
    gate.mkdir()
    keeper = SaveGatekeeper(run_dir, gate, saves=[2, 4, 6], last=6)
    return dict(module=PROBED, env={GATE_VAR: str(gate)}), keeper


@pytest.mark.parametrize(
    "variant,overrides",
    [
        # DP 2, sharded (reshardable) optimizer state; `slow`: async_save kills and resumes DP 2
        # too, and the signal tests resume this configuration bit for bit
        pytest.param("adam", (), marks=pytest.mark.slow),
        ("async", ONE_STEP_OFF),
        # DP 2, checkpoints written in the background (megatron's async save, published when done)
        # with the distributed optimizer (the GPU configs' combination); the job's own collective
        # timeout (its process groups are read by tests/support/probed_train.py)
        (
            "async_save",
            (
                "train.async_save=true",
                "optim.distributed_optimizer=true",
                "train.dist_timeout_s=97",
            ),
        ),
    ],
)
def test_sigkill_and_resume_is_bit_identical(task, tmp_path, straight, variant, overrides):
    killed = tmp_path / "killed"
    killed.mkdir()
    # async_save: the first launches hold each save's writers until the next step has run
    gate = _gated if variant == "async_save" else lambda run: ({}, None)
    if variant == "async_save":
        straight = tmp_path / "straight"
        straight.mkdir()
        launch_args, keeper = gate(straight)
        _finish(_launch(task, straight, *STEPS, *overrides, **launch_args), straight)
    else:
        straight, keeper = straight(*overrides), None
    if keeper is not None:
        keeper.close()
        # The step after each save ran while its writers were held: written in the background
        # (a synchronous save would stall the step until the gatekeeper's patience ran out).
        assert keeper.overlapped == {2: True, 4: True}, keeper.overlapped
        for rank in (0, 1):  # every group the job made times out after train.dist_timeout_s
            timeouts = json.loads((straight / f"group_timeouts.{rank}.json").read_text())
            assert len(timeouts) >= 8 and set(timeouts.values()) == {97.0}, timeouts

    launch_args, keeper = gate(killed)
    proc = _launch(task, killed, *STEPS, *overrides, **launch_args)
    deadline = time.time() + 300
    while _latest(killed) is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    _sigkill(proc)
    if keeper is not None:
        keeper.close()
    at_kill = _latest(killed)
    assert at_kill in ("iter_0000002", "iter_0000004"), (
        f"kill came too late or too early: latest = {at_kill}"
    )
    _finish(_launch(task, killed, *STEPS, *overrides), killed)

    _same_run(straight, killed, tmp_path, f"{variant} (killed at {at_kill})")
    assert len(list(straight.glob("iter_*"))) == 2  # keep_last
    if variant != "async":  # DP 2: each rank wrote about half the model and optimizer tensors
        written = written_bytes(killed / "iter_0000006")
        for part in (written["model"], written["optimizer"]):
            assert sorted(part) == [0, 1], written
            assert all(0.4 < part[r] / sum(part.values()) < 0.6 for r in part), written
    if variant == "async":
        for run in (straight, killed):
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            # Step 1 trains on its own rollouts; every later one on the last step's weights'.
            assert [r["async/staleness"] for r in rows] == [0, 1, 1, 1, 1, 1]
            # Old log-probs replayed under the generating weights (mixing on) = the engine's.
            assert all(
                r["logprob_gap/max_abs"] < 1e-5 and r["mixing/mixed_token_frac"] > 0 for r in rows
            ), rows


# ---- planned stops: a signal, the deadline --------------------------------------------------------
def _workers(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    """torchrun's worker processes by global rank."""
    out = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        rank = p.environ().get("RANK")
        if rank is not None and "megatron_ngrpo.train" in p.cmdline():
            out[int(rank)] = p
    return out


def test_a_signal_saves_the_step_reached_and_the_run_resumes_identically(task, tmp_path, straight):
    """SIGUSR1 to one of two ranks (the Slurm warning signal) mid-run: both ranks stop at the
    same step boundary, the checkpoint of that step is published (not only the save_every
    ones), the rank exits 75 and rank 0 records it; the next launch finishes the run as the
    uninterrupted one did, bit for bit."""
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    proc = _launch(task, stopped, *STEPS)
    deadline = time.time() + 300
    while _latest(stopped) is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    _workers(proc)[1].send_signal(signal.SIGUSR1)
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        _sigkill(proc)
        raise
    log = (tmp_path / "stopped.log").read_text()
    (line,) = _allocations(stopped)
    assert (line["reason"], line["exit_code"]) == ("signal:SIGUSR1", EXIT_CONTINUE), log[-3000:]
    # torchrun reports its workers' status 75 as a failure of its own (the chain reads this line)
    assert log.count(f"exitcode  : {EXIT_CONTINUE}") >= 1 and proc.returncode != 0
    reached = line["last_step"]
    assert line["first_step"] == 1 and 2 <= reached < 6 and line["steps_gained"] == reached
    assert _latest(stopped) == f"iter_{reached:07d}"
    assert [r[0] for r in _losses(stopped)] == list(range(1, reached + 1))
    _finish(_launch(task, stopped, *STEPS), stopped)
    _same_run(straight(), stopped, tmp_path, f"stopped by SIGUSR1 after step {reached}")
    assert [(a["reason"], a["first_step"]) for a in _allocations(stopped)] == [
        ("signal:SIGUSR1", 1),
        ("done", reached + 1),
    ]


def test_a_planned_stop_keeps_the_one_step_off_rollout_in_flight(task, tmp_path, straight):
    """SIGUSR1 to rank 1 during step 3's update, while the producer generates step 4's batch
    with step 3's weights (tests/support/probed_train.py): the stop waits for that batch and
    keeps it, with its weights, in the checkpoint of step 3 (not a save_every step); the resumed
    run trains step 4 on it (staleness 1, as the uninterrupted run) and ends bit-identical.
    Dropping it instead would leave two choices, both worse: regenerate it with step 4's weights
    (another run: staleness 0 at step 4) or save step 3's weights to regenerate it, which is what
    keeping the finished batch costs, plus its generation again (docs/LAUNCHING.md)."""
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    env = {SIGNAL_VAR: "1:3"}
    proc = _launch(task, stopped, *STEPS, *ONE_STEP_OFF, module=PROBED, env=env)
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        _sigkill(proc)
        raise
    log = (tmp_path / "stopped.log").read_text()
    (line,) = _allocations(stopped)
    assert (line["reason"], line["exit_code"], line["last_step"]) == (
        "signal:SIGUSR1",
        EXIT_CONTINUE,
        3,
    ), log[-3000:]
    assert _latest(stopped) == "iter_0000003"
    _finish(_launch(task, stopped, *STEPS, *ONE_STEP_OFF), stopped, timeout=600)
    rows = [json.loads(x) for x in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert [r["async/staleness"] for r in rows] == [0, 1, 1, 1, 1, 1], rows
    _same_run(straight(*ONE_STEP_OFF), stopped, tmp_path, "one-step-off, stopped after step 3")


def _wait_for_row(proc: subprocess.Popen, run_dir: Path) -> None:
    """Until step 1's metrics row is written (the run is past start-up)."""
    deadline = time.time() + 600
    rows = run_dir / "metrics.jsonl"
    while not (rows.exists() and rows.read_text().endswith("\n")) and proc.poll() is None:
        if time.time() > deadline:
            _sigkill(proc)
            raise AssertionError("no metrics row after 600 s")
        time.sleep(0.05)


def _stopped_at(run_dir: Path, reason: str) -> int:
    """The step a planned stop saved, after checking its allocations line and ``latest``."""
    (line,) = _allocations(run_dir)
    assert (line["reason"], line["exit_code"]) == (reason, EXIT_CONTINUE), line
    assert _latest(run_dir) == f"iter_{line['last_step']:07d}"
    assert [r[0] for r in _losses(run_dir)] == list(range(1, line["last_step"] + 1))
    return line["last_step"]


@pytest.mark.slow  # the rendered scripts run plain torchrun; the workers' save is tested above
def test_a_signal_to_torchrun_saves_and_the_wrapper_exits_75(task, tmp_path):
    """SIGUSR1 to torchrun itself, as a user would send it (not to its workers): torchrun passes
    it on (launch/torchrun.py handles SIGUSR1), both workers save the step reached and exit 75,
    and ``python -m megatron_ngrpo.launch.torchrun`` exits 75 where torchrun says 1."""
    run = tmp_path / "run"
    run.mkdir()
    proc = _launch(task, run, "train.max_steps=4", launcher="megatron_ngrpo.launch.torchrun")
    _wait_for_row(proc, run)
    proc.send_signal(signal.SIGUSR1)
    try:
        code = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        _sigkill(proc)
        raise
    log = (tmp_path / "run.log").read_text()
    assert code == EXIT_CONTINUE, log[-3000:]
    assert 1 <= _stopped_at(run, "signal:SIGUSR1") < 4
    assert "torchrun: the workers stopped as planned (SignalException): exit 75" in log


def test_a_signal_to_a_plain_process_saves_the_step_reached(task, tmp_path):
    """SIGTERM to a plain ``python -m megatron_ngrpo.train`` (no torchrun): it saves the step it
    reached and exits 75."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_ngrpo.train", "--config", str(TINY)]
    cmd += ["--config", str(task / "paths.yaml"), f"train.run_dir={run}", "train.max_steps=4"]
    with open(tmp_path / "run.log", "w") as log:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    _wait_for_row(proc, run)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == EXIT_CONTINUE, (tmp_path / "run.log").read_text()[-3000:]
    assert 1 <= _stopped_at(run, "signal:SIGTERM") < 4


def _plain(task: Path, run_dir: Path, *overrides: str, env: dict | None = None):
    """``python -m megatron_ngrpo.train`` in one process (no torchrun): (status, its output)."""
    cmd = [sys.executable, "-m", "megatron_ngrpo.train", "--config", str(TINY)]
    cmd += ["--config", str(task / "paths.yaml"), f"train.run_dir={run_dir}", *overrides]
    done = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_deadline_saves_before_it_and_a_broken_latest_falls_back(task, tmp_path):
    """A job ending (SLURM_JOB_END_TIME) within the margin: the process saves the step it
    reached and exits 75 before the end. Then ``latest`` is broken (names a missing checkpoint):
    the next run says so in one line and resumes from the newest verified checkpoint, its
    metrics rows contiguous."""
    run = tmp_path / "run"
    end = time.time() + 3600
    code, out = _plain(
        task,
        run,
        "train.max_steps=2",
        "train.stop.margin_s=3600",
        env={"SLURM_JOB_END_TIME": str(int(end))},
    )
    assert code == EXIT_CONTINUE, out[-3000:]
    (line,) = _allocations(run)
    assert (line["reason"], line["last_step"]) == ("deadline", 1) and line["ended"] < end
    assert _latest(run) == "iter_0000001"
    (run / "latest").write_text("iter_0000009\n")
    code, out = _plain(task, run, "train.max_steps=2")
    assert code == 0, out[-3000:]
    warned = [ln for ln in out.splitlines() if "iter_0000009" in ln]
    assert len(warned) == 1 and "resuming from iter_0000001" in warned[0], out[-3000:]
    assert [r[0] for r in _losses(run)] == [1, 2] and _latest(run) == "iter_0000002"


# ---- colocated vLLM rollouts in multi-rank jobs -------------------------------------------------
@pytest.fixture(scope="module")
def vllm_task(tmp_path_factory) -> Path:
    """The arithmetic task with head_dim 32 (vLLM's CPU attention takes no smaller heads)."""
    from slurm_harness import write_arithmetic_task

    root = tmp_path_factory.mktemp("arith_vllm")
    write_arithmetic_task(root, hidden_size=128)
    return root


VLLM = ("rollout.engine=vllm", "rollout.vllm.max_model_len=64", "train.max_steps=3")


@pytest.mark.parametrize(
    "layout",
    [
        # vLLM TP = trainer TP; `slow`: test_vllm_engine syncs TP 2 engines under trainer TP 4
        pytest.param(
            ("model.tensor_parallel=2", "rollout.vllm.tensor_parallel=2"), marks=pytest.mark.slow
        ),
        ("model.tensor_parallel=1", "rollout.vllm.tensor_parallel=1"),  # DP 2: one engine per rank
    ],
    ids=["tp2", "dp2"],
)
def test_colocated_vllm_trains_with_mixing_and_resumes(vllm_task, tmp_path, layout):
    """2 ranks, one in-process vLLM worker each (external_launcher): ≥ 3 steps with mixing; the
    trainer's recomputed log-probs equal the engine's within 1e-5 (so the synced weights and the
    trainer's neighbour table are the ones vLLM used); at TP 2, a run killed after its first
    checkpoint resumes to the end (the engines' resume does not depend on the layout: DP 2 runs
    straight only)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir(), killed.mkdir()
    _finish(_launch(vllm_task, straight, *VLLM, *layout), straight)
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["logprob_gap/max_abs"] < 1e-5, r
        assert r["mixing/mixed_token_frac"] > 0, r
        assert (
            r["weight_sync/num_params"] > 0
            and r["weight_sync/bytes"] == 4 * r["weight_sync/num_params"]
        )
        assert r["weight_sync/table_seconds"] < 0.05  # the trainer's table is shipped, not rebuilt
    if "model.tensor_parallel=1" in layout:
        return

    proc = _launch(vllm_task, killed, *VLLM, *layout, "train.save_every=1")
    deadline = time.time() + 300
    while _latest(killed) is None and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    _sigkill(proc)
    assert _latest(killed) is not None, "no checkpoint before the kill"
    _finish(_launch(vllm_task, killed, *VLLM, *layout, "train.save_every=1"), killed)
    assert _latest(killed) == "iter_0000003"
    resumed = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert all(r["logprob_gap/max_abs"] < 1e-5 for r in resumed)
    # The killed job's vLLM TP shared-memory segments outlive it (their names are unique per job).
    for f in Path("/dev/shm").glob("ngrpo*-cpushm_*"):
        f.unlink(missing_ok=True)
