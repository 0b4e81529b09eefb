"""``python -m megatron_ngrpo.train --config FILE.yaml [a.b=c ...]`` (under torchrun for more
than one process): N-GRPO training.

The configuration is loaded and checked before any process group starts; a bad value exits with
status 2 and one line naming the field; dynamic sampling running out of informative groups
(``on_exhausted: error``) exits with status 3 and one line.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_ngrpo.config_loader import ConfigError
from megatron_ngrpo.grpo.dynamic_sampling import DynamicSamplingExhausted


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

    trainer = Trainer(cfg)
    try:
        trainer.setup()
    except ConfigError as e:  # the data (DataError): checked before any process group starts
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.run()
    except DynamicSamplingExhausted as e:  # raised on every rank (the count is all-reduced)
        print(f"error: {e}", file=sys.stderr)
        return 3
    # lazy: keeps train free of torch at import (start-up)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
