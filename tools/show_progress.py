"""``CMD 2>&1 | python3 tools/show_progress.py LOG``: keeps all of a command's output in LOG and
shows only its tqdm progress bars on the terminal, each redrawn in place on one line (the quiet
stages of scripts/smollm2.sh: vLLM, megatron-core and the training loop log hundreds of lines).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import BinaryIO

# A whole tqdm redraw, e.g. "train:  50%|█████     | 1/2 [04:24<04:24, 264s/step, reward=0.17]";
# what follows it on the same line (another process's output) is not part of it.
BAR = re.compile(rb"[^\s:][^:\r\n]{0,80}: +\d+%\|[^|\r\n]*\| *\S+ \[[^\]\r\n]*\]")


def follow(source: BinaryIO, log: BinaryIO, terminal: BinaryIO) -> None:
    """Copy ``source`` to ``log`` as it arrives; write its progress-bar redraws to ``terminal``
    (a carriage return before each, a newline when the bar's description changes and at the end).
    A redraw at the end of a chunk is shown at once: tqdm writes one whole redraw per update, with
    no newline until the bar closes."""
    pending, shown = b"", None

    def show(part: bytes) -> None:
        nonlocal shown
        bar = BAR.match(part)
        if not bar:
            return
        desc = part.split(b":", 1)[0]
        if shown is not None and desc != shown:
            terminal.write(b"\n")
        terminal.write(b"\r" + bar.group())
        terminal.flush()
        shown = desc

    for chunk in iter(lambda: source.read1(1 << 16), b""):
        log.write(chunk)
        log.flush()
        *parts, pending = re.split(rb"[\r\n]", pending + chunk)
        for part in parts:
            show(part)
        show(pending)
    if shown is not None:
        terminal.write(b"\n")
        terminal.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="file that keeps the whole output (appended to)")
    args = parser.parse_args(argv)
    with open(args.log, "ab") as log:
        follow(sys.stdin.buffer, log, sys.stdout.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
