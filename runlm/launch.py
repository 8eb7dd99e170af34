"""The `runlm` command's entry point. `runlm generate`, `runlm chat` and `runlm serve` go to runlm.native first, before
anything imports PyTorch: they run there (in a process without it) unless --torch is given, a flag or the model
needs the PyTorch path, or a GPU is there for it (runlm.native.cli.runs_lean). Everything else goes to runlm.cli."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["generate"], ["chat"], ["serve"]):
        from runlm.native.cli import main as lean_main

        status = lean_main(args)
        if status is not None:
            return status
    from runlm.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
