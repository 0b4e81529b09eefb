"""What a rollout server passes through to ``vllm serve`` (its unknown arguments, from
``ngrpo-launch run --rollout-args``): everything but the options the colocated engine refuses
(rollout/config.py ``VLLMConfig.validate``, training/job_config.py ``check_not_run``) and those the
server sets for the mixing hook. Checked by the launcher before a job is planned
(launch/recipes.py ``rollout_server``) and by the server before vLLM starts, one line each.
No heavy import: the launcher's start-up stays quick."""

from __future__ import annotations

from collections.abc import Sequence

_QUANTIZED = (
    "no weight-sync round trip verifies quantized rollout weights yet (the colocated engine "
    "refuses rollout.vllm.quantization for the same reason)"
)
_GRAPHS = "CUDA graphs and compilation bypass the mixing hook (as rollout.vllm.enforce_eager)"
_HOOK = "set by the server for the mixing hook and the replay's exact log-probs"

# vLLM option (dashes; vLLM also reads underscores) -> why a server refuses it.
REFUSED = {
    "--quantization": _QUANTIZED,
    "-q": _QUANTIZED,
    "--kv-cache-dtype": _QUANTIZED,
    "--no-enforce-eager": _GRAPHS,
    "--compilation-config": _GRAPHS,
    "-O": _GRAPHS,
    "--enable-prefix-caching": _HOOK,
    "--async-scheduling": _HOOK,
    "--logprobs-mode": _HOOK,
    "--worker-extension-cls": _HOOK,
}


def refused_argument(argv: Sequence[str]) -> str | None:
    """One line naming the first option of ``argv`` that a rollout server refuses, or None."""
    for token in argv:
        if token.startswith("--"):
            name = token.split("=", 1)[0].replace("_", "-")
        elif token[:2] in ("-O", "-q"):  # short options take their value attached too
            name = token[:2]
        else:
            continue
        if name in REFUSED:
            return f"rollout server option {token!r} is refused: {REFUSED[name]}"
    return None
