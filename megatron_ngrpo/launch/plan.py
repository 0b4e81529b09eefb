"""``ngrpo-launch plan RECIPE``: a recipe's full-size layout checked on a machine without GPUs.

1. The recipe's training config (its YAML + the launcher's overrides + the user's) is validated
   at the recipe's real world size (``WORLD_SIZE`` = nodes × ranks per node), against the HF
   config.json facts the recipe table ships (no hub, no weights).
2. torch's fake process-group backend stands in for NCCL at that world size: megatron-core's
   ``initialize_model_parallel`` runs unchanged, and for every (TP, PP) rank of one data-parallel
   replica the model chunks are built on the meta device with the project's own
   :func:`~megatron_ngrpo.models.provider.build_model` (local layer spec: TE's spec needs a GPU;
   it has the same parameters). Nothing is allocated.
3. The per-rank parameter counts, summed over TP and PP (TP-sharded tensors once per TP rank,
   replicated ones once, the last stage's copy of a tied embedding left out, megatron's vocabulary
   padding removed), must equal the HF total computed from config.json; each rank's count must
   equal the memory model's (:mod:`.memory`).
4. The memory plan of the busiest rank (:func:`.memory.train_memory`: with the config's
   reference copy, Megatron-engine weight copy and KV cache, weight-sync sender) plus vLLM's
   reservation must fit an 80 GB H100; the table shows each rank's training memory.

Run it in its own process (the CLI does): the fake default process group stays for the rest of
the process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_ngrpo.architecture import unwrap
from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.data.paths import find_data
from megatron_ngrpo.data.tokenizer import R1_DISTILL
from megatron_ngrpo.launch import memory, recipes
from megatron_ngrpo.models.provider import build_model
from megatron_ngrpo.rollout.config import EngineName
from megatron_ngrpo.training.job_config import load_config

REPO = Path(__file__).resolve().parents[2]


class PlanError(Exception):
    """The layout cannot be built or does not fit (one line)."""


@dataclass(frozen=True)
class RankShard:
    """What one (TP, PP) rank builds: its parameters and, per model chunk, the first and last
    global layer number (1-based)."""

    rank: int
    tp_rank: int
    pp_rank: int
    params: int  # every parameter the rank holds
    counted: int  # the rank's share of the model total (see the module docstring)
    layers: tuple[tuple[int, int], ...]


@dataclass
class LayoutPlan:
    recipe: recipes.Recipe
    nodes: int
    world_size: int
    tp: int
    pp: int
    vpp: int | None
    dp: int
    padded_vocab: int
    hf_total: int
    shards: list[RankShard] = field(default_factory=list)
    train: memory.TrainMemory | None = None
    layout: memory.TrainLayout | None = None
    vllm: memory.VLLMMemory | None = None

    @property
    def built_total(self) -> int:
        """Σ over TP×PP ranks of the model's parameters, megatron's vocabulary padding removed."""
        spec = self.recipe.spec
        padding = (
            (self.padded_vocab - spec.vocab_size)
            * spec.hidden_size
            * (1 if spec.tied_embeddings else 2)
        )
        return sum(s.counted for s in self.shards) - padding

    @property
    def gpu_total(self) -> int:
        return self.train.total + (self.vllm.reserved if self.vllm else 0)

    @property
    def fits(self) -> bool:
        return self.gpu_total <= memory.H100_USABLE_BYTES


def plan_layout(
    recipe: recipes.Recipe,
    nodes: int | None = None,
    overrides: tuple[str, ...] = (),
    config: str | None = None,
) -> LayoutPlan:
    """Validate, build on meta under a fake process group, count and size (see the module
    docstring). Raises :class:`PlanError` when the layout cannot be built or does not fit; a
    layout that does not fit is refused before anything is built."""
    nodes = nodes or recipe.nodes
    try:
        recipe.validate(nodes)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    world = recipe.world_size(nodes)
    cfg = recipe_config(recipe, nodes, overrides, config)
    m = cfg.model
    dp = world // (m.tensor_parallel * m.pipeline_parallel * m.context_parallel)
    plan = LayoutPlan(
        recipe=recipe,
        nodes=nodes,
        world_size=world,
        tp=m.tensor_parallel,
        pp=m.pipeline_parallel,
        vpp=m.virtual_pipeline,
        dp=dp,
        padded_vocab=memory.padded_vocab_size(
            recipe.spec.vocab_size, m.tensor_parallel, m.make_vocab_size_divisible_by
        ),
        hf_total=memory.model_params(recipe.spec),
    )
    plan.layout = train_layout(cfg, dp)
    plan.train = memory.train_memory(recipe.spec, plan.layout)
    if cfg.rollout.engine == EngineName.vllm:
        v = cfg.rollout.vllm
        plan.vllm = memory.vllm_memory(
            recipe.spec, v.tensor_parallel, v.gpu_memory_utilization, quantization=v.quantization
        )
    if not plan.fits:
        raise PlanError(
            f"recipe {recipe.name} on {nodes} node(s): TP {plan.tp}, PP {plan.pp}, DP {dp} needs "
            f"{plan.gpu_total / memory.GIB:.1f} GiB per GPU (training {plan.train.total / memory.GIB:.1f}"
            f" + vLLM {(plan.vllm.reserved if plan.vllm else 0) / memory.GIB:.1f}), more than "
            f"{memory.H100_USABLE_BYTES / memory.GIB:.1f} GiB of an 80 GB H100"
        )
    with tempfile.TemporaryDirectory(prefix="ngrpo-plan-") as hf:
        _write_hf_config(recipe, hf)
        # CP ranks hold the same parameters: built as megatron's DP ranks of a CP-less layout.
        plan.shards = _build_shards(
            dataclasses.replace(cfg.model, hf_path=hf), world, dp * m.context_parallel
        )
    _check_counts(plan, cfg)
    return plan


def recipe_config(
    recipe: recipes.Recipe, nodes: int, overrides: tuple[str, ...] = (), config: str | None = None
):
    """The recipe's training config (its YAML, the launcher's overrides, ``overrides``) validated
    at the recipe's world size on ``nodes`` nodes, against the recipe's config.json facts. No
    weights exist here: ``train.load=random`` skips the check that model.hf_path holds them."""

    path = config or recipe.config
    if path is None:
        raise PlanError(f"recipe {recipe.name}: has no training config; pass --config")
    path = Path(path) if Path(path).is_file() else REPO / path
    with (
        tempfile.TemporaryDirectory(prefix="ngrpo-plan-") as hf,
        _world_size(recipe.world_size(nodes)),
    ):
        _write_hf_config(recipe, hf)
        try:
            recipes.check_configs(recipe, [path], overrides)
            return load_config(
                [path],
                [
                    *recipe.model_overrides(hf),
                    *recipe.rollout_overrides(),
                    "train.load=random",
                    *overrides,
                ],
            )
        except ConfigError as e:
            raise PlanError(str(e)) from None


def train_layout(cfg, dp: int) -> memory.TrainLayout:
    """The memory model's layout of a validated training config on GPU (bf16, flash attention):
    the micro-batch holds the token budget, or micro_batch_size rows of prompt + response; the
    reference copy, the Megatron engine's weight copy and KV cache (all of a DP rank's rollout
    rows, or max_batch_size of them), the weight-sync sender's buckets."""
    m, t, r = cfg.model, cfg.train, cfg.rollout
    longest = cfg.data.max_prompt_tokens + r.max_new_tokens
    tokens = t.max_tokens_per_micro_batch or t.micro_batch_size * longest
    beside = bool(t.async_.max_staleness)
    megatron = r.engine == EngineName.megatron
    rows = t.prompts_per_step // dp * r.n
    return memory.TrainLayout(
        tp=m.tensor_parallel,
        pp=m.pipeline_parallel,
        dp=dp,
        tokens=tokens,
        cp=m.context_parallel,
        sequence_parallel=m.sequence_parallel and m.tensor_parallel > 1,
        recompute=m.recompute,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        distributed_optimizer=cfg.optim.distributed_optimizer,
        reference_copy=t.reference == "copy" and cfg.grpo.needs_reference,
        engine_copy=megatron and (r.separate_copy or beside),
        kv_rows=min(rows, r.max_batch_size or rows) if megatron else 0,
        kv_seq_len=longest if megatron else 0,
        kv_beside_training=megatron and beside,
        **_sender(r),
    )


def _sender(r) -> dict:
    """The weight-sync sender's buckets (TrainLayout fields): colocated vLLM's gloo / ipc routes
    on every rank (``reload`` streams one tensor at a time); rollout.remote on global rank 0, one
    packed buffer per server on the nccl route."""
    if r.engine == EngineName.vllm and r.vllm.weight_transfer in ("gloo", "ipc"):
        return {"sync_bucket_bytes": int(r.vllm.sync_bucket_mb * 2**20)}
    if r.engine == EngineName.remote:
        servers = len(r.remote.urls) or r.remote.num_servers
        buckets = servers if r.remote.weight_transfer == "nccl" else 1
        return {"sync_bucket_bytes": buckets * r.remote.bucket_mb * 2**20, "sync_rank0_only": True}
    return {}


def format_plan(plan: LayoutPlan) -> str:
    gib = lambda b: f"{b / memory.GIB:.1f} GiB"  # noqa: E731
    r, t = plan.recipe, plan.train
    lines = [
        f"recipe {r.name}: {plan.nodes} node(s) × {r.procs_per_node} = {plan.world_size} ranks; "
        f"TP {plan.tp}, PP {plan.pp}{f' (virtual {plan.vpp})' if plan.vpp else ''}, DP {plan.dp}",
        "built on the meta device under a fake process group of that size (local layer spec)",
        f"vocabulary: {r.spec.vocab_size:,} → padded {plan.padded_vocab:,} ({plan.padded_vocab // plan.tp:,} rows per TP rank)",
        "rank  TP  PP  parameters      training   layers",
    ]
    for s in plan.shards:
        span = ", ".join(f"{a}-{b}" for a, b in s.layers) or "-"
        mem = memory.stage_memory(r.spec, plan.layout, s.pp_rank, rank0=s.rank == 0).total
        lines.append(
            f"{s.rank:>4} {s.tp_rank:>3} {s.pp_rank:>3}  {s.params:>14,}  {gib(mem):>9}  {span}"
        )
    lines += [
        f"parameters: Σ over TP×PP (padding removed) = {plan.built_total:,} = HF total {plan.hf_total:,}",
        f"memory per GPU (busiest rank, {plan.layout.tokens:,} tokens per micro-batch):",
        f"  weights {gib(t.weights)}, grads {gib(t.grads)}, optimizer {gib(t.optimizer)}, "
        f"activations kept {gib(t.activations)}, one layer's backward {gib(t.working)}, "
        f"logits {gib(t.logits)}, overhead {gib(t.overhead)}",
        *_extra_terms(t, gib),
        f"  training {gib(t.total)}"
        + (f" + vLLM reserved {gib(plan.vllm.reserved)}" if plan.vllm else "")
        + f" = {gib(plan.gpu_total)} of {gib(memory.H100_USABLE_BYTES)} usable: fits",
    ]
    return "\n".join(lines)


# ---- internals -----------------------------------------------------------------------------
def _extra_terms(t: memory.TrainMemory, gib) -> list[str]:
    """The busiest rank's rollout / reference / weight-sync terms, on a line of their own when
    any is present."""
    kv = "KV cache" + (" (beside training)" if t.kv_beside_training else "")
    terms = [
        ("reference copy", t.reference),
        ("rollout weight copy", t.engine_copy),
        (kv, t.kv_cache),
        ("weight-sync sender", t.sender),
    ]
    shown = ", ".join(f"{name} {gib(b)}" for name, b in terms if b)
    return [f"  {shown}"] if shown else []


@contextlib.contextmanager
def _world_size(world: int):
    """WORLD_SIZE as torchrun sets it, for config validation only."""
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = old


def _write_hf_config(recipe: recipes.Recipe, directory: str) -> None:
    """The stand-in model folder: the recipe's config.json and, because the recipe configs use the
    model folder's own tokenizer, the tokenizer parts of its family (every shipped recipe is an
    R1-Distill model: the parts in the repository's data/tokenizers are that tokenizer's)."""
    (Path(directory) / "config.json").write_text(json.dumps(recipe.shape.hf_config()))
    for part in find_data(Path("tokenizers") / R1_DISTILL).iterdir():
        shutil.copy(part, directory)


def _build_shards(model_cfg, world: int, dp: int) -> list[RankShard]:
    """Build every (TP, PP) rank of data-parallel replica 0 on meta under a fake process group."""
    with warnings.catch_warnings():  # megatron's notices about missing GPU libraries
        warnings.simplefilter("ignore")
        return _build_shards_quietly(model_cfg, world, dp)


def _build_shards_quietly(model_cfg, world: int, dp: int) -> list[RankShard]:
    # lazy: keeps launch.plan free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    # lazy: keeps launch.plan free of megatron-core at import (start-up)
    from megatron_ngrpo.compat import cpu as cpu_compat

    if not torch.cuda.is_available():
        cpu_compat.install()
    tp, pp = model_cfg.tensor_parallel, model_cfg.pipeline_parallel
    shards = []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            # megatron's default rank order tp-cp-ep-dp-pp: DP rank 0 of (tp_rank, pp_rank).
            rank = tp_rank + tp * dp * pp_rank
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            try:
                # megatron's gloo side groups are not implemented by the fake backend.
                ps.initialize_model_parallel(
                    tp, pp, model_cfg.virtual_pipeline, create_gloo_process_groups=False
                )
                assert (
                    ps.get_tensor_model_parallel_rank(),
                    ps.get_pipeline_model_parallel_rank(),
                ) == (tp_rank, pp_rank), "unexpected megatron rank order"
                # init_weights: only megatron's initialisation marks weights TP-sharded.
                with torch.device("meta"):
                    chunks = [unwrap(c) for c in build_model(model_cfg, init_weights=True)]
                shards.append(_shard(rank, tp_rank, pp_rank, chunks))
            except (AssertionError, RuntimeError, ValueError) as e:
                raise PlanError(
                    f"TP {tp} × PP {pp} rank {rank}: megatron cannot build it: "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                ) from None
            finally:
                ps.destroy_model_parallel()
                dist.destroy_process_group()
    return shards


def _shard(rank: int, tp_rank: int, pp_rank: int, chunks: list) -> RankShard:
    params = counted = 0
    layers = []
    for c in chunks:
        numbers = [layer.layer_number for layer in c.decoder.layers]
        if numbers:
            layers.append((min(numbers), max(numbers)))
        for p in c.parameters():
            params += p.numel()
            if getattr(p, "shared", False):  # the last stage's copy of a tied embedding
                continue
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                counted += p.numel()
    return RankShard(rank, tp_rank, pp_rank, params, counted, tuple(layers))


def _check_counts(plan: LayoutPlan, cfg) -> None:
    spec = plan.recipe.spec
    if plan.built_total != plan.hf_total:
        raise PlanError(
            f"megatron builds {plan.built_total:,} parameters (Σ over TP×PP, padding removed), "
            f"the HF config has {plan.hf_total:,}"
        )
    for s in plan.shards:
        expected = memory.stage_params(
            spec, plan.tp, plan.pp, s.pp_rank, cfg.model.make_vocab_size_divisible_by
        )
        if s.params != expected:
            raise PlanError(
                f"rank {s.rank} holds {s.params:,} parameters, the memory model expects {expected:,}"
            )
