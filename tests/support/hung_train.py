"""``python -m tests.support.hung_train [arguments of megatron_ngrpo.train]``: the training entry
point with one rank made to hang inside a collective (tests/test_watchdog.py).

``$NGRPO_HANG_AT`` = ``<rank>:<step>``: at the start of step ``<step>``'s rollout, rank ``<rank>``
enters a barrier on a gloo group that no other rank joins (every rank creates the group at set-up,
as groups must be). It blocks inside the collective, in C++ with the GIL released, as a rank whose
peer died or whose network hangs would; the other ranks go on to their next collective and wait
for it there. With ``$NGRPO_HANG_ONCE`` = a file, only the first process to create that file
hangs (a run resumed in a new allocation reaches the step again and goes on). Test-only: the
package holds no hook (tests/support/pace installs it in the real entry point's ranks).
"""

from __future__ import annotations

import datetime
import os
import sys

HANG_VAR, ONCE_VAR = "NGRPO_HANG_AT", "NGRPO_HANG_ONCE"


def _first_time() -> bool:
    """False when ``$NGRPO_HANG_ONCE`` names a file that already exists (else creates it)."""
    once = os.environ.get(ONCE_VAR)
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def hang_in_a_collective(rank: int, step: int) -> None:
    import torch.distributed as dist

    from megatron_ngrpo.training.rollout_stage import RolloutStage
    from megatron_ngrpo.training.trainer import Trainer

    init, rollout = Trainer._init_parallel, RolloutStage.next
    side: list = []

    def init_with_side_group(self) -> None:
        init(self)
        side.append(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600)))

    def next_or_hang(self, s: int, updates: int, total_steps: int):
        if dist.get_rank() == rank and s + 1 == step and _first_time():
            dist.barrier(group=side[0])  # nobody else comes: blocks for the group's 600 s
        return rollout(self, s, updates, total_steps)

    Trainer._init_parallel = init_with_side_group
    RolloutStage.next = next_or_hang


if __name__ == "__main__":
    from megatron_ngrpo.train import main

    if HANG_VAR in os.environ:
        hang_rank, hang_step = map(int, os.environ[HANG_VAR].split(":"))
        hang_in_a_collective(hang_rank, hang_step)
    sys.exit(main(sys.argv[1:]))
