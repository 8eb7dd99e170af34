"""The `runlm` command's entry point. `runlm generate --lean`, `runlm chat --lean` and `runlm serve --lean` go to
runlm.lean before anything imports PyTorch (runlm.cli does, for everything it serves); every other command goes to
runlm.cli."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["generate"], ["chat"], ["serve"]) and "--lean" in args[1:]:
        from runlm.lean.cli import main as lean_main

        return lean_main(args)
    from runlm.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
