"""Every process group a training job makes times out after the job's ``dist_timeout_s``
(tests/test_parallel.py; NGRPO_TEST_PG_TIMEOUT is that timeout): the default group, megatron's
(model-parallel, data-parallel incl. its gloo twins), the one-step-off producer's duplicates, and
the rollout client's gloo group (made before it looks for servers, here none), and both members of
a weight-transfer pair group (the gloo route's trainer sender and the vLLM worker it reaches)."""

from __future__ import annotations

import torch.distributed as dist

from tests.harness.multiproc import case, group_timeouts, run_cases


@case
def every_group_gets_the_job_timeout():
    from megatron_ngrpo.architecture import ArchSpec
    from megatron_ngrpo.parallel import (
        duplicate_model_parallel_groups,
        free_port,
        initialize_model_parallel,
    )
    from megatron_ngrpo.rollout.config import RemoteConfig
    from megatron_ngrpo.rollout.remote.client import RemoteEngine, RolloutServerError
    from tests.harness.tiny import tiny_hf_config

    initialize_model_parallel(1, 2)
    duplicate_model_parallel_groups()
    before = len(dist.distributed_c10d._world.pg_map)
    spec = ArchSpec.from_dict(tiny_hf_config())
    url = f"http://127.0.0.1:{free_port()}"
    try:
        RemoteEngine(RemoteConfig(urls=[url], start_timeout_s=1), spec, 64)
    except RolloutServerError:
        pass
    assert len(dist.distributed_c10d._world.pg_map) == before + 1, (
        "the rollout client made no group"
    )
    return {**group_timeouts(), **weight_transfer_pair_timeouts()}


def weight_transfer_pair_timeouts() -> dict[str, float]:
    """A sender built as the engines build theirs (no timeout given), and the worker's side of its
    pair group, joined from the init info the sender hands it."""
    from vllm.distributed.weight_transfer import factory

    from megatron_ngrpo.rollout.vllm.weight_transfer import WeightSender, _pair_group, register

    worker = {}

    class Worker:
        def init_weight_transfer_engine(self, info: dict) -> None:
            worker["group"] = _pair_group(
                info["host"], info["port"], 1, info["timeout_s"], info["key"]
            )

    sender = WeightSender(Worker(), "gloo", 2**20)
    register()
    engine = factory.WeightTransferTrainerFactory.trainer_init(
        sender._init_info(), client=sender.client
    )
    return {
        f"weight-transfer pair ({side})": group.options._timeout.total_seconds()
        for side, group in (("trainer", engine.group), ("worker", worker["group"]))
    }


if __name__ == "__main__":
    run_cases()
