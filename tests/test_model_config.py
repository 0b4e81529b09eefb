"""models/config.py: ``num_real_tokens`` defaults to the tokenizer's id count (the real Qwen2 and
R1-Distill tokenizers leave 290 / 271 of Qwen2's 151,936 rows unmapped: never sampled, anchors or
neighbours), an explicit value overrides it, and a value beyond the vocabulary is a one-line error."""

from __future__ import annotations

import pytest

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.data import load_tokenizer
from megatron_ngrpo.models.config import ModelConfig, real_token_count, tokenizer_id_count
from tests.harness.tiny import write_tiny_hf

QWEN2_ROWS = 151936


@pytest.mark.parametrize("name,ids", [("qwen2", 151646), ("deepseek-r1-distill-qwen", 151665)])
def test_num_real_tokens_defaults_to_the_tokenizer(shared_data, name, ids):
    tok = load_tokenizer(name)
    assert tokenizer_id_count(tok) == len(tok) == ids
    assert real_token_count(None, QWEN2_ROWS, tok) == ids
    assert real_token_count(151700, QWEN2_ROWS, tok) == 151700  # explicit override
    assert real_token_count(None, QWEN2_ROWS) == QWEN2_ROWS  # no tokenizer: the HF rows
    with pytest.raises(
        ConfigError, match=f"has {ids} token ids, more than the model's vocab_size = 1000"
    ):
        real_token_count(None, 1000, tok)


def test_num_real_tokens_beyond_the_vocabulary_is_refused(tmp_path):
    hf = write_tiny_hf(tmp_path / "hf", weights=False, vocab_size=300)
    ModelConfig(hf_path=str(hf), num_real_tokens=300).validate()
    for bad in (301, 0):
        with pytest.raises(
            ConfigError, match=rf"'num_real_tokens' = {bad}: must be in \[1, vocab_size = 300\]"
        ):
            ModelConfig(hf_path=str(hf), num_real_tokens=bad).validate()
