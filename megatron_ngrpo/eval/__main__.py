"""`python -m megatron_ngrpo.eval --config FILE.yaml [a.b=c ...]`: evaluate a policy, or re-grade.

The policy comes from ``conversion.loading.build_policy`` (a Megatron checkpoint, or the HF weights in
model.hf_path) and the engine from ``rollout.factory.build_engine`` (rollout.engine: megatron | vllm). Under torchrun the problems are split
over the data-parallel ranks (each model-parallel group generates its share, the graded records
are gathered) and only rank 0 writes the outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from megatron_ngrpo import pins
from megatron_ngrpo.architecture import ArchSpec
from megatron_ngrpo.config_loader import ConfigError, load
from megatron_ngrpo.conversion import safetensors_header
from megatron_ngrpo.conversion.mapping import ConversionError
from megatron_ngrpo.data.tokenizer import load_tokenizer, special_token_ids
from megatron_ngrpo.eval.config import EvalConfig
from megatron_ngrpo.eval.report import to_markdown
from megatron_ngrpo.eval.result import EvalResult
from megatron_ngrpo.eval.runner import (
    check_prompt_lengths,
    eval_mixing,
    evaluate,
    load_benchmarks,
    regrade,
)
from megatron_ngrpo.models.config import real_token_count
from megatron_ngrpo.parallel import init_distributed
from megatron_ngrpo.rewards.graders import build_grader
from megatron_ngrpo.rollout.config import EngineName, vllm_max_model_len
from megatron_ngrpo.rollout.types import SamplingParams


def build_graders(reward_cfg) -> dict:
    """Kind → grader: math benchmarks get the math grader, mcq ones the letter grader."""

    return {
        kind: build_grader(dataclasses.replace(reward_cfg, name=kind)) for kind in ("math", "mcq")
    }


def _generate_and_grade(cfg: EvalConfig, graders: dict) -> EvalResult | int:
    """Generate with the evaluated policy on every rank and grade: the result on rank 0, exit
    status 0 on the others, 2 for a benchmark row the engine cannot take (one line, before any
    process group starts)."""
    # lazy: keeps eval.__main__ free of megatron-core at import (start-up)
    from megatron.core import parallel_state as ps

    # lazy: megatron-core again (conversion.loading, rollout.factory import it)
    from megatron_ngrpo.conversion.loading import build_policy
    from megatron_ngrpo.rollout.factory import build_engine

    tokenizer = load_tokenizer(cfg.tokenizer, cfg.model.hf_path)
    spec = ArchSpec.from_hf(cfg.model.hf_path)
    try:
        benchmarks = load_benchmarks(list(cfg.benchmarks) + list(cfg.extra_benchmarks), cfg.limit)
        check_prompt_lengths(benchmarks, tokenizer, cfg.template, *prompt_budget(cfg, spec))
        check_device(cfg)
    except (ConfigError, ConversionError) as e:  # before any process group starts
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_distributed(cfg.dist_timeout_s)
    try:
        chunks = build_policy(cfg.model, cfg.checkpoint)
    except ConversionError as e:  # a corrupt checkpoint or weights file, named
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = build_engine(cfg, chunks, tokenizer)
    num_real = real_token_count(cfg.model.num_real_tokens, spec.vocab_size, tokenizer)
    params = SamplingParams.from_config(cfg.sampling, tokenizer.eos_token_id)
    # auto's cost rule: the decode positions of this DP rank's share of every benchmark
    problems = -(-sum(len(b.problems) for b in benchmarks) // ps.get_data_parallel_world_size())
    positions = problems * params.n * params.max_new_tokens
    special = special_token_ids(tokenizer)
    mixing = eval_mixing(cfg.mixing, engine, chunks, num_real, special, positions=positions)
    is_main = int(os.environ.get("RANK", "0")) == 0
    result = evaluate(
        engine,
        tokenizer,
        benchmarks,
        params,
        graders,
        template=cfg.template,
        ks=cfg.ks or None,
        out_dir=cfg.output_dir if is_main else None,
        max_tokens_per_call=cfg.max_tokens_per_call,
        dp_group=ps.get_data_parallel_group(),
        progress=is_main,
        mixing=mixing,
    )
    return result if is_main else 0


def check_device(cfg: EvalConfig) -> None:
    """The trainer's pre-flight for an eval job, before any process group: vLLM's version where
    the engine is vLLM, and every safetensors file of ``model.hf_path`` readable (one line)."""
    if cfg.rollout.engine == EngineName.vllm and (problem := pins.vllm_mismatch()):
        raise ConfigError(f"config field 'rollout.engine' = 'vllm': {problem}")
    if problems := safetensors_header.directory_problems(cfg.model.hf_path):
        raise ConversionError(problems[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ngrpo.eval", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--config", action="append", default=[], help="YAML file (repeatable, later wins)"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sampling.n=4")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    try:
        cfg = load(EvalConfig, args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    graders = build_graders(cfg.reward)
    try:
        if cfg.regrade:
            result = regrade(cfg.regrade, graders, ks=cfg.ks or None, out_dir=cfg.output_dir)
        else:
            result = _generate_and_grade(cfg, graders)
            if not isinstance(result, EvalResult):
                return result  # an exit status: a bad row, or a rank other than 0
    finally:
        for grader in graders.values():
            grader.close()
    print(to_markdown(result))
    print(f"outputs: {cfg.output_dir}")
    return 0


def prompt_budget(cfg: EvalConfig, spec) -> tuple[int, str]:
    """The longest prompt the engine can take with room for ``sampling.max_new_tokens``, and
    where that comes from."""
    if cfg.rollout.engine == EngineName.vllm:
        context = vllm_max_model_len(cfg.rollout.vllm, spec.max_position_embeddings)
        source = "rollout.vllm.max_model_len"
    else:
        context, source = spec.max_position_embeddings, "the model's max_position_embeddings"
    new = cfg.sampling.max_new_tokens
    return context - new, f"{source} {context} - sampling.max_new_tokens {new}"


if __name__ == "__main__":
    sys.exit(main())
