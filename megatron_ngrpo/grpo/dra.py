"""DRA reward adjustment (DRA-GRPO paper, docs/ALGORITHM.md §7): r̃_i = r_i / (1 + Σ_{j≠i} s(o_i, o_j)),
s the cosine similarity of response embeddings, over each prompt's group (paper rule) or over the
whole local batch (DRA reference code).

The paper embeds responses with a sentence-embedding model (jina-embeddings-v2-small). Three
embedders are offered (``grpo.dra.embedder``):

* ``tfidf`` (default; :class:`TfidfEmbedder`): a hashed bag-of-word-n-grams TF-IDF vector of the
  response text. Needs nothing, costs milliseconds, but sees spelling, not meaning: a lexical
  stand-in for the paper's embedder. Written by hand (a dozen lines) because scikit-learn is not a
  dependency; the hash is ``zlib.crc32`` so vectors do not depend on Python's hash seed.
* ``policy_hidden`` (:class:`ResponseHiddenMeans`): the policy's own final hidden states (the
  output layer's input, after the final norm) mean-pooled over the response tokens, captured in
  the replay pass the trainer runs for the old log-probs (one extra forward-only pass when
  ``grpo.old_logprobs`` is not ``recompute``). No external weights; sees the model's meaning.
* ``local_model`` (:class:`LocalModelEmbedder`): a sentence-embedding model loaded from a local
  directory (``grpo.dra.model_path``; transformers ``AutoModel``, attention-masked mean pooling),
  e.g. a downloaded jina-embeddings-v2-small-en for the paper's setting.

Bound: similarities are clipped to [0, 1] before the sum, so the denominator is at least 1 and
the multiplier lies in [1/M, 1] (M the number of responses it spans): DRA only ever shrinks a
reward. (A floor of 1e-6 on the raw denominator let negative cosines of dense embeddings multiply
a reward by up to 10⁶.)
"""

from __future__ import annotations

import math
import re
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ngrpo.architecture import unwrap

_WORD = re.compile(r"\w+|[^\w\s]")


class TfidfEmbedder:
    """Hashed TF-IDF of word 1..``ngram``-grams in ``dim`` buckets; IDF over the texts of one
    call (smoothed: log((1+N)/(1+df)) + 1). Returns a sparse [N, dim] float64 tensor with
    L2-normalised rows."""

    def __init__(self, ngram: int = 2, dim: int = 2**18):
        self.ngram, self.dim = ngram, dim

    def _counts(self, text: str) -> dict[int, int]:
        words = _WORD.findall(text.lower())
        counts: dict[int, int] = {}
        for n in range(1, self.ngram + 1):
            for i in range(len(words) - n + 1):
                h = zlib.crc32(" ".join(words[i : i + n]).encode()) % self.dim
                counts[h] = counts.get(h, 0) + 1
        return counts

    def __call__(self, texts: list[str]) -> torch.Tensor:
        docs = [self._counts(t) for t in texts]
        df: dict[int, int] = {}
        for d in docs:
            for h in d:
                df[h] = df.get(h, 0) + 1
        n = len(docs)
        rows, cols, vals = [], [], []
        for i, d in enumerate(docs):
            vec = {h: c * (math.log((1 + n) / (1 + df[h])) + 1.0) for h, c in d.items()}
            norm = math.sqrt(sum(v * v for v in vec.values())) or 1.0
            for h, v in vec.items():
                rows.append(i)
                cols.append(h)
                vals.append(v / norm)
        return torch.sparse_coo_tensor(
            [rows, cols], vals, (n, self.dim), dtype=torch.float64, check_invariants=True
        ).coalesce()


def similarity(embeddings: torch.Tensor) -> torch.Tensor:
    """[N, N] float64 cosine similarities of the rows of a dense or sparse [N, d] tensor."""
    if embeddings.is_sparse:
        # One sparse × dense column at a time: never a dense [N, d] matrix.
        e = embeddings.double().coalesce()
        s = torch.stack(
            [
                torch.sparse.mm(e, e[i].to_dense().unsqueeze(1)).squeeze(1)
                for i in range(e.shape[0])
            ],
            dim=1,
        )
        norms = s.diagonal().sqrt().clamp(min=1e-12)
        return s / norms.unsqueeze(0) / norms.unsqueeze(1)
    e = F.normalize(embeddings.double(), dim=-1, eps=1e-12)
    return e @ e.t()


def dra_rewards(
    rewards: torch.Tensor, sim: torch.Tensor, groups: torch.Tensor | None
) -> torch.Tensor:
    """r / (1 + Σ_{j≠i} clip(s_ij, 0, 1)) with j over the group of i (``groups`` [N]) or over all
    rows (``groups`` None). Clipping makes the denominator ≥ 1: the multiplier is in [1/M, 1].
    Returns float32 [N]."""
    s = sim.double().clamp(0.0, 1.0)
    s.fill_diagonal_(0.0)
    if groups is not None:
        s = s * (groups.unsqueeze(0) == groups.unsqueeze(1))
    return (rewards.double() / (1.0 + s.sum(1))).float()


class ResponseHiddenMeans:
    """The policy's final hidden states mean-pooled over each response's tokens: [B, h] float32.

    A context manager around a forward pass of ``model_chunks`` over ``batch`` cut as
    :func:`~megatron_ngrpo.grpo.logprobs.batch_logprobs` cuts it with the same
    ``micro_batch_size`` and ``max_tokens`` (the replay pass of the old log-probs): a forward pre-hook on the last stage's output layer
    takes its input [s(/TP under sequence parallelism), b, h] per micro-batch (gathered over TP
    when sequence-parallel) and averages the columns holding response tokens
    (``offsets[r] ≤ col < lengths[r]``). Micro-batches arrive in plan order; calls beyond the
    plan's count (a later pass inside the context) are ignored. :meth:`means` returns the result
    on every rank (broadcast over the pipeline group), running a forward-only pass of its own if
    none was captured.
    """

    def __init__(self, model_chunks: list, batch, micro_batch_size: int, max_tokens: int = 0):
        # lazy: keeps grpo.dra free of megatron-core at import (start-up)
        from megatron_ngrpo.grpo.batches import MicroBatchPlan

        config = unwrap(model_chunks[0]).config
        if config.context_parallel_size > 1:
            raise NotImplementedError(
                "grpo.dra.embedder = policy_hidden: context parallelism is not supported"
            )
        self.chunks, self.batch = model_chunks, batch
        self.plan = MicroBatchPlan.make(model_chunks, batch, micro_batch_size, max_tokens)
        self._sequence_parallel = config.sequence_parallel
        self._micro_batches = None
        self._calls = 0
        self._out = torch.zeros(
            batch.num_rows, config.hidden_size, dtype=torch.float32, device=batch.tokens.device
        )
        self._handle = None

    def __enter__(self) -> ResponseHiddenMeans:
        # lazy: keeps grpo.dra free of megatron-core at import (start-up)
        from megatron.core import parallel_state as ps

        if ps.is_pipeline_last_stage(ignore_virtual=True) and self._calls == 0:
            self._micro_batches = self.plan.micro_batches(self.batch)
            self._handle = unwrap(self.chunks[-1]).output_layer.register_forward_pre_hook(
                self._hook
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module, args) -> None:
        if self._calls >= len(self.plan.groups):
            return
        rows, mb = self.plan.groups[self._calls], self._micro_batches[self._calls]
        self._calls += 1
        if not rows:
            return
        hidden = args[0].detach()
        if self._sequence_parallel:
            # lazy: keeps grpo.dra free of megatron-core at import (start-up)
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        hidden = hidden.transpose(0, 1).float()  # [b, s, h]
        cols = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        n = len(rows)
        resp = (
            (cols >= mb.offsets[:n, None].to(hidden.device))
            & (cols < mb.lengths[:n, None].to(hidden.device))
        ).float()
        pooled = (hidden[:n] * resp.unsqueeze(-1)).sum(1) / resp.sum(1, keepdim=True).clamp(min=1.0)
        self._out[torch.as_tensor(rows, device=self._out.device)] = pooled.to(self._out.device)

    def means(self) -> torch.Tensor:
        # lazy: keeps grpo.dra free of megatron-core at import (start-up)
        from megatron.core import parallel_state as ps

        # lazy: keeps grpo.dra free of megatron-core at import (start-up)
        from megatron_ngrpo.grpo.logprobs import forward_token_values

        captured = [self._calls >= len(self.plan.groups)]
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(
                captured,
                src=ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
        if not captured[0]:
            with self:
                forward_token_values(
                    self.chunks,
                    self.batch,
                    self.plan,
                    lambda mb, head: head.hidden.new_zeros((1,) + tuple(mb.tokens.shape)),
                )
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(
                self._out,
                src=ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
            )
        return self._out.cpu()


class LocalModelEmbedder:
    """A sentence-embedding model from a local directory: ``texts -> [N, d]`` float32, the
    attention-masked mean of the last hidden states (the pooling of jina/nomic/sentence-BERT
    models), ``max_length`` tokens per text, ``batch_size`` texts per forward. Loaded once,
    on CPU, with ``local_files_only`` (nothing is downloaded)."""

    def __init__(self, path: str, max_length: int = 512, batch_size: int = 16):
        # lazy: transformers takes seconds to import; only this path needs it
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.max_length, self.batch_size = max_length, batch_size

    def __call__(self, texts: list[str]) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    texts[i : i + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                hidden = self.model(**enc).last_hidden_state.float()
                mask = enc["attention_mask"].unsqueeze(-1).float()
                out.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0))
        return torch.cat(out) if out else torch.zeros(0, self.model.config.hidden_size)


def text_embedder(cfg):
    """The ``texts -> [N, d]`` embedder a DRAConfig names (``tfidf`` or ``local_model``)."""
    if cfg.embedder == "tfidf":
        return TfidfEmbedder(cfg.ngram, cfg.hash_dim)
    if cfg.embedder == "local_model":
        return LocalModelEmbedder(cfg.model_path, cfg.max_length)
    raise ValueError(f"grpo.dra.embedder {cfg.embedder!r} does not embed texts")
