"""Cases of the built-in Megatron rollout engine, run under one 4-process torchrun launch.

One tiny random Qwen2 (GQA, padded vocabulary, fp32) is initialised once at TP=1, saved with
megatron's dist_checkpointing and loaded at every layout (TP=1, 2, 4, PP=2, TP2×PP2), so every
layout holds the same weights. References are independent of the engine: full (non-cached)
forwards through megatron's forward-only pipeline schedule, and the trainer's
``tests.support.replay.sequence_logprobs``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness.multiproc import case, run_cases
from tests.harness.records import sequence_mixes
from tests.harness.tiny import tiny_checkpoint

VOCAB, NUM_REAL, K = 500, 480, 3
LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [300, 12], [77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87], [401]]
_STATE: dict = {}


def decode(ids) -> str:
    """A 4-letter 'tokenizer', so stop texts occur often in random generations."""
    return "".join("abcd"[int(i) % 4] for i in ids)


# ---- set-up ---------------------------------------------------------------------------------
def _model_cfg(tp: int, pp: int, vpp: int | None = None, attention: str = "sdpa"):
    from megatron_ngrpo.models.config import ModelConfig

    return ModelConfig(
        hf_path=_STATE["hf"],
        tensor_parallel=tp,
        pipeline_parallel=pp,
        virtual_pipeline=vpp,
        dtype="float32",
        num_real_tokens=NUM_REAL,
        attention=attention,
    )


def _checkpoint() -> str:
    """The TP=1 weights as a megatron distributed checkpoint (written once)."""
    return tiny_checkpoint(_STATE, "megatron_engine_", VOCAB, lambda: _model_cfg(1, 1))


def layout(tp: int, pp: int, vpp: int | None = None, attention: str = "sdpa") -> list:
    """Model chunks of this rank at (tp, pp[, vpp]), all layouts with the same weights (cached);
    ``attention``: the local spec's core attention (models/attention.py)."""
    if _STATE.get("layout") == (tp, pp, vpp, attention):
        return _STATE["chunks"]
    from megatron.core import dist_checkpointing

    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel

    ckpt = _checkpoint()
    initialize_model_parallel(tp, pp, vpp, seed=99)
    chunks = build_model(_model_cfg(tp, pp, vpp, attention))
    names = [f"model{i}" for i in range(len(chunks))]
    state = dist_checkpointing.load(
        {n: c.sharded_state_dict() for n, c in zip(names, chunks)}, ckpt
    )
    for n, c in zip(names, chunks):
        c.load_state_dict(state[n])
    _STATE.update(layout=(tp, pp, vpp, attention), chunks=chunks, table=None)
    return chunks


def neighbor_table(chunks) -> torch.Tensor:
    """Brute-force float64 cosine table [V_padded, K] over real ids (anchor first)."""
    if _STATE.get("table") is not None:
        return _STATE["table"]
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_ngrpo.mixing.embedding import mixing_embedding

    emb = mixing_embedding(chunks[0])
    padded = 512
    e = torch.empty(padded, 128, dtype=torch.float32)
    if emb is not None:  # first stage: gather the vocab shards [V/tp, h] → [V, h]
        e = (
            gather_from_tensor_model_parallel_region(emb.weight.detach().t().contiguous())
            .t()
            .contiguous()
        )
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            e,
            src=ps.get_pipeline_model_parallel_first_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
    e = e.double()[:NUM_REAL]
    e = e / e.norm(dim=1, keepdim=True)
    sim = e @ e.t()
    sim.fill_diagonal_(-float("inf"))
    nb = sim.topk(K - 1, dim=1).indices
    table = torch.arange(padded).unsqueeze(1).repeat(1, K)
    table[:NUM_REAL] = torch.cat([torch.arange(NUM_REAL).unsqueeze(1), nb], dim=1)
    _STATE["table"] = table
    return table


def engine(chunks, **kw):
    from megatron_ngrpo.rollout.megatron_engine import MegatronEngine

    kw.setdefault("decode", decode)
    return MegatronEngine(chunks, NUM_REAL, **kw)


def mixing(rate: float, **kw):
    from megatron_ngrpo.mixing.config import MixingConfig

    return MixingConfig(rate=rate, k=K, **kw)


# ---- references -----------------------------------------------------------------------------
def full_logits(chunks, tokens: torch.Tensor, mix=None) -> torch.Tensor:
    """[B, L, V] fp32 logits of a full, non-cached forward (megatron's forward-only schedule),
    on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ngrpo.mixing.embedding import mixing_inputs

    b, length = tokens.shape
    pos = torch.arange(length).unsqueeze(0).expand(b, length)

    def step(_data, model):
        with mixing_inputs(model, mix):
            out = model(tokens, pos, None, runtime_gather_output=True)
        return out, lambda o, non_loss_data=False: o

    for c in chunks:
        c.eval()
    with torch.no_grad():
        res = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=None,
            model=chunks,
            num_microbatches=1,
            seq_length=length,
            micro_batch_size=b,
            forward_only=True,
            collect_non_loss_data=True,
        )
    logits = res[0].float() if ps.is_pipeline_last_stage() else torch.empty(b, length, 512)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            logits,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
    return logits


def greedy_reference(chunks, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        z = full_logits(chunks, torch.tensor([seq]))[0, -1]
        seq.append(int(z[:NUM_REAL].argmax()))
    return seq[len(prompt) :]


def replay_logprobs(chunks, batch, temperature: float) -> list[torch.Tensor]:
    """log_softmax(logits / T) of every response token from one full forward with the batch's
    mixes replayed (MixBatch.from_record), real vocabulary only."""
    from megatron_ngrpo.mixing.embedding import MixBatch

    tokens, offsets, lengths = batch.padded()
    mix = MixBatch.from_record(batch.mixes, offsets, tokens.shape[1]) if len(batch.mixes) else None
    z = full_logits(chunks, tokens, mix)[..., :NUM_REAL]
    lp = torch.log_softmax(z / temperature, dim=-1)
    out = []
    for r, resp in enumerate(batch.response_ids):
        cols = torch.arange(int(offsets[r]) - 1, int(offsets[r]) - 1 + len(resp))
        out.append(lp[r, cols, torch.tensor(resp)])
    return out


def max_diff(a: list[torch.Tensor], b: list[list[float]]) -> float:
    return max(float((x - torch.tensor(y)).abs().max()) for x, y in zip(a, b))


def mixed_positions(batch, r: int) -> list[int]:
    return [p for p, _, _ in sequence_mixes(batch.mixes, r)]


def emitted_not_anchor(batch) -> int:
    """Mixed positions whose emitted token is not the record's anchor (ids[0])."""
    return sum(
        resp[p] != ids[0]
        for r, resp in enumerate(batch.response_ids)
        for p, ids, _ in sequence_mixes(batch.mixes, r)
    )


# ---- cases ----------------------------------------------------------------------------------
def _greedy(tp, pp):
    from megatron_ngrpo.rollout.types import SamplingParams

    chunks = layout(tp, pp)
    out = engine(chunks).generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))
    for p, r, f in zip(PROMPTS, out.response_ids, out.finish_reasons):
        assert r == greedy_reference(chunks, p, 6), (p, r)
        assert f == "length"
    tp1 = _STATE.setdefault("greedy_tp1", out.response_ids)
    assert out.response_ids == tp1, (out.response_ids, tp1)
    assert len(out.mixes) == 0
    return out.response_ids


def _replay(tp, pp):
    from megatron_ngrpo.rollout.types import SamplingParams
    from tests.support.replay import sequence_logprobs

    chunks = layout(tp, pp)
    table = neighbor_table(chunks)
    eng = engine(chunks, neighbor_table=table, eos_token_ids=[1])
    result = {}
    for name, rate, emit, temp in (("rho0.1", 0.1, "anchor", 0.8), ("rho1", 1.0, "sample", 1.3)):
        params = SamplingParams(
            n=3, temperature=temp, top_p=0.9, top_k=200, max_new_tokens=14, seed=5
        )
        out = eng.generate(PROMPTS, params, mixing(rate, emit=emit), keys=[10, 11, 12, 13])
        out.validate(512)
        ids = [t for r in out.response_ids for t in r]
        assert max(ids) < NUM_REAL and int(out.mixes.ids.max()) < NUM_REAL
        assert len(out.mixes) > (30 if rate == 1.0 else 2), len(out.mixes)
        d_full = max_diff(replay_logprobs(chunks, out, temp), out.logprobs)
        d_train = max_diff(
            sequence_logprobs(chunks, out, temp, 4, vocab_limit=NUM_REAL), out.logprobs
        )
        assert d_full < 1e-5 and d_train < 1e-5, (name, d_full, d_train)
        # Without the mixes the replay must disagree: the check can fail.
        plain = out.__class__(**{**out.__dict__, "mixes": out.mixes.empty(len(out), K)})
        d_plain = max_diff(replay_logprobs(chunks, plain, temp), out.logprobs)
        assert d_plain > 1e-3, (name, d_plain)
        key = f"replay_{name}_tp1"
        ref = _STATE.setdefault(key, out)
        assert (
            out.response_ids == ref.response_ids
            and max_diff([torch.tensor(x) for x in ref.logprobs], out.logprobs) < 1e-5
        )
        result[name] = dict(
            mixed=len(out.mixes),
            tokens=len(ids),
            d_full=d_full,
            d_train=d_train,
            d_without_mixes=d_plain,
            emitted_not_anchor=emitted_not_anchor(out),
        )
    return result


for _tp, _pp in LAYOUTS:
    for _fn in (_greedy, _replay):

        def _bound(fn=_fn, tp=_tp, pp=_pp):
            return fn(tp, pp)

        _bound.__name__ = f"{_fn.__name__[1:]}_tp{_tp}_pp{_pp}"
        case(_bound)


@case
def unfused_attention_tp2():
    """The engine on megatron's unfused attention (TP 2): its KV-cached prefill and decode give the
    greedy tokens and the mixed rollout (tokens, log-probs) of the default SDPA engine at TP 1."""
    from megatron_ngrpo.rollout.types import SamplingParams

    chunks = layout(2, 1, attention="unfused")
    core = chunks[0].decoder.layers[0].self_attention.core_attention
    assert type(core).__name__ == "DotProductAttention", type(core)
    greedy = engine(chunks).generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))
    assert greedy.response_ids == _STATE["greedy_tp1"], (greedy.response_ids, _STATE["greedy_tp1"])
    params = SamplingParams(n=3, temperature=0.8, top_p=0.9, top_k=200, max_new_tokens=14, seed=5)
    out = engine(chunks, neighbor_table=neighbor_table(chunks), eos_token_ids=[1]).generate(
        PROMPTS, params, mixing(0.1, emit="anchor"), keys=[10, 11, 12, 13]
    )
    ref = _STATE["replay_rho0.1_tp1"]
    d = max_diff([torch.tensor(x) for x in ref.logprobs], out.logprobs)
    assert out.response_ids == ref.response_ids and d < 1e-5, d
    return {"logprob_err": d, "tokens": sum(map(len, out.response_ids))}


@case
def virtual_pipeline_tp1_pp2_vpp2():
    """Interleaved chunks (hidden states go around the pipeline ring twice): the same greedy
    tokens and the same mixed rollout (tokens, log-probs, records) as TP=1."""
    from megatron_ngrpo.rollout.types import SamplingParams

    chunks = layout(1, 2, 2)
    assert len(chunks) == 2
    eng = engine(chunks, neighbor_table=neighbor_table(chunks), eos_token_ids=[1])
    greedy = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6))
    assert greedy.response_ids == _STATE["greedy_tp1"]
    params = SamplingParams(n=3, temperature=0.8, top_p=0.9, top_k=200, max_new_tokens=14, seed=5)
    out = eng.generate(PROMPTS, params, mixing(0.1), keys=[10, 11, 12, 13])
    ref = _STATE["replay_rho0.1_tp1"]
    assert out.response_ids == ref.response_ids
    assert max_diff([torch.tensor(x) for x in ref.logprobs], out.logprobs) < 1e-5
    assert torch.equal(out.mixes.ids, ref.mixes.ids) and torch.equal(out.mixes.pos, ref.mixes.pos)


@case
def strategies_replay_tp2_pp2():
    """Soft Thinking, STHT (recorded noise, σ broadcast from the first stage) and Gumbel
    mixtures replay exactly through the full forward and the trainer."""
    from megatron_ngrpo.rollout.types import SamplingParams
    from tests.support.replay import sequence_logprobs

    chunks = layout(2, 2)
    eng = engine(chunks)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=2)
    result = {}
    for strategy in ("soft_thinking", "stht", "gumbel"):
        out = eng.generate(PROMPTS, params, mixing(0.5, strategy=strategy), keys=[3, 1, 4, 1])
        out.validate(512)
        assert len(out.mixes) > 10 and (out.mixes.noise is not None) == (strategy == "stht")
        if strategy == "stht":
            assert (
                out.mixes.noise.shape == (len(out.mixes), 128) and float(out.mixes.noise.std()) > 0
            )
        for r, resp in enumerate(out.response_ids):
            assert all(resp[p] == ids[0] for p, ids, _ in sequence_mixes(out.mixes, r))
        d_full = max_diff(replay_logprobs(chunks, out, 1.0), out.logprobs)
        d_train = max_diff(
            sequence_logprobs(chunks, out, 1.0, 4, vocab_limit=NUM_REAL), out.logprobs
        )
        assert d_full < 1e-5 and d_train < 1e-5, (strategy, d_full, d_train)
        result[strategy] = dict(mixed=len(out.mixes), d_full=d_full, d_train=d_train)
        _STATE[strategy] = out
    # mixing.noise_scale: the same draws (seed, key, position) at twice the scale
    louder = eng.generate(
        PROMPTS, params, mixing(0.5, strategy="stht", noise_scale=0.66), keys=[3, 1, 4, 1]
    )
    first = {
        (int(s), int(p)): n
        for s, p, n in zip(
            _STATE["stht"].mixes.seq, _STATE["stht"].mixes.pos, _STATE["stht"].mixes.noise
        )
    }
    pairs = [
        (first[(int(s), int(p))], n)
        for s, p, n in zip(louder.mixes.seq, louder.mixes.pos, louder.mixes.noise)
        if (int(s), int(p)) in first
    ]
    assert len(pairs) > 5 and all(torch.allclose(2 * a, b, rtol=1e-5, atol=1e-7) for a, b in pairs)
    return result


@case
def on_demand_neighbors_tp2_pp2():
    """mixing.neighbor_lookup on_demand: the same batch as with the whole table (records bit for
    bit), while the engine searched only the distinct anchors it mixed (sharded over TP, sent
    to the last stage over PP), once each per weight version; a weight sync starts a new cache."""
    from megatron_ngrpo.mixing.neighbors import NeighborLookup
    from megatron_ngrpo.rollout.types import SamplingParams

    chunks = layout(2, 2)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=5)
    table = engine(chunks).generate(PROMPTS, params, mixing(0.3, neighbor_lookup="table"))
    eng = engine(chunks)
    on_demand = eng.generate(PROMPTS, params, mixing(0.3, neighbor_lookup="on_demand"))
    assert on_demand.response_ids == table.response_ids and on_demand.logprobs == table.logprobs
    assert torch.equal(on_demand.mixes.ids, table.mixes.ids)
    assert torch.equal(on_demand.mixes.weights, table.mixes.weights)
    lookups = [v for v in eng._derived.values() if isinstance(v, NeighborLookup)]
    assert len(lookups) == 1 and len(eng._derived) == 1  # no table was built beside it
    distinct = len(torch.unique(on_demand.mixes.ids[:, 0]))
    assert lookups[0].rows_computed == distinct < NUM_REAL, (lookups[0].rows_computed, distinct)
    again = eng.generate(PROMPTS, params, mixing(0.3, neighbor_lookup="on_demand"))
    assert lookups[0].rows_computed == distinct and torch.equal(
        again.mixes.ids, table.mixes.ids
    )  # cached
    eng.sync_weights(chunks)
    assert not eng._derived
    return {"mixed": len(on_demand.mixes), "rows_computed": distinct}


@case
def determinism_gates_anchor():
    """Same seed → same batch; another seed → another; mixed positions are exactly the gate's
    draws; paper mode emits the anchor (record ids[0]) at every mixed position; batching
    (max_batch_size) does not change the result; the engine's own table (mixing.neighbors)
    equals the brute-force one."""
    from megatron_ngrpo.mixing.decision import gate
    from megatron_ngrpo.rollout.types import SamplingParams, sequence_keys

    chunks = layout(2, 1)
    eng = engine(chunks)
    eng.set_neighbor_table(neighbor_table(chunks))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=3)
    mix = mixing(0.3)
    a = eng.generate(PROMPTS, params, mix)
    b = eng.generate(PROMPTS, params, mix)
    c = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=4), mix)
    d = engine(chunks, neighbor_table=neighbor_table(chunks), max_batch_size=3).generate(
        PROMPTS, params, mix
    )
    assert a.response_ids == b.response_ids and a.logprobs == b.logprobs
    assert torch.equal(a.mixes.ids, b.mixes.ids) and torch.equal(a.mixes.weights, b.mixes.weights)
    assert a.response_ids != c.response_ids
    assert a.response_ids == d.response_ids
    assert max_diff([torch.tensor(x) for x in a.logprobs], d.logprobs) < 1e-5
    built = engine(chunks).generate(PROMPTS, params, mix)  # table from mixing.neighbors
    assert built.response_ids == a.response_ids and torch.equal(built.mixes.ids, a.mixes.ids)
    keys = sequence_keys(range(len(PROMPTS)), 2)
    for r, resp in enumerate(a.response_ids):
        expect = (
            torch.nonzero(gate(0.3, 3, [keys[r]] * len(resp), list(range(len(resp)))))
            .flatten()
            .tolist()
        )
        assert mixed_positions(a, r) == expect, (r, mixed_positions(a, r), expect)
        for p, ids, w in sequence_mixes(a.mixes, r):
            assert resp[p] == ids[0] and len(ids) == K and abs(sum(w) - 1) < 1e-6
    return len(a.mixes)


@case
def stop_after_thinking_gate():
    """No mix at the position whose token completes ``stop_after``, nor after it; before it the
    mixed positions are the gate's."""
    from megatron_ngrpo.mixing.decision import gate
    from megatron_ngrpo.rollout.types import SamplingParams, sequence_keys

    chunks = layout(1, 2)
    eng = engine(chunks, neighbor_table=neighbor_table(chunks))
    out = eng.generate(
        PROMPTS,
        SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=8),
        mixing(0.5, stop_after="ab"),
    )
    keys = sequence_keys(range(len(PROMPTS)), 3)
    cut_rows = 0
    for r, resp in enumerate(out.response_ids):
        text = decode(resp)
        end = text.find("ab") + 1 if "ab" in text else len(resp)  # response index completing "ab"
        cut_rows += "ab" in text
        gated = (
            torch.nonzero(gate(0.5, 8, [keys[r]] * len(resp), list(range(len(resp)))))
            .flatten()
            .tolist()
        )
        assert mixed_positions(out, r) == [p for p in gated if p < end], (r, text)
        assert all(resp[p] == ids[0] for p, ids, _ in sequence_mixes(out.mixes, r))
    assert cut_rows >= 3, cut_rows
    return cut_rows


@case
def stop_strings_and_ids():
    from megatron_ngrpo.rollout.types import SamplingParams

    chunks = layout(2, 2)
    eng = engine(chunks)
    base = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=1)
    plain = eng.generate(PROMPTS, base)
    out = eng.generate(PROMPTS, SamplingParams(**{**base.__dict__, "stop": ["cd"]}))
    stopped = 0
    for r, (full, resp) in enumerate(zip(plain.response_ids, out.response_ids)):
        text = decode(full)
        if "cd" in text:
            stopped += 1
            assert resp == full[: text.find("cd") + 2] and out.finish_reasons[r] == "stop"
            assert out.texts[r] == text[: text.find("cd")]
        else:
            assert resp == full and out.finish_reasons[r] == "length"
    assert stopped >= 2, stopped
    stop_id = plain.response_ids[0][3]
    ids = eng.generate(PROMPTS, SamplingParams(**{**base.__dict__, "stop_token_ids": [stop_id]}))
    first = plain.response_ids[0].index(stop_id)
    assert (
        ids.response_ids[0] == plain.response_ids[0][: first + 1]
        and ids.finish_reasons[0] == "stop"
    )
    eos_engine = engine(chunks, eos_token_ids=[stop_id])
    eos = eos_engine.generate(PROMPTS, base)
    assert eos.response_ids == ids.response_ids and eos.finish_reasons == ids.finish_reasons
    # ignore_eos: the EOS no longer ends a response (the same samples as without any stop)
    free = eos_engine.generate(PROMPTS, SamplingParams(**{**base.__dict__, "ignore_eos": True}))
    assert free.response_ids == plain.response_ids and free.finish_reasons == plain.finish_reasons
    # max length: responses end at the model's max sequence length
    short = engine(chunks, max_seq_len=12).generate(PROMPTS, base)
    for p, r, f in zip(short.prompt_ids, short.response_ids, short.finish_reasons):
        assert len(p) + len(r) <= 12 and (f == "stop" or len(p) + len(r) == 12)
    return stopped


@case
def separate_copy():
    from megatron_ngrpo.rollout.types import SamplingParams

    chunks = layout(2, 2)
    params = SamplingParams(temperature=0, max_new_tokens=6)
    eng = engine(chunks, separate_copy=True, model_cfg=_model_cfg(2, 2))
    assert eng.chunks[0] is not chunks[0]
    assert eng.generate(PROMPTS, params).response_ids == _STATE["greedy_tp1"]
    with torch.no_grad():
        for c in eng.chunks:
            for p in c.parameters():
                p.mul_(0.5)
    assert eng.generate(PROMPTS, params).response_ids != _STATE["greedy_tp1"]
    eng.sync_weights(chunks)
    assert eng.generate(PROMPTS, params).response_ids == _STATE["greedy_tp1"]


@case
def bad_requests():
    """Errors name the request and come before any collective: only rank 0 calls."""
    from megatron_ngrpo.rollout.types import SamplingParams

    chunks = layout(2, 2)
    if dist.get_rank() != 0:
        return None
    eng = engine(chunks, max_seq_len=12, neighbor_table=torch.zeros(512, 2, dtype=torch.long))
    msgs = []
    for call in (
        lambda: eng.generate([[1, 2], []], SamplingParams()),
        lambda: eng.generate([[1, 2], [3] * 12], SamplingParams()),
        lambda: eng.generate([[1, 2], [3, 600]], SamplingParams()),
        lambda: eng.generate([[1, 2]], SamplingParams(n=0)),
        lambda: eng.generate([[1, 2]], SamplingParams(), mixing(0.1)),  # k=3 vs a k=2 table
        lambda: engine(chunks, decode=None).generate([[1, 2]], SamplingParams(stop=["x"])),
    ):
        try:
            call()
        except ValueError as e:
            msgs.append(str(e))
        else:
            raise AssertionError(f"no error for case {len(msgs)}")
    assert "prompt 1: empty" in msgs[0] and "prompt 1: 12 tokens" in msgs[1]
    assert "prompt 1: token id 600" in msgs[2] and "n = 0" in msgs[3]
    assert "mixing.k = 3" in msgs[4] and "decode" in msgs[5]
    return msgs


if __name__ == "__main__":
    run_cases()
