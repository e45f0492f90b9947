"""The `runtime` command: its flags are parsed before the models' libraries load, so `--help` and a mistyped
flag answer at once; then `cli.py` runs the command."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.cli_parser import build_parser

    args = build_parser().parse_args(argv)
    from runtime import cli  # torch, transformers and the models' code

    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
