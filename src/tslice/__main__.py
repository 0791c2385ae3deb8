"""``python -m tslice``: the command-line interface."""

from __future__ import annotations

from tslice.cli import main

if __name__ == "__main__":
    main.main()
