"""``python -m tests.support.probed_eval [arguments of megatron_ngrpo.eval]``: the evaluation
entry point, then each rank writes the timeout of every process group it holds to
``$NGRPO_GROUP_TIMEOUTS.<rank>.json`` (the job's ``dist_timeout_s`` seen from the inside)."""

from __future__ import annotations

import json
import os
import sys

TIMEOUTS_VAR = "NGRPO_GROUP_TIMEOUTS"

if __name__ == "__main__":
    import torch.distributed as dist

    from megatron_ngrpo.eval.__main__ import main
    from tests.harness.multiproc import group_timeouts

    status = main(sys.argv[1:])
    if dist.is_initialized():
        path = f"{os.environ[TIMEOUTS_VAR]}.{dist.get_rank()}.json"
        with open(path, "w") as f:
            json.dump(group_timeouts(), f)
    sys.exit(status)
