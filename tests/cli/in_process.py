"""Running the `kvrelay` CLI in the test's own process."""

from __future__ import annotations

from kvrelay.cli.main import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """`kvrelay ARGV` in-process: (exit code, stdout, stderr); usage errors exit via SystemExit."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err
