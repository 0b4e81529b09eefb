"""Parity on the real pretrained SmolLM2-135M-Instruct (tests/test_real_model.py; issue 27 item 3).

The HF folder is ``$NGRPO_REAL_MODEL``; outputs go under ``$NGRPO_REAL_OUT``. 3 ranks run the TP 1 /
TP 3 cases, 2 ranks the PP 2 one (``--only``). References are float64 (transformers in double, a
brute-force similarity matrix).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_ngrpo.architecture import ArchSpec, unwrap
from megatron_ngrpo.conversion.convert import (
    convert_hf_to_megatron,
    convert_megatron_to_hf,
    current_layout,
)
from megatron_ngrpo.conversion.hf_io import HFCheckpoint, load_hf_into_megatron
from megatron_ngrpo.data.tokenizer import load_tokenizer, special_token_ids
from megatron_ngrpo.grpo.logprobs import TokenBatch, token_logprobs
from megatron_ngrpo.grpo.update import update_step, wrap_for_training
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.embedding import mixing_embedding
from megatron_ngrpo.mixing.neighbors import build_neighbor_table, exclusion_mask
from megatron_ngrpo.mixing.records import MixRecord
from megatron_ngrpo.models.config import ModelConfig
from megatron_ngrpo.models.provider import build_model
from megatron_ngrpo.parallel import initialize_model_parallel
from megatron_ngrpo.rollout.types import RolloutBatch
from megatron_ngrpo.training.warmstart import TokenWeights
from tests.harness.forward import megatron_logits
from tests.harness.multiproc import case, run_cases
from tests.harness.real_model import SENTENCES
from tests.harness.reference import neighbor_table64
from tests.harness.tiny import write_tiny_hf

MODEL = Path(os.environ.get("NGRPO_REAL_MODEL", ""))
OUT = Path(os.environ.get("NGRPO_REAL_OUT", "/tmp/ngrpo_real"))
# Query rows of the neighbour table checked against brute force: frequent words, digits, rare
# merges and the special tokens at the start (the full 49,152-row float64 reference is minutes).
QUERY_ROWS = ((0, 128), (20_000, 20_128), (49_024, 49_152))
_REF: dict[str, torch.Tensor] = {}


@functools.cache
def tokenizer():
    return load_tokenizer(MODEL)


@functools.cache
def tokens() -> torch.Tensor:
    """[2, L]: the two real sentences, cut to the shorter one's length."""
    ids = [tokenizer()(s).input_ids for s in SENTENCES]
    n = min(map(len, ids))
    return torch.tensor([i[:n] for i in ids])


def hf_logits(dtype: torch.dtype) -> torch.Tensor:
    """transformers' logits of :func:`tokens` in ``dtype`` (cached; rank 0 only)."""
    key = str(dtype)
    if key not in _REF:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype).eval()
        with torch.no_grad():
            _REF[key] = model(tokens()).logits.double()
        del model
    return _REF[key]


def build(tp: int, pp: int) -> list:
    if current_layout() != (tp, pp, None):
        initialize_model_parallel(tp, pp, None, seed=1234)
    cfg = ModelConfig(
        hf_path=str(MODEL),
        tensor_parallel=tp,
        pipeline_parallel=pp,
        dtype="float32",
        layer_spec="local",
    )
    chunks = build_model(cfg, init_weights=False)
    with torch.no_grad():
        load_hf_into_megatron(chunks, MODEL)
    return chunks


def _logits_case(tp: int, pp: int):
    def fn():
        """Max |logit − float64 transformers| of Megatron fp32 and of transformers fp32; argmax
        agreement; the last stage's copy of the tied matrix equals the first stage's."""
        chunks = build(tp, pp)
        got = megatron_logits(chunks, tokens())
        out = None
        if (
            pp > 1
        ):  # tied: the last stage holds a copy of the embedding (megatron's embedding group)
            inner = unwrap(chunks[0])
            w = (
                (
                    mixing_embedding(chunks[0]).weight
                    if inner.pre_process
                    else inner.shared_embedding_or_output_weight()
                )
                .detach()
                .clone()
            )
            group = ps.get_embedding_group()
            peers = [torch.empty_like(w) for _ in range(dist.get_world_size(group))]
            dist.all_gather(peers, w, group=group)
            other = peers[1 - ps.get_pipeline_model_parallel_rank()]
            assert inner.share_embeddings_and_output_weights and torch.equal(w, other)
        first_last = (
            ps.is_pipeline_last_stage()
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0
        )
        if first_last:
            vocab = ArchSpec.from_hf(MODEL).vocab_size
            ref = hf_logits(torch.float64)
            err = (got[..., :vocab].double() - ref).abs().max().item()
            hf_err = (hf_logits(torch.float32) - ref).abs().max().item()
            agree = (got[..., :vocab].argmax(-1) == ref.argmax(-1)).float().mean().item()
            assert (got[..., vocab:] == 0).all() if got.shape[-1] > vocab else True
            # fp32 rounding over 30 layers in another summation order (TP partial sums, fused
            # QKV / gate-up GEMMs): the same size as transformers' own fp32 error, not 1e-6.
            assert err <= 4 * hf_err + 1e-5 and agree == 1.0, (err, hf_err, agree)
            out = {
                "megatron_fp32_err": err,
                "hf_fp32_err": hf_err,
                "max_abs_logit": ref.abs().max().item(),
                "argmax_agreement": agree,
                "tokens": int(tokens().numel()),
            }
        box = [out]
        dist.broadcast_object_list(box, src=dist.get_world_size() - 1 if pp > 1 else 0)
        return box[0]

    fn.__name__ = f"logits_tp{tp}pp{pp}"
    return case(fn)


_logits_case(1, 1)
_logits_case(3, 1)
_logits_case(1, 2)


@case
def roundtrip_tp3():
    """HF → Megatron checkpoint (TP 3) → HF: every tensor bit-identical, config and tokenizer too."""
    mdir, hdir = OUT / "rt_megatron", OUT / "rt_hf"
    if dist.get_rank() == 0:
        shutil.rmtree(mdir, ignore_errors=True)
        shutil.rmtree(hdir, ignore_errors=True)
    dist.barrier()
    convert_hf_to_megatron(MODEL, mdir, tp=3, progress=False)
    convert_megatron_to_hf(mdir, hdir, tp=3, progress=False)
    if dist.get_rank() == 0:
        got, want = HFCheckpoint(hdir), HFCheckpoint(MODEL)
        assert set(got) == set(want)
        bad = [n for n in want if not torch.equal(got[n], want[n])]
        assert not bad, bad
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            assert (hdir / name).read_bytes() == (MODEL / name).read_bytes(), name
        import json

        assert json.loads((hdir / "config.json").read_text()) == json.loads(
            (MODEL / "config.json").read_text()
        )
        shutil.rmtree(mdir)
        shutil.rmtree(hdir)
    dist.barrier()
    return len(HFCheckpoint(MODEL))


def _neighbors_case(tp: int):
    def fn():
        """Sharded cosine table rows (k = 8, special tokens excluded) = float64 brute force.
        Ties: counted as rows whose (k-1)-th and k-th allowed neighbours' float64 scores are equal
        (the table then takes the lower id, as the reference does)."""
        chunks = build(tp, 1)
        emb = mixing_embedding(chunks[0])
        cfg = MixingConfig(k=8, metric="cosine")
        num_real = len(tokenizer())
        vocab = unwrap(chunks[0]).vocab_size
        exclude = exclusion_mask(vocab, cfg, num_real, special_token_ids(tokenizer()))
        # tied: the output layer is the same matrix, so either neighbour source gives this table
        assert unwrap(chunks[0]).shared_embedding_or_output_weight() is emb.weight
        full = None
        if dist.get_rank() == 0:
            full = HFCheckpoint(MODEL)["model.embed_tokens.weight"]
        ties, rows_checked = 0, 0
        for rows in QUERY_ROWS:
            got = build_neighbor_table(
                emb.weight,
                emb.vocab_start_index,
                cfg.k,
                "cosine",
                exclude,
                tp_group=ps.get_tensor_model_parallel_group(),
                dp_group=ps.get_data_parallel_group(),
                rows=rows,
            )
            if full is not None:
                ex = exclude[: full.shape[0]]
                want = neighbor_table64(full, cfg.k, "cosine", ex, rows=range(*rows))
                assert torch.equal(got, want), (
                    rows,
                    (got != want).any(1).nonzero()[:5].flatten().tolist(),
                )
                w = full.double()
                w = w / torch.linalg.vector_norm(w, dim=-1, keepdim=True)
                s = w[rows[0] : rows[1]] @ w.T
                s[:, ex] = -float("inf")
                s[torch.arange(len(s)), torch.arange(*rows)] = -float("inf")
                top = s.topk(cfg.k, dim=1).values  # the k-1 neighbours and the next one
                ties += int((top[:, -1] == top[:, -2]).sum())
                rows_checked += len(s)
        return {"rows": rows_checked, "ties_at_kth": ties} if full is not None else None

    fn.__name__ = f"neighbors_tp{tp}"
    return case(fn)


_neighbors_case(3)


# ---- the one tied matrix's gradient (tiny tied Llama: a float64 reference is cheap) ---------------
TINY_VOCAB = 200  # padded to 256 rows: padded rows must get no gradient
TIED_BATCH = RolloutBatch(
    prompt_ids=[[5, 17, 33], [8, 9]],
    response_ids=[[40, 41, 42, 43, 44], [50, 51, 52, 53]],
    logprobs=[[0.0] * 5, [0.0] * 4],
    finish_reasons=["length"] * 2,
    prompt_index=[0, 1],
    mixes=MixRecord(
        seq=torch.tensor([0, 0, 1]),
        pos=torch.tensor([0, 2, 1]),
        ids=torch.tensor([[40, 7, 9], [42, 100, 199], [51, 3, 150]]),
        weights=torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.25, 0.15], [0.4, 0.4, 0.2]]),
        num_seqs=2,
    ),
)


def tied_reference(path: Path, coef: list[torch.Tensor]) -> torch.Tensor:
    """d/dE of Σ coef·log p(response token) in float64 transformers, the mixes as inputs_embeds:
    the tied matrix's gradient from both uses (input rows incl. mixture rows, output layer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    emb_w = model.get_input_embeddings().weight
    assert emb_w is model.get_output_embeddings().weight
    loss = 0.0
    b, m = TIED_BATCH, TIED_BATCH.mixes
    for r in range(len(b)):
        plen, tokens = len(b.prompt_ids[r]), torch.tensor(b.prompt_ids[r] + b.response_ids[r])
        rows = [emb_w[t] for t in tokens]
        for j in torch.nonzero(m.seq == r).flatten().tolist():
            rows[plen + int(m.pos[j])] = (
                m.weights[j].double().unsqueeze(-1) * emb_w[m.ids[j]]
            ).sum(0)
        logits = model(inputs_embeds=torch.stack(rows)[None]).logits[0, plen - 1 : -1]
        lp = torch.log_softmax(logits, -1).gather(1, tokens[plen:, None]).squeeze(1)
        loss = loss + (coef[r].double() * lp).sum()
    loss.backward()
    return emb_w.grad


def _tied_grad_case(tp: int, pp: int):
    def fn():
        """Megatron's gradient of the tied matrix (mixing embedding on the first stage, output
        layer on the last: at PP 2 two copies, summed by megatron's embedding-group all-reduce)
        = the float64 reference within 1e-5 of its largest entry; zero on padded rows; both
        copies' gradients equal."""
        path = OUT / "tiny_tied_llama"
        if dist.get_rank() == 0 and not (path / "config.json").is_file():
            write_tiny_hf(path, "llama", vocab_size=TINY_VOCAB, tied=True, num_layers=2, seed=9)
        dist.barrier()
        initialize_model_parallel(tp, pp, None, seed=1234)
        cfg = ModelConfig(
            hf_path=str(path),
            tensor_parallel=tp,
            pipeline_parallel=pp,
            dtype="float32",
            layer_spec="local",
            make_vocab_size_divisible_by=64,
        )
        chunks = build_model(cfg, init_weights=False)
        with torch.no_grad():
            load_hf_into_megatron(chunks, path)
        chunks = wrap_for_training(chunks)
        tb = TokenBatch.from_rollout(TIED_BATCH)
        coef = [torch.linspace(-1.0, 1.5, len(r)) for r in TIED_BATCH.response_ids]

        def loss_fn(mb, logits):
            lp, _ = token_logprobs(logits, mb.labels, 1.0, TINY_VOCAB)
            return (lp * mb.inputs.token_weight).sum(), torch.zeros((), dtype=torch.int), {}

        update_step(
            chunks,
            tb.with_inputs(TokenWeights(tb.label_aligned(coef))),
            loss_fn,
            micro_batch_size=2,
        )
        inner = unwrap(chunks[0])
        w = (
            mixing_embedding(chunks[0]).weight
            if inner.pre_process
            else inner.shared_embedding_or_output_weight()
        )
        tp_group = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(w.main_grad) for _ in range(tp)]
        dist.all_gather(parts, w.main_grad.contiguous(), group=tp_group)
        grad = torch.cat(parts)
        grads = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(grads, grad)
        out = None
        if dist.get_rank() == 0:
            assert all(torch.equal(g, grads[0]) for g in grads), (
                "the copies' / TP ranks' gradients differ"
            )
            ref = tied_reference(path, coef)
            scale = ref.abs().max().item()
            err = (grad[:TINY_VOCAB].double() - ref).abs().max().item() / scale
            assert err < 1e-5 and not grad[TINY_VOCAB:].any(), (err, grad[TINY_VOCAB:].abs().max())
            out = {"rel_err": err, "mixture_rows_nonzero": bool(ref[[7, 100, 3]].abs().sum() > 0)}
        return out

    fn.__name__ = f"tied_grad_tp{tp}pp{pp}"
    return case(fn)


_tied_grad_case(2, 1)
_tied_grad_case(1, 2)


@case
def special_anchors_tp1pp2():
    """One real-model rollout at PP 2 on the built-in engine, every step gated (ρ = 1, on-demand
    rows): with ``mixing.skip_special_anchors`` (the default) no mixed position has a special
    anchor; without it the end-of-turn token is mixed like any anchor (issue 37 item 5)."""
    from megatron_ngrpo.rollout.factory import tokenizer_kwargs
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine
    from megatron_ngrpo.rollout.types import SamplingParams

    chunks, tok = build(1, 2), tokenizer()
    engine = MegatronEngine(chunks, len(tok), **tokenizer_kwargs(tok))
    questions = ("What is 2 + 3?", "Name a colour.", "Say hi.", "What is 10 - 4?")
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    params = SamplingParams(
        n=1, temperature=0.7, max_new_tokens=24, seed=1, stop_token_ids=[tok.eos_token_id]
    )
    special = set(special_token_ids(tok))
    anchors = {}
    for skip in (False, True):
        mixing = MixingConfig(rate=1.0, k=3, neighbor_lookup="on_demand", skip_special_anchors=skip)
        batch = engine.generate(prompts, params, mixing)
        anchors[skip] = batch.mixes.ids[:, 0].tolist()
        assert len(anchors[skip]) > 0
    mixed_special = [tok.convert_ids_to_tokens(a) for a in anchors[False] if a in special]
    assert mixed_special, "no special anchor met: the rollout cannot tell the option apart"
    assert not special & set(anchors[True]), anchors[True]
    return {"special_mixed_without_skip": mixed_special}


if __name__ == "__main__":
    run_cases()
