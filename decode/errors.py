"""Command-line error handling: user mistakes print one clear line instead of a traceback.

Damaged or unwritable files are turned into one-line errors where they are opened (`read_json`,
`load_safetensors`, `writing`, `check_out_dir`), so the message names the file and what to do.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, KeyError)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: a file-size limit (ulimit -f) reads the same
TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}  # for messages


class UserError(ValueError):
    """A bad input file or an unwritable output the message explains (run_cli prints it, exit 2)."""


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a CLI main; a user error exits 2 with `error: ...` (DRAFTSMITH_DEBUG=1 shows the traceback)."""
    try:
        return main(argv)
    except USER_ERRORS as e:
        if os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


def read_json(path: str | os.PathLike, fix: str) -> Any:
    """A JSON file's content; bad JSON is a UserError naming the file, the line and `fix` (what to do)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}); {fix}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text (UTF-8) file; {fix}") from None


def load_safetensors(path: str | os.PathLike, fix: str, device: str = "cpu") -> dict:
    """safetensors.torch.load_file, a truncated or corrupt file being a UserError naming it and `fix`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({one_line(e)}); {fix}") from None


def missing_target(path: str | os.PathLike, fetch: str = "smollm2-135m-instruct") -> bool:
    """True, with one `error:` line on stderr, when the target directory a script needs is not there (the chat
    target is fetched, never committed); scripts return 2 on it before loading anything."""
    if Path(path).is_dir():
        return False
    print(f"error: target {path} not found; run `draftsmith fetch {fetch}` first", file=sys.stderr)
    return True


def one_line(e: BaseException) -> str:
    """An exception's message on one line (safetensors and yaml errors span several)."""
    return " ".join(str(e).split()) or type(e).__name__


def check_out_dir(path: str | os.PathLike, option: str = "--out") -> None:
    """Fail now, before any work, if `path` cannot become a directory we write in (nothing is created)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{option} {p} is a file, not a directory: give a directory path")
    base = p
    while not base.exists():  # the nearest existing ancestor is where the first write will happen
        base = base.parent
    if not base.is_dir():
        raise UserError(f"{option} {p}: {base} is a file, not a directory; give a path under a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".draftsmith-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(
            f"{option} {p}: cannot write in {base} ({e.strerror}); point {option} at a directory you can write"
        ) from None


@contextlib.contextmanager
def writing(path: str | os.PathLike, option: str = "--out") -> Iterator[None]:
    """Turn an OSError while writing under `path` (a full disk, no permission) into a UserError naming it."""
    try:
        yield
    except OSError as e:
        if e.errno in DISK_FULL:
            raise UserError(
                f"{option} {path}: disk full ({e.strerror}); nothing was written: free some space or "
                f"point {option} at another disk"
            ) from None
        raise UserError(
            f"{option} {path}: cannot write ({e.strerror or e}); point {option} at a directory you can write"
        ) from None
