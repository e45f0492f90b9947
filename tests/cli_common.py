"""Running the CLI in-process, as the CLI tests and the serve tests do."""

from runtime.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("runtime: error:")]
    assert len(lines) == 1, err
    return lines[0]
