"""Prompt templates (N-GRPO paper App. A; docs/ALGORITHM.md §8).

User message = problem, a space, the instruction; no system prompt. Kinds:

- ``r1``: the DeepSeek-R1-Distill chat template (``apply_chat_template(...,
  add_generation_prompt=True)``) followed by the thinking opener. ``think = "force"`` (default)
  makes the prompt end in ``<｜Assistant｜><think>\\n``, as the later revision of the template on
  the model hub does, as DeepSeek recommends, and as the paper's App. A shows (``<think>``
  appended "consistent with the model's default settings"). ``think = "original"`` keeps the
  early-2025 revision in data/tokenizers (prompt ends at ``<｜Assistant｜>``; the model usually opens
  ``<think>`` itself, but may skip thinking).
- ``chat``: the tokenizer's own chat template, unchanged (instruct models other than R1).
- ``plain``: no chat template: the message and a newline (base models without one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Training prompts (reference data preprocessing: no trailing period).
TRAIN_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}"
# AIME24/25, AMC23, MATH500 evaluation prompts: the same with a trailing period.
EVAL_INSTRUCTION = TRAIN_INSTRUCTION + "."
# GPQA-style multiple choice: question, blank line, this.
MCQ_INSTRUCTION = (
    "Let's think step by step and output the final answer in the last line as:\nAnswer: <A/B/C/D>"
)
THINK_OPENER = "<think>\n"


@dataclass
class TemplateConfig:
    kind: Literal["r1", "chat", "plain"] = "r1"
    # r1 only: "force" (prompt ends in <think>\n, default, see module doc) or "original".
    think: Literal["force", "original"] = "force"
    # None = the default for the use: TRAIN_INSTRUCTION in training, EVAL_INSTRUCTION in eval
    # (MCQ_INSTRUCTION for multiple choice); "" = no instruction.
    instruction: str | None = None

    def instruction_or(self, default: str) -> str:
        """The instruction to append: the configured one ("" = none), else ``default``."""
        return self.instruction if self.instruction is not None else default


def math_message(problem: str, instruction: str) -> str:
    return f"{problem} {instruction}" if instruction else problem


def mcq_message(
    question: str, choices: list[str] | None = None, instruction: str = MCQ_INSTRUCTION
) -> str:
    """GPQA layout: question (with its lettered choices appended when given), blank line,
    instruction."""
    if choices:
        question = question + "\n" + "\n".join(f"{chr(65 + i)}) {c}" for i, c in enumerate(choices))
    return f"{question}\n\n{instruction}" if instruction else question


def render(message: str, tokenizer, cfg: TemplateConfig) -> str:
    """The full prompt text for one user message."""
    if cfg.kind == "plain":
        return message + "\n"
    if tokenizer.chat_template is None:
        raise ValueError(
            f"template kind {cfg.kind!r} needs a tokenizer with a chat template; "
            f"use kind 'plain' for this tokenizer"
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    if cfg.kind == "r1" and cfg.think == "force" and not text.endswith(THINK_OPENER):
        text += THINK_OPENER
    return text


def encode_prompt(message: str, tokenizer, cfg: TemplateConfig) -> list[int]:
    """Token ids of the rendered prompt. Chat templates write bos themselves, so no special
    tokens are added again; ``plain`` lets the tokenizer add its own (bos for R1-Distill)."""
    text = render(message, tokenizer, cfg)
    return list(tokenizer(text, add_special_tokens=cfg.kind == "plain").input_ids)
