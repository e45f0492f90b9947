"""Running the CLI in-process, as the CLI tests and the serve tests do, and reading what it writes."""

import json
from pathlib import Path

from runtime.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("runtime: error:")]
    assert len(lines) == 1, err
    return lines[0]


def read_trace(path: Path) -> list[dict]:
    """A `--trace-jobs` file as a viewer reads it: a JSON array whose closing bracket may be missing."""
    text = path.read_text().rstrip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")
