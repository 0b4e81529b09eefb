"""``python -m megatron_ngrpo.train --config FILE.yaml [a.b=c ...]`` (under torchrun for more
than one process): N-GRPO training.

The configuration is loaded and checked before any process group starts; a bad value exits with
status 2 and one line naming the field; dynamic sampling running out of informative groups
(``on_exhausted: error``) exits with status 3 and one line. A planned stop (SIGUSR1/SIGTERM or
the allocation's deadline, training/stop.py) saves and exits with status 75 (run again to
continue); a complete run exits 0. Each exit after the trainer is built appends a line to
``run_dir/allocations.jsonl``. torchrun turns a worker's 75 into its own 1:
``python -m megatron_ngrpo.launch.torchrun`` (torchrun's options) keeps it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.grpo.dynamic_sampling import DynamicSamplingExhausted
from megatron_ngrpo.training import outcome


class HeadEveryLine(logging.Formatter):
    """Repeats a record's header (time, level, logger) on each line of a multi-line message
    (megatron-core logs its gradient buckets' parameter lists as one record), so that a reader of
    the job's log knows every line's level and source: the local launcher's terminal view leaves
    out megatron-core's INFO lines by their header (launch/experiment.py ``QuietLog``)."""

    def format(self, record: logging.LogRecord) -> str:
        first, *rest = super().format(record).split("\n")
        head = first[: first.index(": ") + 2]  # "<time> <LEVEL> <logger>: "
        return "\n".join([first, *(head + line for line in rest)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ngrpo.train", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="YAML file (repeatable; later files override earlier ones)",
    )
    parser.add_argument("overrides", nargs="*", metavar="a.b=c", help="dotted config overrides")
    args = parser.parse_args(argv)
    # lazy: keeps train free of torch at import (start-up)
    from megatron_ngrpo.training.job_config import check_device, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        check_device(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    handler = logging.StreamHandler()
    handler.setFormatter(HeadEveryLine("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    # lazy: keeps train free of megatron-core, torch at import (start-up)
    from megatron_ngrpo.training.trainer import Trainer

    return _train(Trainer(cfg))


def _train(trainer) -> int:
    """Set up and run ``trainer``; its exit status, recorded in ``allocations.jsonl``."""
    # lazy: keeps train free of torch at import (start-up)
    import torch.distributed as dist

    # lazy: keeps train free of torch at import (start-up)
    from megatron_ngrpo.training.stop import EXIT_CONTINUE, error_reason

    code, reason = 0, "done"
    try:
        trainer.setup()  # the data and run directory (ConfigError): before process groups
        trainer.run()
        if trainer.stopped:
            code, reason = EXIT_CONTINUE, trainer.stopped
    except (ConfigError, DynamicSamplingExhausted) as e:  # raised on every rank
        print(f"error: {e}", file=sys.stderr)
        code, reason = (2 if isinstance(e, ConfigError) else 3), error_reason(e)
        return code
    except BaseException as e:
        code, reason = 1, error_reason(e)
        raise
    finally:
        trainer.stop.record(trainer.cfg.train.run_dir, reason, code)
        outcome.write(code)  # for launch/torchrun.py: torchrun itself would say 1
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
