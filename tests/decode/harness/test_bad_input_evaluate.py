"""The bad-input sweep (tests/bad_input.py) of `draftsmith evaluate`: prompt files that are not prompt files,
and an --out that cannot be written (a file, under a file, no permission, a full disk)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.bad_input import (
    Case,
    base_fixture,  # noqa: F401 - the `base` fixture (the shared inputs), found by name
    check_case,
    check_full_disk,
    lines,
    registrar,
)

CASES: dict[str, Case] = {}
FULL_DISK: dict[str, Case] = {}  # run under a small RLIMIT_FSIZE
case, full_disk = registrar(CASES), registrar(FULL_DISK)


def ev(base: Path, prompts: Path, out: Path, *opts: str) -> list[str]:
    """`draftsmith evaluate` of AR on a prompt file, 4 tokens a turn, no warm-up, into --out."""
    return [
        "evaluate",
        "--target",
        str(base / "target"),
        "--drafter",
        "ar",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "4",
        "--no-warmup",
        "--out",
        str(out),
        *opts,
    ]


# --- evaluate: prompt files and --out ------------------------------------------------------------


@case
def prompts_jsonl_first_line_not_json(tmp, base):
    p = lines(tmp, "p.jsonl", "What is 2+2?", '{"turns": 5}')
    return ev(base, p, tmp / "out"), r"p\.jsonl:1: not valid JSON .*one JSON object per line"


@case
def prompts_jsonl_turns_not_a_list(tmp, base):
    p = lines(tmp, "p.jsonl", '{"turns": 5}')
    return ev(base, p, tmp / "out"), r"p\.jsonl:1: 'turns' must be a non-empty list of non-empty strings"


@case
def prompts_jsonl_bad_later_line(tmp, base):
    p = lines(tmp, "p.jsonl", '{"prompt": "Once"}', '{"prompt": "Then",', '{"prompt": 3}')
    return ev(base, p, tmp / "out"), r"p\.jsonl:2: not valid JSON"


@case
def prompts_missing(tmp, base):
    return ev(base, tmp / "p.jsonl", tmp / "out"), r"prompt file not found: .*p\.jsonl"


@case
def prompts_not_utf8(tmp, base):
    p = tmp / "p.txt"
    p.write_bytes(b"Once upon\n\xff\xfe a time\n")
    return ev(base, p, tmp / "out"), r"p\.txt: not a UTF-8 text file"


@case
def auto_pass_s_not_positive(tmp, base):
    opts = ("--tree", "auto", "--auto-pass-s", "0")
    return ev(base, lines(tmp, "p.txt", "Once"), tmp / "out", *opts), r"--auto-pass-s must be > 0 seconds, got 0\.0"


@case
def evaluate_out_is_a_file(tmp, base):
    (tmp / "out").write_text("mine\n")
    return ev(base, lines(tmp, "p.txt", "Once"), tmp / "out"), r"--out .*out is a file, not a directory"


@case
def evaluate_out_under_a_file(tmp, base):
    (tmp / "f").write_text("mine\n")
    return ev(base, lines(tmp, "p.txt", "Once"), tmp / "f" / "out"), r"--out .*f/out: .*f is a file, not a directory"


@case
def evaluate_out_no_permission(tmp, base):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: a read-only mount shows the same message (see tests/bad_input.py)")
    (tmp / "ro").mkdir(mode=0o500)
    return ev(
        base, lines(tmp, "p.txt", "Once"), tmp / "ro" / "out"
    ), r"--out .*ro/out: cannot write in .*ro \(Permission denied\); point --out at a directory you can write"


@full_disk
def evaluate_out_disk_full(tmp, base):
    out = tmp / "out"
    out.mkdir()
    (out / "report.json").write_text('{"an earlier": "report"}\n')
    return ev(base, lines(tmp, "p.txt", "Once"), out), r"--out .*out: disk full .*nothing was written"


# --- the sweep over this file's cases ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, tmp_path, base, capsys):
    check_case(CASES[name], tmp_path, base, capsys)


@pytest.mark.parametrize("name", sorted(FULL_DISK))
def test_full_disk(name, tmp_path, base, capsys):
    """A full disk while writing --out (check_full_disk: a 16 KiB file-size limit)."""
    check_full_disk(FULL_DISK[name], tmp_path, base, capsys)
