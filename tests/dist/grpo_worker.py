"""Multi-process cases of the GRPO loss: loss and gradients of one step under TP/PP/VPP/DP equal a
float64 single-process reference (a TP=1 megatron model on megatron's unfused attention cast to
float64, run per sequence with hand-built mixed input embeddings, and a loss written out term by
term here).

Run by tests/test_grpo.py under torchrun with 4 processes, and the DP×TP×PP = 2×2×2 cases with 8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import torch
import torch.distributed as dist

from megatron_ngrpo.parallel import broadcast_from_rank0
from tests.harness.multiproc import case, run_cases, shared_tmpdir
from tests.harness.records import mix_record, sequence_mixes

VOCAB, N_PROMPTS, G, TEMP = 300, 4, 4, 0.8
K = 3
MAX_RESPONSE = 10
STATE: dict = {}


# ---- shared set-up ---------------------------------------------------------------------------
def model_cfg(tp=1, pp=1, vpp=None, sp=False, recompute=False):
    from megatron_ngrpo.models.config import ModelConfig

    return ModelConfig(
        hf_path=STATE["hf"],
        tensor_parallel=tp,
        pipeline_parallel=pp,
        virtual_pipeline=vpp,
        make_vocab_size_divisible_by=64,
        sequence_parallel=sp,
        recompute=recompute,
    )


def make_rollout(seed: int):
    """16 responses (4 prompts × 4), mixes at ~30% of positions, group 3 has equal rewards."""
    from megatron_ngrpo.rollout.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts, responses, mixes = [], [], []
    for _ in range(N_PROMPTS):
        prompt = torch.randint(
            2, VOCAB, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(G):
            n = int(torch.randint(1, MAX_RESPONSE + 1, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(2, VOCAB, (n,), generator=g).tolist())
            entries = []
            for t in range(n):
                if torch.rand((), generator=g) < 0.3:
                    ids = torch.randperm(VOCAB, generator=g)[:K].tolist()
                    w = torch.softmax(torch.randn(K, generator=g), 0).tolist()
                    entries.append((t, ids, w))
            mixes.append(entries)
    rewards = torch.randint(0, 2, (N_PROMPTS * G,), generator=g).double()
    rewards[3 * G :] = 1.0  # a zero-variance group
    rewards[0], rewards[1] = 1.0, 0.0  # group 0 has variance
    batch = RolloutBatch(
        prompts,
        responses,
        [[0.0] * len(r) for r in responses],
        ["stop"] * len(responses),
        mix_record(mixes, K),
        [i // G for i in range(len(responses))],
    )
    return batch, rewards


# ---- float64 reference ----------------------------------------------------------------------
def reference_logprobs(model64, batch, mixes: bool) -> list[torch.Tensor]:
    """Per response, float64 log-probs of its tokens: one sequence at a time, the mixed input
    embeddings built by hand."""
    weight = model64.embedding.word_embeddings.weight
    out = []
    for s, (prompt, resp) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        tokens = torch.tensor(prompt + resp)
        ids = torch.zeros(1, len(tokens), K, dtype=torch.long)
        wts = torch.zeros(1, len(tokens), K, dtype=torch.float64)
        mask = torch.zeros(1, len(tokens), dtype=torch.bool)
        if mixes:
            for pos, i, w in sequence_mixes(batch.mixes, s):
                col = len(prompt) + pos
                ids[0, col, : len(i)] = torch.tensor(i)
                wts[0, col, : len(w)] = torch.tensor(w, dtype=torch.float64)
                mask[0, col] = True
        emb = _lookup(weight, tokens, ids[0], wts[0], mask[0])
        logits = model64(
            input_ids=None,
            position_ids=torch.arange(len(tokens))[None],
            attention_mask=None,
            decoder_input=emb.transpose(0, 1).contiguous(),
        )
        lp = torch.log_softmax(logits[0, :, :VOCAB].double() / TEMP, dim=-1)  # padded rows excluded
        p0 = len(prompt)
        out.append(torch.stack([lp[p0 - 1 + t, resp[t]] for t in range(len(resp))]))
    return out


def _lookup(weight, tokens, ids, wts, mask):
    """[1, S, h]: E[token], or Σ w·E[ids] where mixed (differentiable in E)."""
    rows = weight[tokens]
    mixed = (wts.unsqueeze(-1) * weight[ids]).sum(1)
    return torch.where(mask.unsqueeze(-1), mixed, rows).unsqueeze(0)


def reference_objective(lps, old, ref, rollout, adv, active, v: dict) -> torch.Tensor:
    """The GRPO objective written out term by term (float64)."""
    per_seq = []
    for i, lp in enumerate(lps):
        if not active[i]:
            continue
        if v["loss_mode"] == "gspo":
            seq = torch.clamp((lp - old[i]).mean(), -20, 20).exp()
            ratios = [seq] * len(lp)
        else:
            ratios = [torch.exp(torch.clamp(lp[t] - old[i][t], -20, 20)) for t in range(len(lp))]
        terms = []
        for t in range(len(lp)):
            r, a = ratios[t], float(adv[i])
            term = torch.maximum(-a * r, -a * torch.clamp(r, 1 - 0.2, 1 + 0.28))
            if a < 0:
                term = torch.minimum(term, torch.tensor(-a * 3.0, dtype=torch.float64))
            if v.get("tis_cap"):
                term = term * min(math.exp(float(old[i][t] - rollout[i][t])), v["tis_cap"])
            if v["kl"] != "none":
                d = ref[i][t] - lp[t]
                kl = {
                    "k1": -d,
                    "k2": 0.5 * d * d,
                    "k3": torch.clamp(torch.exp(d) - d - 1, -10, 10),
                }[v["kl"]]
                term = term + 0.05 * kl
            terms.append(term)
        per_seq.append(torch.stack(terms))
    if not per_seq:
        return torch.zeros((), dtype=torch.float64)
    if v["agg"] == "token-mean":
        return torch.cat(per_seq).sum() / sum(len(x) for x in per_seq)
    if v["agg"] == "seq-mean-token-mean":
        return torch.stack([x.mean() for x in per_seq]).mean()
    return torch.stack([x.sum() for x in per_seq]).sum() / (len(per_seq) * MAX_RESPONSE)


def reference_advantages(rewards, kind):
    adv = torch.zeros_like(rewards)
    for p in range(N_PROMPTS):
        r = rewards[p * G : (p + 1) * G]
        a = r - r.mean()
        adv[p * G : (p + 1) * G] = a / (r.std() + 1e-6) if kind == "grpo" else a
    return adv


VARIANTS = {
    "mix_token": dict(
        mixes=True, loss_mode="token", agg="seq-mean-token-mean", adv="grpo", kl="k3"
    ),
    "plain_token": dict(
        mixes=False, loss_mode="token", agg="seq-mean-token-mean", adv="grpo", kl="k3"
    ),
    "gspo": dict(mixes=True, loss_mode="gspo", agg="seq-mean-token-mean", adv="grpo", kl="k3"),
    "drgrpo": dict(
        mixes=True, loss_mode="token", agg="seq-mean-token-sum-norm", adv="dr_grpo", kl="k2"
    ),
    "tokmean_tis_filter": dict(
        mixes=True,
        loss_mode="token",
        agg="token-mean",
        adv="grpo",
        kl="k1",
        tis_cap=1.5,
        filter=True,
    ),
    "all_masked": dict(
        mixes=True,
        loss_mode="token",
        agg="seq-mean-token-mean",
        adv="grpo",
        kl="k3",
        filter=True,
        all_equal=True,
    ),
}


def grpo_cfg(v: dict):
    from megatron_ngrpo.grpo.config import GRPOConfig

    return GRPOConfig(
        advantage=v["adv"],
        loss_mode=v["loss_mode"],
        loss_agg=v["agg"],
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        kl_mode="loss",
        kl_coef=0.05,
        kl_estimator=v["kl"],
        filter_zero_variance=v.get("filter", False),
        tis_cap=v.get("tis_cap"),
    )


def setup_reference():
    """Weights saved once (TP=1 layout, reloaded resharded by every layout); the float64
    reference of every variant computed on rank 0 and shared."""
    from megatron_ngrpo.conversion.checkpoint import (
        checkpoint_meta,
        load_megatron_checkpoint,
        save_megatron_checkpoint,
    )
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.harness.tiny import write_tiny_hf

    if STATE:
        return
    start = time.time()
    root = shared_tmpdir("grpo_worker_")
    STATE["root"] = root
    STATE["hf"] = f"{root}/hf"
    if dist.get_rank() == 0:
        write_tiny_hf(STATE["hf"], weights=False, vocab_size=VOCAB, num_layers=4)
    dist.barrier()
    initialize_model_parallel(1, 1, None, seed=7)
    chunks = build_model(model_cfg())
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in chunks[0].named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(
                    0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)))
                )
    STATE["ckpt"] = str(
        save_megatron_checkpoint(chunks, f"{root}/weights", checkpoint_meta(model_cfg()))
    )

    batch, rewards = make_rollout(seed=3)
    refs = {}
    # megatron's unfused attention: the reference does not share the trainer's SDPA attention
    model64 = build_model(dataclasses.replace(model_cfg(), attention="unfused"))[0]
    load_megatron_checkpoint([model64], STATE["ckpt"])  # collective: every rank loads
    if dist.get_rank() == 0:
        model64 = model64.double()
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            lp_mix = reference_logprobs(model64, batch, mixes=True)
        noise = [
            (
                0.3 * torch.randn(len(x), generator=g, dtype=torch.float64),
                0.2 * torch.randn(len(x), generator=g, dtype=torch.float64),
                0.1 * torch.randn(len(x), generator=g, dtype=torch.float64),
            )
            for x in lp_mix
        ]
        for name, v in VARIANTS.items():
            model64.zero_grad()
            lps = reference_logprobs(model64, batch, v["mixes"])
            r = torch.ones_like(rewards) if v.get("all_equal") else rewards
            old = [lp.detach() + n[0] for lp, n in zip(lps, noise)]
            ref = [lp.detach() + n[1] for lp, n in zip(lps, noise)]
            rollout = [o + n[2] for o, n in zip(old, noise)]
            adv = reference_advantages(r, v["adv"])
            active = [
                not (v.get("filter") and float(r[(i // G) * G : (i // G + 1) * G].std()) == 0)
                for i in range(len(lps))
            ]
            obj = reference_objective(lps, old, ref, rollout, adv, active, v)
            if obj.requires_grad:
                obj.backward()
            grads = {
                n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                for n, p in model64.named_parameters()
            }
            refs[name] = dict(
                loss=float(obj),
                grads=grads,
                old=old,
                ref=ref,
                rollout=rollout,
                lps=[x.detach() for x in lps],
                rewards=r,
            )
    STATE["refs"], STATE["batch"], STATE["rewards"] = broadcast_from_rank0(refs), batch, rewards
    STATE["setup_seconds"] = time.time() - start


# ---- the parallel side -------------------------------------------------------------------------
def local_rows(n: int) -> list[int]:
    from megatron.core import parallel_state as ps

    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = n // dp
    return list(range(r * per, (r + 1) * per))


def local_batch(batch, rows):
    from megatron_ngrpo.rollout.types import RolloutBatch

    return RolloutBatch(
        [batch.prompt_ids[i] for i in rows],
        [batch.response_ids[i] for i in rows],
        [batch.logprobs[i] for i in rows],
        [batch.finish_reasons[i] for i in rows],
        batch.mixes.select(rows),
        [batch.prompt_index[i] for i in rows],
    )


def full_grads(chunks) -> dict[str, torch.Tensor]:
    """Full-shaped gradients by global parameter name, on rank 0 (TP shards gathered, fc1's
    [gate; up] halves re-interleaved, layer numbers made global)."""
    from megatron.core import parallel_state as ps

    from megatron_ngrpo.architecture import unwrap

    tp_group = ps.get_tensor_model_parallel_group()
    tp = tp_group.size()
    mine = {}
    for c in chunks:
        inner = unwrap(c)
        offsets = {}
        if hasattr(inner, "decoder"):
            offsets = {i: layer.layer_number - 1 for i, layer in enumerate(inner.decoder.layers)}
        for name, p in inner.named_parameters():
            g = p.main_grad.detach().clone()
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                parts = [torch.empty_like(g) for _ in range(tp)]
                dist.all_gather(parts, g.contiguous(), group=tp_group)
                if name.endswith("linear_fc1.weight"):
                    halves = [x.chunk(2, dim=0) for x in parts]
                    g = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
                else:
                    g = torch.cat(parts, dim=p.partition_dim)
            if name.startswith("decoder.layers."):
                idx = int(name.split(".")[2])
                name = f"decoder.layers.{offsets[idx]}." + ".".join(name.split(".")[3:])
            mine[name] = g
    keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine if keep else {})
    out = {}
    for d in gathered:
        out.update(d)
    return out


@contextlib.contextmanager
def layer_probe(chunks):
    """Pre-hooks on every transformer layer of ``chunks``: ``seq`` collects (sequence length
    entering the layer, sequence length its attention sees) — with sequence parallelism the
    layer gets s/TP rows and its column-parallel QKV all-gathers s; ``grad`` / ``no_grad`` count
    layer forwards with gradients on / off: inside a gradient pass a layer runs without them
    only as megatron's full recompute runs it (the checkpointed forward, rerun with gradients
    in the backward)."""
    from megatron_ngrpo.architecture import unwrap

    seen = {"seq": set(), "grad": 0, "no_grad": 0}
    entering = []

    def layer_hook(_, args, kwargs):
        entering.append((args[0] if args else kwargs["hidden_states"]).shape[0])
        seen["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    def attention_hook(_, args, kwargs):
        seen["seq"].add((entering[-1], (args[0] if args else kwargs["query"]).shape[0]))

    handles = []
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            handles.append(layer.register_forward_pre_hook(layer_hook, with_kwargs=True))
            attention = layer.self_attention.core_attention
            handles.append(attention.register_forward_pre_hook(attention_hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def run_layout(tp, pp, vpp=None, max_tokens=0, sp=False, recompute=False):
    from megatron_ngrpo.conversion.checkpoint import load_megatron_checkpoint
    from megatron_ngrpo.grpo.advantages import (
        compute_advantages,
        group_ids,
        zero_variance_groups,
    )
    from megatron_ngrpo.grpo.batches import TokenBatch
    from megatron_ngrpo.grpo.loss_inputs import LossInputs
    from megatron_ngrpo.grpo.update import (
        UpdateSettings,
        loss_and_grads,
        wrap_for_training,
    )
    from megatron_ngrpo.models.provider import build_model
    from megatron_ngrpo.parallel import initialize_model_parallel
    from tests.support.replay import sequence_logprobs

    setup_reference()
    start = time.time()
    initialize_model_parallel(tp, pp, vpp, seed=7)
    chunks = build_model(model_cfg(tp, pp, vpp, sp, recompute))
    load_megatron_checkpoint(chunks, STATE["ckpt"])
    chunks = wrap_for_training(chunks)
    batch, refs = STATE["batch"], STATE["refs"]
    rows = local_rows(len(batch))
    lb = local_batch(batch, rows)
    report = {}
    # engine-verification API: replayed log-probs vs the float64 reference
    lps = sequence_logprobs(
        chunks, lb, TEMP, micro_batch_size=3, max_tokens=max_tokens, vocab_limit=VOCAB
    )
    lp_err = max(
        float((a.double() - refs["mix_token"]["lps"][i]).abs().max()) for a, i in zip(lps, rows)
    )
    assert lp_err < 2e-5, f"sequence_logprobs off by {lp_err}"
    report["logprob_err"] = lp_err
    settings = UpdateSettings(
        temperature=TEMP,
        micro_batch_size=2,
        max_tokens=max_tokens,
        vocab_limit=VOCAB,
        max_response_len=MAX_RESPONSE,
    )
    probe = layer_probe(chunks)
    seen = probe.__enter__()
    for name, v in VARIANTS.items():
        ref = refs[name]
        cfg = grpo_cfg(v)
        rewards = ref["rewards"][rows]
        groups = group_ids(lb.prompt_index)
        adv = compute_advantages(rewards, groups, cfg.advantage, cfg.adv_eps)
        active = (
            ~zero_variance_groups(rewards, groups)
            if cfg.filter_zero_variance
            else torch.ones(len(rows), dtype=torch.bool)
        )
        tb = TokenBatch.from_rollout(lb, replay_mixes=v["mixes"])
        old = tb.label_aligned([ref["old"][i] for i in rows])
        inputs = LossInputs(
            old_logprobs=old,
            ref_logprobs=tb.label_aligned([ref["ref"][i] for i in rows]),
            advantages=adv,
            active=active,
        )
        if cfg.tis_cap:
            roll = tb.label_aligned([ref["rollout"][i] for i in rows])
            inputs.tis_weight = torch.exp(old - roll).clamp(max=cfg.tis_cap) * tb.mask
        stats = loss_and_grads(chunks, tb.with_inputs(inputs), cfg, settings)
        grads = full_grads(chunks)
        if dist.get_rank() == 0:
            loss_err = abs(stats["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-3)
            scale = max(float(g.abs().max()) for g in ref["grads"].values())
            assert set(grads) == set(ref["grads"]), sorted(set(grads) ^ set(ref["grads"]))
            # Padded vocab rows differ per TP size (megatron's rule): compare the real rows and
            # require zero gradient on the padded ones (they are outside the softmax).
            grad_err = max(
                float((grads[n][: len(ref["grads"][n])].double() - ref["grads"][n]).abs().max())
                for n in grads
            )
            padded = max(
                (
                    float(grads[n][VOCAB:].abs().max())
                    for n in grads
                    if "word_emb" in n or "output" in n
                ),
                default=0.0,
            )
            assert padded == 0.0, f"{name}: gradient on padded vocab rows {padded}"
            if v.get("all_equal"):
                assert stats["normaliser"] == 0 and stats["loss"] == 0 and grad_err == 0, (
                    stats,
                    grad_err,
                )
                rel = 0.0
            else:
                rel = grad_err / scale
                assert loss_err < 1e-5, f"{name}: loss {stats['loss']} vs reference {ref['loss']}"
                assert rel < 1e-5, f"{name}: gradient relative error {rel}"
            report[name] = {"loss_err": loss_err, "grad_rel_err": rel}
    probe.__exit__(None, None, None)
    # the features are on, not silently off: SP's s/TP rows, every layer forward recomputed
    split = tp if sp else 1
    assert seen["seq"] and all(s * split == full for s, full in seen["seq"]), (
        f"(layer rows, attention rows) {sorted(seen['seq'])} with sequence_parallel={sp}, TP {tp}"
    )
    assert seen["grad"] > 0 and seen["no_grad"] == (seen["grad"] if recompute else 0), (
        f"layer forwards with / without gradients {seen['grad']} / {seen['no_grad']} in the "
        f"gradient passes, recompute={recompute}"
    )
    report["layer_rows"] = sorted(seen["seq"])
    report["recomputed_layer_forwards"] = seen["no_grad"]
    report["seconds"] = time.time() - start
    return report


@case
def fused_logprob_pass():
    """token_logprobs (log-probs, entropy, hidden and weight gradients) from hidden states and
    this rank's output rows (an OutputHead: the logits are never formed) at TP 1, 2 and 4 equal
    float64 log_softmax of the full logits, with padded columns excluded (at TP 4 the last rank
    holds only padded columns), in fp32 and bf16, in chunks of 4 rows."""
    from megatron.core import parallel_state as ps

    from megatron_ngrpo.grpo import token_logprobs as chunked
    from megatron_ngrpo.grpo.logprobs import token_logprobs
    from megatron_ngrpo.models.output_head import OutputHead
    from megatron_ngrpo.parallel import initialize_model_parallel

    vocab, limit, h = 320, 237, 16
    g = torch.Generator().manual_seed(5)
    # multiples of 1/2 up to 1: every logit (16 products, a multiple of 1/4 up to 16) is exact in
    # bf16, so the bf16 output layer's rounding of the logits is not compared
    hidden = torch.randint(-2, 3, (3, 11, h), generator=g).double() / 2
    weight = torch.randint(-2, 3, (vocab, h), generator=g).double() / 2
    labels = torch.randint(0, limit, (3, 11), generator=g)
    w = torch.randn(3, 11, generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (hidden, weight)]
    log_p = torch.log_softmax((ref[0] @ ref[1].t())[..., :limit] / TEMP, -1)
    lp_ref = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent_ref = -(log_p.exp() * log_p).sum(-1)
    (lp_ref * w).sum().backward()
    report = {}
    for tp in (1, 2, 4):
        initialize_model_parallel(tp, 1)
        r, v_local = ps.get_tensor_model_parallel_rank(), vocab // tp
        rows, group = slice(r * v_local, (r + 1) * v_local), ps.get_tensor_model_parallel_group()
        chunk_bytes, chunked.CHUNK_BYTES = chunked.CHUNK_BYTES, 4 * 4 * v_local  # 4 rows a chunk
        for dtype in (torch.float32, torch.bfloat16):
            mine = (
                hidden.to(dtype).requires_grad_(),
                torch.nn.Parameter(weight.to(dtype)[rows].clone()),
            )
            lp, ent = token_logprobs(
                OutputHead(*mine, r * v_local, group), labels, TEMP, limit, with_entropy=True
            )
            (lp * w.float()).sum().backward()
            grad_hidden = mine[0].grad.double()
            dist.all_reduce(grad_hidden, group=group)  # each rank's partial sum
            scale = [t.grad.abs().max() for t in ref]
            errs = {
                "lp": float((lp.detach().double() - lp_ref.detach()).abs().max()),
                "entropy": float((ent.double() - ent_ref.detach()).abs().max()),
                "grad": max(
                    float((grad_hidden - ref[0].grad).abs().max() / scale[0]),
                    float((mine[1].grad.double() - ref[1].grad[rows]).abs().max() / scale[1]),
                ),
            }
            grad_tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 gradient: its own rounding
            assert errs["lp"] < 1e-5 and errs["entropy"] < 1e-5 and errs["grad"] < grad_tol, (
                tp,
                dtype,
                errs,
            )
            assert mine[0].grad.dtype == mine[1].grad.dtype == dtype
            report[f"tp{tp}_{str(dtype)[6:]}"] = errs
        chunked.CHUNK_BYTES = chunk_bytes
    return report


@case
def layout_tp1_dp4():
    return run_layout(1, 1)


@case
def layout_tp2_dp2():
    return run_layout(2, 1)


@case
def layout_pp2_dp2():
    return run_layout(1, 2)


@case
def layout_tp2_pp2():
    return run_layout(2, 2)


@case
def layout_pp2_vpp2_dp2():
    return run_layout(1, 2, vpp=2)


@case
def layout_tp2_token_budget():
    return run_layout(2, 1, max_tokens=24)


@case
def layout_tp2_sequence_parallel():
    """Micro-batches of odd lengths are padded to a multiple of TP; padding is masked."""
    return run_layout(2, 1, sp=True)


@case
def layout_tp2_pp2_sequence_parallel_recompute():
    return run_layout(2, 2, sp=True, recompute=True)


@case
def layout_pp2_recompute():
    return run_layout(1, 2, recompute=True)


@case
def layout_pp2_vpp2_token_budget():
    """Token-budget micro-batches of different lengths and row counts through the interleaved
    pipeline (one p2p shape on CPU: rows and columns padded and masked; dummy micro-batches up to a
    multiple of PP)."""
    return run_layout(1, 2, vpp=2, max_tokens=24)


# ---- 8 ranks (a launch of their own, tests/test_grpo.py) ----------------------------------------
@case
def layout_dp2_tp2_pp2():
    return run_layout(2, 2)


@case
def layout_dp2_tp2_pp2_vpp2_sequence_parallel():
    return run_layout(2, 2, vpp=2, sp=True)


if __name__ == "__main__":
    run_cases()
