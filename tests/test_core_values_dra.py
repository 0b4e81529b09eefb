"""grpo/dra.py by value against float64 references, single-process (the mutation score's fast
tests, bench/results/mutation_score.md). DRA's ``policy_hidden`` embedder
(:class:`ResponseHiddenMeans`, mean-pooled hidden states): its forward pre-hook fed through a
stand-in output layer (sequence parallelism and pipeline stages emulated, collectives replaced by
fakes that play the other ranks) and its pass of its own on a tiny megatron model (the
multi-process layouts run in tests/test_dra.py). Then the cosine similarity of unnormalised rows
and the local sentence embedder's default cut, one-token texts and empty input."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.grpo.batches import MicroBatchPlan, TokenBatch
from megatron_ngrpo.grpo.dra import LocalModelEmbedder, ResponseHiddenMeans, similarity
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.models.provider import build_model
from megatron_ngrpo.rollout.types import RolloutBatch
from tests.harness.tiny import write_tiny_bert, write_tiny_hf

HIDDEN = 8
# Seven responses (one of a single token) after prompts of 1..4 tokens: rows of 3..9 tokens.
PROMPTS = [[3, 4], [5], [6, 7, 8], [9, 10, 11, 12], [13], [14, 15], [16, 17, 18]]
RESPONSES = [[20, 21, 22], [23], [24, 25, 26, 27, 28], [29, 30], [31, 32, 33, 34], [35], [36, 37]]


def _batch() -> TokenBatch:
    n = len(PROMPTS)
    return TokenBatch.from_rollout(
        RolloutBatch(
            PROMPTS,
            RESPONSES,
            [[0.0] * len(r) for r in RESPONSES],
            ["stop"] * n,
            MixRecord.empty(n, 1),
            list(range(n)),
        )
    )


def _reference(hidden: torch.Tensor, tb: TokenBatch) -> torch.Tensor:
    """[B, h] float64 mean of each row's response columns of ``hidden`` [B, L, h]."""
    return torch.stack(
        [
            hidden[r, int(o) : int(n)].double().mean(0)
            for r, (o, n) in enumerate(zip(tb.offsets, tb.lengths))
        ]
    )


def _chunk(output_layer: bool = True, sequence_parallel: bool = False, cp: int = 1):
    """A stand-in model chunk: the config fields the class reads, and an output layer (the last
    stage's) whose forward pre-hook is what a real one would see."""
    config = SimpleNamespace(
        hidden_size=HIDDEN,
        sequence_parallel=sequence_parallel,
        tensor_model_parallel_size=2 if sequence_parallel else 1,
        context_parallel_size=cp,
    )
    chunk = SimpleNamespace(config=config)
    if output_layer:
        chunk.output_layer = torch.nn.Identity()
    return chunk


def _replay(chunks, tb, hidden, micro_batch_size, max_tokens=0, local=None):
    """A stand-in replay pass: each micro-batch of ``MicroBatchPlan.make`` (cut independently of
    the class's own plan) sends its rows of ``hidden`` [B, L, h] as [s, b, h] (``local``: this
    rank's share) through the last chunk's output layer; dummy rows are garbage."""
    plan = MicroBatchPlan.make(chunks, tb, micro_batch_size, max_tokens)
    g = torch.Generator().manual_seed(1)
    for rows, mb in zip(plan.groups, plan.micro_batches(tb)):
        x = torch.randn(mb.num_rows, mb.seq_len, HIDDEN, generator=g)
        x[: len(rows)] = hidden[rows, : mb.seq_len]
        x = x.transpose(0, 1)
        chunks[-1].output_layer(local(x) if local else x)


class _SequenceHalves:
    """TP rank 0 of 2 under sequence parallelism: the output layer's input is the first half of
    the sequence; the fake gather appends the half rank 1 holds of the same micro-batch."""

    def local(self, hidden: torch.Tensor) -> torch.Tensor:
        first, self.second = hidden.chunk(2)
        return first

    def gather(self, input_, tensor_parallel_output_grad=True, **kwargs):
        return torch.cat([input_, self.second])


@pytest.mark.parametrize(
    "micro_batch_size,max_tokens,sequence_parallel",
    [(3, 0, False), (2, 12, False), (3, 0, True)],
    ids=["consecutive", "token_budget", "sequence_parallel"],
)
def test_hook_pools_each_response_of_the_replay(
    single_rank, monkeypatch, micro_batch_size, max_tokens, sequence_parallel
):
    """The means of the replay's micro-batches, each row's response columns only, equal the
    float64 reference; a context left without a pass leaves no hook behind, and passes beyond the
    plan's (a second pass inside the context, a later context) are ignored. Under sequence
    parallelism the hook sees the first half of the sequence (TP rank 0 of 2) and gathers it (a
    fake gather appends the other rank's half)."""
    tb = _batch()
    # One column more than the longest row: sequence parallelism rounds lengths up to even.
    full = torch.randn(
        tb.num_rows, tb.seq_len + 1, HIDDEN, generator=torch.Generator().manual_seed(0)
    )
    want = _reference(full, tb)
    chunks = [_chunk(sequence_parallel=sequence_parallel)]
    local = None
    if sequence_parallel:
        tp = _SequenceHalves()
        local = tp.local
        monkeypatch.setattr(tensor_parallel, "gather_from_sequence_parallel_region", tp.gather)
    # The constructor's default max_tokens is 0 (consecutive rows).
    kwargs = {"max_tokens": max_tokens} if max_tokens else {}
    hm = ResponseHiddenMeans(chunks, tb, micro_batch_size, **kwargs)
    with hm:
        pass
    _replay(chunks, tb, -full, micro_batch_size, max_tokens, local)  # outside: not captured
    with hm:
        _replay(chunks, tb, full, micro_batch_size, max_tokens, local)
        _replay(chunks, tb, -full, 1, 0, local)
    with hm:
        _replay(chunks, tb, -full, micro_batch_size, max_tokens, local)
    got = hm.means()  # captured: no pass of its own (the stand-in could not run one)
    assert got.shape == (tb.num_rows, HIDDEN) and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-6)


def test_context_parallelism_is_refused():
    with pytest.raises(
        NotImplementedError,
        match=r"^grpo\.dra\.embedder = policy_hidden: context parallelism is not supported$",
    ):
        ResponseHiddenMeans([_chunk(cp=2)], _batch(), 2)


@pytest.mark.parametrize("last", [True, False], ids=["last_stage", "first_stage"])
def test_pipeline_stages_return_the_last_stage_means(single_rank, monkeypatch, last):
    """Interleaved PP (2 stages × 3 virtual chunks, megatron's own overrides of the pipeline rank
    and sizes): the last stage captures through its last chunk (fixed micro-batch shapes with
    dummy rows, and a fully dummy micro-batch padding the count to a multiple of PP) and
    broadcasts whether it captured, then the means, from the last stage's global rank over the
    pipeline group; the first stage (no output layer) returns what it receives. The fake
    broadcasts play the other stage."""
    tb = _batch()
    full = torch.randn(tb.num_rows, tb.seq_len, HIDDEN, generator=torch.Generator().manual_seed(0))
    want = _reference(full, tb)
    for name, value in [
        ("_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", 2),
        ("_MPU_PIPELINE_MODEL_PARALLEL_RANK", 1 if last else 0),
        ("_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", 3),
        ("_PIPELINE_GLOBAL_RANKS", [4, 5]),
    ]:
        monkeypatch.setattr(ps, name, value)
    pp_group, sent = ps.get_pipeline_model_parallel_group(), []

    def broadcast_object_list(object_list, src=None, group=None, **kwargs):
        assert src == 5 and group is pp_group
        sent.append(list(object_list))
        if not last:
            object_list[0] = True

    def broadcast(tensor, src=None, group=None, **kwargs):
        assert src == 5 and group is pp_group
        sent.append(tensor.clone())
        if not last:
            tensor.copy_(want)

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    chunks = [_chunk(output_layer=False), _chunk(output_layer=False), _chunk(output_layer=last)]
    hm = ResponseHiddenMeans(chunks, tb, 3)
    assert len(hm.plan.groups) == 4 and hm.plan.fixed_shape == (3, tb.seq_len)
    with hm:
        if last:
            _replay(chunks, tb, full, 3)
    got = hm.means()
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-6)
    assert len(sent) == 2 and sent[0] == [last]


def test_means_without_a_replay_run_a_pass_of_their_own(single_rank, tmp_path):
    """Nothing captured: :meth:`means` runs a forward-only pass of its own over a tiny megatron
    model (micro-batches of 3 padded rows); the result equals the same model's output-layer input
    in float64, one unpadded sequence at a time, mean-pooled over the response tokens."""
    hf = write_tiny_hf(
        tmp_path / "hf",
        weights=False,
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
    )
    chunks = build_model(ModelConfig(hf_path=str(hf), make_vocab_size_divisible_by=8))
    tb = _batch()
    got = ResponseHiddenMeans(chunks, tb, 3).means()
    model = unwrap(chunks[0]).double()
    seen = []
    model.output_layer.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    want = []
    with torch.no_grad():
        for prompt, response in zip(PROMPTS, RESPONSES):
            tokens = torch.tensor([prompt + response])
            positions = torch.arange(tokens.shape[1])[None]
            model(input_ids=tokens, position_ids=positions, attention_mask=None)
            want.append(seen.pop()[len(prompt) :, 0].mean(0))  # [s, 1, h]: response columns
    assert got.shape == (len(PROMPTS), 32) and got.dtype == torch.float32
    assert torch.allclose(got.double(), torch.stack(want), rtol=0, atol=1e-5)


def test_similarity_is_the_cosine_of_unnormalised_rows():
    """Rows of different norms (the TF-IDF embedder's are unit rows; the function takes any),
    sparse and dense: s_ij = e_i·e_j / (|e_i| |e_j|) by a float64 reference, 0 for a zero row."""
    rows = [[3.0, 0.0, 4.0, 0.0], [0.0, 2.0, 1.0, 0.0], [0.0] * 4, [1.0, -1.0, 0.0, 5.0]]
    norms = [math.sqrt(sum(x * x for x in r)) for r in rows]
    want = torch.tensor(
        [
            [
                sum(x * y for x, y in zip(a, b)) / (na * nb) if na and nb else 0.0
                for b, nb in zip(rows, norms)
            ]
            for a, na in zip(rows, norms)
        ],
        dtype=torch.float64,
    )
    e = torch.tensor(rows, dtype=torch.float64)
    for emb in (e.to_sparse(), e):
        assert torch.allclose(similarity(emb), want, rtol=1e-12, atol=1e-15)


def test_local_model_embedder_cuts_at_512_pools_one_token_and_takes_no_texts(tmp_path):
    """The local embedder's default of 512 tokens per text (a text of 600 words is cut there); a
    text of one token (a tokenizer adding no special tokens) pools to that token's hidden state;
    no texts give [0, h]. References: the float64 model, one text at a time."""
    emb = LocalModelEmbedder(str(write_tiny_bert(tmp_path / "bert", max_positions=520)))
    tokenizer, long_text = emb.tokenizer, " ".join(["a", "b", "c"] * 200)
    cut = emb([long_text])
    emb.tokenizer = functools.partial(tokenizer, add_special_tokens=False)
    one = emb(["four"])
    none = emb([])
    assert none.shape == (0, 32) and none.dtype == torch.float32
    model64 = emb.model.double()
    with torch.no_grad():
        enc = tokenizer(long_text, truncation=True, max_length=512, return_tensors="pt")
        assert enc["input_ids"].shape == (1, 512)
        want_cut = model64(**enc).last_hidden_state[0].mean(0)
        enc = tokenizer("four", add_special_tokens=False, return_tensors="pt")
        assert enc["input_ids"].shape == (1, 1)
        want_one = model64(**enc).last_hidden_state[0, 0]
    assert torch.allclose(cut[0].double(), want_cut, rtol=0, atol=1e-5)
    assert torch.allclose(one[0].double(), want_one, rtol=0, atol=1e-5)
