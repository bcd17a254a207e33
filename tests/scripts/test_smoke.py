"""Scripts cannot rot: every script in scripts/ runs end to end at a tiny size (its own CLI flags), in process.

Each runs its `main()` with a patched argv (its row in tests/scripts/smoke_rows.py) against the bundled
stories260K target or the tiny random chat target, and must exit cleanly and print its row's line. The shell
scripts (demo: the long job; test: the suite itself; _env.sh) are only parsed (`bash -n`), and demo.py only
shows its help. A scripts/*.py without a `__main__` block is a module the scripts import (the learning curve's
points and plots, say): it is run through them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from tests.scripts.smoke_rows import REPO, ROWS, SHELL, scripts

# --- the tests ----------------------------------------------------------------------------------


def test_every_script_has_a_smoke_test():
    """A new script must get its row in smoke_rows.py (this fails until it does)."""
    missing = [name for name in scripts() if name not in ROWS]
    shell = sorted(p.name for p in (REPO / "scripts").iterdir() if p.suffix != ".py")
    assert not missing and shell == sorted(SHELL), (missing, shell)


@pytest.mark.parametrize("name", scripts())
def test_script_runs_at_a_tiny_size(name, tmp_path, chat_target_dir, monkeypatch, capsys):
    argv, expect = ROWS[name](tmp_path, chat_target_dir)
    spec = importlib.util.spec_from_file_location(f"_smoke_{name.removesuffix('.py')}", REPO / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    threads = torch.get_num_threads()
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    monkeypatch.setattr(sys, "argv", [name, *argv])
    monkeypatch.chdir(REPO)
    try:
        spec.loader.exec_module(module)  # importing it: a stale import fails here
        try:
            rc = module.main()
        except SystemExit as e:  # argparse --help, or a script's own exit
            rc = e.code
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc in (0, None), out[-2000:]
    assert expect in out, out[-2000:]


@pytest.mark.parametrize("name", SHELL)
def test_shell_script_parses(name):
    res = subprocess.run(["bash", "-n", str(REPO / "scripts" / name)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
