"""Bad input, swept: every CLI meets damaged files, malformed records, nonsense options and unwritable or
full outputs the way a user would hand them over. This module is the sweep's machinery; its cases live
beside the tests of the code they exercise (tests/test_bad_input.py lists the files).

Each case builds one bad input under tmp_path and runs the command as `draftsmith CMD ...` does
(decode.cli.main, in-process; a file-size limit stands in for a full disk). It must
exit 2 with ONE `error: ...` line that names the file (and line) or the option, no traceback, and leave
every file on disk as it was (no half-written output, earlier outputs untouched).

Checked by hand as root, where chmod cannot take write permission away: --out or run_dir on a read-only
tmpfs gives `error: --out DIR: cannot write in MOUNT (Read-only file system); point --out at a directory you
can write`, and a full 64 KiB tmpfs gives `error: --out DIR: disk full (No space left on device); nothing
was written: ...` with the earlier report.json intact.

A test file of the sweep keeps its cases in a table filled by a decorator, and checks each:

    from tests.bad_input import Case, base_fixture, check_case, registrar  # base_fixture: the `base` fixture

    CASES: dict[str, Case] = {}
    case = registrar(CASES)

    @case
    def truncated_target_weights(tmp, base): ...

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_bad_input(name, tmp_path, base, capsys):
        check_case(CASES[name], tmp_path, base, capsys)
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import resource
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode.cli import main as draftsmith
from tests.conftest import STORIES

# id -> build(tmp, base) -> (argv of `draftsmith`, regex the error line must match)
Case = Callable[[Path, Path], tuple[list[str], str]]


def registrar(table: dict[str, Case]) -> Callable[[Case], Case]:
    """A decorator that files a case's build function in `table` under the function's name."""

    def case(fn: Case) -> Case:
        table[fn.__name__] = fn
        return fn

    return case


# --- shared inputs (built once; cases copy what they damage) ------------------------------------


@pytest.fixture(scope="session", name="base")
def base_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`base`: target/ (the bundled stories target), eagle1/ (a native checkpoint for it), data.jsonl, a
    feature cache and a training run with a checkpoint."""
    return build_base(tmp_path_factory.getbasetemp())


# pytest sets an imported fixture up once per file that imports it, even one of the widest scope: keyed by the
# test run's temp dir, the ~8 s build happens once for the whole sweep
@functools.cache
def build_base(run_tmp: Path) -> Path:
    from decode.target import Target
    from drafters.serving.checkpoint import new_drafter, save_drafter

    root = run_tmp / "bad_input_base"
    root.mkdir()
    shutil.copytree(STORIES, root / "target")
    torch.manual_seed(0)
    save_drafter(
        new_drafter("eagle1", Target.load(root / "target"), {}), root / "eagle1", target_id=str(root / "target")
    )
    stories = [
        " ".join(["Tom had a red ball and he liked to play with it in the park."] * (1 + i % 3)) for i in range(24)
    ]
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in stories))
    (root / "recipe.yaml").write_text(f"target: {root / 'target'}\n")
    assert draftsmith(["features", str(root / "recipe.yaml"), *train_overrides(root, root / "run")]) == 0
    assert draftsmith(["train", str(root / "recipe.yaml"), *train_overrides(root, root / "run")]) == 0
    assert (root / "run" / "checkpoints" / "step_2" / "model.safetensors").is_file()
    return root


def train_overrides(base: Path, run_dir: Path, **extra: str) -> list[str]:
    """A 2-step eagle1 recipe on data.jsonl (offline features, a checkpoint at step 2)."""
    kw = {
        "run_dir": str(run_dir),
        "data.source": str(base / "data.jsonl"),
        "data.max_length": "24",
        "data.held_out": "0.2",
        "drafter.kind": "eagle1",
        "features.dtype": "fp32",
        "features.cache_dir": str(base / "cache"),
        "train.steps": "2",
        "train.batch_size": "4",
        "train.save_every": "2",
        "train.eval_every": "0",
        "train.eval_batches": "1",
        "train.report_to": "none",
        "train.threads": "1",
        **extra,
    }
    return [f"{k}={v}" for k, v in kw.items()]


def gen(base: Path, *opts: str, drafter: str = "ar", target: Path | None = None) -> list[str]:
    """`draftsmith generate` of 4 tokens after "Once" (AR unless a drafter is given), with extra options."""
    return [
        "generate",
        "--target",
        str(target or base / "target"),
        "--drafter",
        drafter,
        "--prompt",
        "Once",
        "--max-new-tokens",
        "4",
        *opts,
    ]


# --- ways to damage a file ----------------------------------------------------------------------


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def rewrite_json(path: Path, edit: Callable[[dict], None]) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def retensor(path: Path, edit: Callable[[dict], None]) -> None:
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def lines(tmp: Path, name: str, *rows: str) -> Path:
    p = tmp / name
    p.write_text("".join(r + "\n" for r in rows))
    return p


# --- the check ----------------------------------------------------------------------------------


def snapshot(*roots: Path) -> dict[str, str]:
    """Every file and directory under roots: path -> size and content hash (or 'dir')."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            out[str(p)] = "dir" if p.is_dir() else f"{p.stat().st_size}:{hashlib.sha1(p.read_bytes()).hexdigest()}"
    return out


def changed(before: dict[str, str], after: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """The paths whose snapshot differs: path -> (before, after), None where absent. (This module's asserts are
    not rewritten by pytest, so a failed one says what it saw through its message.)"""
    return {
        k: (before.get(k), after.get(k)) for k in sorted(before.keys() | after.keys()) if before.get(k) != after.get(k)
    }


def check_error(rc: int, err: str, want: str) -> None:
    """Exit status 2 and stderr ending in one `error:` line that matches `want`, with no traceback."""
    assert rc == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "\n" not in errors[0], err
    assert err.strip().splitlines()[-1] == errors[0], err  # the error is the last word
    assert re.search(want, errors[0]), f"{want!r} not in {errors[0]!r}"


def check_case(
    build: Case,
    tmp_path: Path,
    base: Path,
    capsys: pytest.CaptureFixture[str],
    may_change: Iterable[str] = (),
    may_stamp: Iterable[str] = (),
) -> None:
    """One case: the command is refused (check_error) and no file on disk changes, except the files of
    `may_change` (relative to tmp_path) and `may_stamp` (relative to the shared inputs)."""
    argv, want = build(tmp_path, base)
    before = snapshot(tmp_path, base)
    capsys.readouterr()
    rc = draftsmith(argv)
    check_error(rc, capsys.readouterr().err, want)
    after = snapshot(tmp_path, base)
    for rel in may_change:
        before.pop(str(tmp_path / rel)), after.pop(str(tmp_path / rel))
    for rel in may_stamp:
        before.pop(str(base / rel), None), after.pop(str(base / rel))
    assert after == before, changed(before, after)


def check_full_disk(build: Case, tmp_path: Path, base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk while writing --out, simulated by a 16 KiB file-size limit (writes fail with EFBIG, which
    reads as ENOSPC does; Python ignores SIGXFSZ). The limit is lifted again right after the command."""
    argv, want = build(tmp_path, base)
    before = snapshot(tmp_path, base)
    capsys.readouterr()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, hard))
    try:
        rc = draftsmith(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    check_error(rc, capsys.readouterr().err, want)
    after = snapshot(tmp_path, base)
    assert after == before, changed(before, after)
