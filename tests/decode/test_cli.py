"""The `draftsmith` console script dispatches to the module CLIs."""

from __future__ import annotations

import pytest

from decode.cli import COMMANDS, find_module, main


def test_usage_lists_every_command(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(f"python -m {m}" in out for m in COMMANDS.values())
    assert main(["--help"]) == 0


def test_unknown_command(capsys):
    assert main(["serve"]) == 2
    assert "unknown command 'serve'" in capsys.readouterr().err


def test_missing_module_is_not_yet_available(monkeypatch, capsys):
    monkeypatch.setitem(COMMANDS, "export", "drafters.no_such_module")
    assert main(["export", "x"]) == 1
    assert "not yet available" in capsys.readouterr().err
    assert find_module("no_such_package.mod") is None


@pytest.mark.parametrize("cmd", ["evaluate", "generate"])
def test_dispatch_runs_the_module_main(cmd, capsys):
    assert find_module(COMMANDS[cmd]) is not None
    assert main([cmd, "--help"]) == 0  # argparse exits 0 after printing the module's own help
    assert "--target" in capsys.readouterr().out


def test_dispatch_passes_exit_codes(capsys):
    assert main(["evaluate", "--target", "x"]) == 2  # argparse: required options missing
    assert "--drafter" in capsys.readouterr().err
