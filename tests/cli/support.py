"""Running the CLI in-process for the CLI tests."""

from __future__ import annotations

import pytest

from tslice.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``tslice ARGS`` in this process: its exit code, stdout and stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main.main(list(args))
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (code if isinstance(code, int) else 0), out, err
