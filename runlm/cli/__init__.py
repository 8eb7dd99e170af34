"""The `runlm` command: `commands` (the subcommands and their parser) and `args` (their shared arguments, the chat
loop, exit codes). `main` is the console script's entry; importing this package does not import PyTorch."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from runlm.cli.commands import main as run_command

    return run_command(list(sys.argv[1:] if argv is None else argv))


__all__ = ["main"]
