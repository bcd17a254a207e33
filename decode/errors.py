"""Command-line error handling: user mistakes print one clear line instead of a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, KeyError)


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a CLI main; a user error exits 2 with `error: ...` (DRAFTSMITH_DEBUG=1 shows the traceback)."""
    try:
        return main(argv)
    except USER_ERRORS as e:
        if os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
