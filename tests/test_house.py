"""The house speaks only of itself: no tracked file names the work periods of the project's making.

Runs, curves and files are named by date and run name (`runs/2026-12-05-bench80`, `curves/2026-12-05-headline-
bench80.png`); the history of how a figure came about lives in git. A user cannot know what a period number
means, so neither the word for such a period nor a short `s` + number tag (as in a run directory named that way)
may come back, in a file's text or in its name. Exempt: third-party data (recipes/data/*.jsonl) and pytest's
fixture scope, which is pytest's own word.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORD = "sess" + "ion"  # spelled in two parts so that this file passes its own check
PERIOD = re.compile(rf"\b{WORD}s?\b", re.IGNORECASE)
# an s + 2-3 digit tag, alone or as a path part; not s0 (a variable), S506 (a lint rule), bf16
TAG = re.compile(r"(?<![\w.-])s\d{2,3}(?![\w])")
NAME_TAG = re.compile(r"(^|[-_/.])s\d{2,3}([-_/.]|$)")
PYTEST_SCOPE = re.compile(rf"""scope=["']{WORD}["']""")
EXEMPT = re.compile(r"^recipes/data/.*\.jsonl$")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.splitlines() if f and (REPO / f).is_file()]


def offending_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for each line that names a work period."""
    found = []
    for i, line in enumerate(text.splitlines(), 1):
        rest = PYTEST_SCOPE.sub("", line)
        if PERIOD.search(rest) or TAG.search(rest):
            found.append((i, line.strip()[:120]))
    return found


def test_the_checks_catch_what_they_are_for():
    assert offending_lines(f"trained in {WORD} 43") and offending_lines(f"{WORD.title()}s 28-45 built it")
    tag = "s" + "46"
    assert offending_lines(f"python -m train r.yaml run_dir=runs/{tag}/layerskip") and offending_lines(f"({tag})")
    assert not offending_lines(f'@pytest.fixture(scope="{WORD}")') and not offending_lines("# noqa: S506")
    assert not offending_lines("dtype bf16, md5s1, a 20 s pass, sha256") and not offending_lines("start_new_" + WORD)
    assert not offending_lines("(a0, s0), (a1, _), _ = plain.unroll(batch, 3)")
    assert NAME_TAG.search(f"curves/levers-{tag}.png") and not NAME_TAG.search("curves/2026-12-05-headline-bench80.png")


def test_no_file_names_a_work_period():
    bad = [f for f in tracked_files() if NAME_TAG.search(f) or PERIOD.search(f)]
    assert not bad, f"rename by date and run name: {bad}"


def test_no_file_text_names_a_work_period():
    bad = []
    for f in tracked_files():
        if EXEMPT.match(f):
            continue
        try:
            text = (REPO / f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # binary files (weights, plots)
            continue
        bad += [f"{f}:{i}: {line}" for i, line in offending_lines(text)]
    assert not bad, "name runs by date and run name, not by work period:\n" + "\n".join(bad[:40])
