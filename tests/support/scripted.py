"""A rollout engine that answers each prompt with fixed texts: the test double of the evaluation
metrics path (the grades of its responses are known). It records every call."""

from __future__ import annotations

from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.rollout.types import RolloutBatch, RolloutEngine


class ScriptedEngine(RolloutEngine):
    """``script``: prompt token ids (tuple) → response texts (sample j = text j)."""

    def __init__(self, tokenizer, script: dict[tuple, list[str]]):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def sync_weights(self, model_chunks) -> None:
        pass  # scripted texts: no weights

    def set_neighbor_table(self, table) -> None:
        raise AssertionError("evaluation never mixes")

    def generate(self, prompts, params, mixing=None, keys=None):
        self.calls.append({"n": len(prompts), "keys": keys, "mixing": mixing, "params": params})
        responses, prompt_ids, index = [], [], []
        for i, p in enumerate(prompts):
            for text in self.script[tuple(p)][: params.n]:
                ids = self.tokenizer(text, add_special_tokens=False).input_ids + [
                    self.tokenizer.eos_token_id
                ]
                responses.append(ids)
                prompt_ids.append(list(p))
                index.append(i)
        return RolloutBatch(
            prompt_ids,
            responses,
            [[0.0] * len(r) for r in responses],
            ["stop"] * len(responses),
            MixRecord.empty(len(responses), 1),
            index,
        )
