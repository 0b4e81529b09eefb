"""Tokenizers, offline: DeepSeek-R1-Distill-Qwen rebuilt from its parts, plain Qwen2, any HF dir.

The R1-Distill ``tokenizer.json`` is not available here, and its ``tokenizer_config.json`` names
``LlamaTokenizerFast``, so ``AutoTokenizer`` on that folder silently builds a broken 3-token
tokenizer. :func:`build_r1_distill_tokenizer` follows data/README.md's tested recipe
instead (Qwen2 byte-level BPE + the 22 added tokens + bos post-processor + the chat template).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.data.paths import find_data, searched

R1_DISTILL = "deepseek-r1-distill-qwen"
QWEN2 = "qwen2"

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Added after the 151,643 Qwen2 BPE tokens, in id order from 151643; True = special (dropped by
# skip_special_tokens).
R1_ADDED_TOKENS = (
    (EOS, True),
    ("<｜User｜>", False),
    ("<｜Assistant｜>", False),
    (BOS, True),
    ("<|EOT|>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
FIRST_ADDED_ID = 151643
# Any of these makes a folder a tokenizer folder (AutoTokenizer or the BPE-parts recipes).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
BOS_ID = 151646


def _byte_level_bpe(folder: Path, added: Sequence[tuple[str, bool]], first_added_id: int):
    """Qwen2's byte-level BPE (NFC, regex split, ByteLevel) from vocab.json + merges.txt, with
    ``added`` (content, special) tokens from ``first_added_id`` on."""
    # lazy: only this path needs the tokenizers library
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    model = models.BPE.from_file(
        str(folder / "vocab.json"), str(folder / "merges.txt"), unk_token=None, byte_fallback=False
    )
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # One at a time and in order: add_tokens/add_special_tokens assign ids sequentially.
    for content, special in added:
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    ids = [tok.token_to_id(c) for c, _ in added]
    if ids != list(range(first_added_id, first_added_id + len(added))):
        raise ValueError(
            f"{folder}: added tokens got ids {ids}; is vocab.json the 151,643-token Qwen2 one?"
        )
    return tok


def build_r1_distill_tokenizer(folder: str | Path):
    """The DeepSeek-R1-Distill-Qwen tokenizer from ``vocab.json`` + ``merges.txt`` +
    ``tokenizer_config.json`` (chat template) in ``folder``; 151,665 ids, bos prepended."""
    # lazy: only this path needs the tokenizers library
    from tokenizers import processors

    # lazy: transformers takes seconds to import; only this path needs it
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    tok = _byte_level_bpe(folder, R1_ADDED_TOKENS, FIRST_ADDED_ID)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=config.get("model_max_length", 16384),
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = config["chat_template"]
    return wrapped


def load_qwen2_tokenizer(folder: str | Path):
    """The plain Qwen2 tokenizer: the same BPE with the added tokens of its tokenizer_config
    (``<|endoftext|>`` = eos = pad, ``<|im_start|>``, ``<|im_end|>``), no bos. Built directly
    rather than by ``AutoTokenizer`` (same ids, without the slow vocabulary conversion). The
    shared copy's chat template was altered by its test fixture, so none is set: use the plain
    template with it (templates.py)."""
    # lazy: transformers takes seconds to import; only this path needs it
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    decoder = sorted(config["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))
    added = [(t["content"], bool(t.get("special", True))) for _, t in decoder]
    tok = _byte_level_bpe(folder, added, int(decoder[0][0]))
    eos = config.get("eos_token") or "<|endoftext|>"
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token=config.get("pad_token") or eos,
        model_max_length=config.get("model_max_length", 32768),
        clean_up_tokenization_spaces=False,
    )
    if "template ends here" not in (config.get("chat_template") or ""):
        wrapped.chat_template = config.get("chat_template")
    return wrapped


def _parts_kind(folder: Path) -> str | None:
    """ "r1" or "qwen2" for a folder of BPE parts without tokenizer.json, else None."""
    config_path = folder / "tokenizer_config.json"
    if (
        (folder / "tokenizer.json").is_file()
        or not (folder / "vocab.json").is_file()
        or not config_path.is_file()
    ):
        return None
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == "LlamaTokenizerFast" and BOS in json.dumps(
        config.get("bos_token"), ensure_ascii=False
    ):
        return "r1"
    return "qwen2" if config.get("tokenizer_class") == "Qwen2Tokenizer" else None


def tokenizer_folder(
    name_or_path: str | Path, model_path: str | Path | None = None, field: str = "tokenizer"
) -> Path:
    """The folder a tokenizer setting names: empty = the model folder's own tokenizer
    (``model_path``); ``deepseek-r1-distill-qwen`` / ``qwen2`` = the repository's data/tokenizers
    copies; else a folder. Raises a one-line :class:`ConfigError` naming ``field``, the value and
    where it was looked for."""
    name = str(name_or_path or "")
    if not name:
        folder = Path(model_path or "")
        if not model_path or not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(
                f"config field {field!r} = '': empty means the tokenizer of the model folder, "
                f"but {folder} has none of {', '.join(TOKENIZER_FILES)}; name a tokenizer "
                f"({R1_DISTILL}, {QWEN2}) or a folder"
            )
        return folder
    if name in (R1_DISTILL, QWEN2):
        folder = find_data(Path("tokenizers") / name)
        if folder is None:
            raise ConfigError(
                f"config field {field!r} = {name!r}: tokenizer folder not found "
                f"(looked in {searched(Path('tokenizers') / name)})"
            )
        return folder
    if not Path(name).is_dir():
        raise ConfigError(
            f"config field {field!r} = {name!r}: neither a known tokenizer name "
            f"({R1_DISTILL}, {QWEN2}) nor a folder (looked for {Path(name).resolve()})"
        )
    return Path(name)


def load_tokenizer(name_or_path: str | Path, model_path: str | Path | None = None):
    """A tokenizer by name or folder (:func:`tokenizer_folder`; empty = ``model_path``'s own).

    R1-Distill parts without ``tokenizer.json`` (the shipped copy, or a model folder carrying only
    those) are rebuilt by the recipe, the shipped Qwen2 parts likewise; anything else goes to
    ``AutoTokenizer`` (a full HF model or tokenizer folder, its chat template included).
    """
    folder = tokenizer_folder(name_or_path, model_path)
    kind = _parts_kind(folder)
    if kind == "r1":
        return build_r1_distill_tokenizer(folder)
    if kind == "qwen2":
        return load_qwen2_tokenizer(folder)
    # lazy: transformers takes seconds to import; only this path needs it
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def engine_tokenizer(tokenizer: str | Path | None, hf_path: str | Path):
    """The HF tokenizer a vLLM engine is given: of directory ``tokenizer``, else of ``hf_path``
    when it has tokenizer files, else None (token ids only). The in-process engine and the
    rollout server's launcher resolve it alike."""
    path = Path(tokenizer) if tokenizer is not None else Path(hf_path)
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
    if tokenizer is None and not any((path / f).is_file() for f in files):
        return None
    # lazy: transformers takes seconds to import; only this path needs it
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def special_token_ids(tokenizer) -> list[int]:
    """The one rule for ids that are never neighbours (``mixing.exclude_special``), used by the
    trainer's neighbour table and every engine: the tokenizer's special tokens and its added
    tokens flagged special."""
    if tokenizer is None:
        return []
    added = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return sorted(set(tokenizer.all_special_ids) | added)
