"""The `runtime` command: its flags are parsed before the models' libraries load, so `--help` and a mistyped
flag answer at once; then `cli.py` runs the command."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

# the commands that run sessions, whose decode threads sleep at OpenMP's barriers instead of spinning
SESSIONS = ("serve", "demo", "ask", "transcribe")


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.cli_parser import build_parser

    args = build_parser().parse_args(argv)
    if args.command in SESSIONS:  # before torch loads: OpenMP reads it once (models/loading.py, `session_threads`)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from runtime import cli  # torch, transformers and the models' code

    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
