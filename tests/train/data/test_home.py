"""`draftsmith data ls | rm`: what the data home holds (size, target, settings, last use, in use), and removal
that never takes what a running job holds (a live process's lock; a killed job's stale lock is ignored)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from decode.cli import main as draftsmith
from train.data.home import LOCK, STAMP, entries, use

DAY = 86400


def make_home(home: Path) -> dict[str, Path]:
    """A regen set, a feature cache and ShareGPT, as the pipeline leaves them (only the files `ls` reads)."""
    regen = home / "regen/stories260K-aaaa11112222"
    regen.mkdir(parents=True)
    (regen / "_regen.json").write_text(
        json.dumps({"jobs": 24, "seed": 3, "settings": {"max_new_tokens": 20, "temperature": 1.0, "top_p": 0.9}})
    )
    (regen / "shard_00000.jsonl").write_text("x" * 5000)
    feats = home / "features/smollm2-bbbb33334444"
    feats.mkdir(parents=True)
    (feats / "index.json").write_text(
        json.dumps({"num_sequences": 24, "tokens": 480, "hidden_ids": [2, 5], "dtype": "bf16", "topk": 0})
    )
    (feats / "recipe.yaml").write_text("target: /models/smollm2\nseed: 0\n")
    (feats / "shard_00000.safetensors").write_bytes(b"\0" * 2_000_000)
    share = home / "sharegpt"
    share.mkdir()
    (share / "sharegpt.jsonl").write_text("{}\n")
    return {"regen": regen, "features": feats, "sharegpt": share}


def age_by(path: Path, days: float) -> None:
    """Make `path` look last used `days` ago (its stamp)."""
    (path / STAMP).write_text(json.dumps({"time": time.time() - days * DAY, "target": "t"}))


@pytest.fixture
def home(tmp_path, monkeypatch) -> tuple[Path, dict[str, Path]]:
    monkeypatch.setenv("DRAFTSMITH_DATA", str(tmp_path / "home"))
    return tmp_path / "home", make_home(tmp_path / "home")


@pytest.fixture
def live_pid():
    """A running process other than this one (a job that holds an entry)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


def hold(entry: Path, pid: int) -> None:
    (entry / LOCK.format(pid=pid)).write_text(json.dumps({"pid": pid, "host": os.uname().nodename}))


def test_ls_shows_size_target_settings_and_last_use(home, capsys, live_pid):
    root, d = home
    use(d["regen"], "recipes/targets/stories260K")  # a run reusing it: stamped now
    age_by(d["features"], 3)
    hold(d["features"], live_pid)
    assert draftsmith(["data", "ls"]) == 0
    out = capsys.readouterr().out
    assert f"data home {root}: 3 entries" in out
    assert "regen/stories260K-aaaa11112222" in out and "target recipes/targets/stories260K; 24 sequences" in out
    assert "max_new_tokens 20, temperature 1.0, top_p 0.9, seed 3" in out and "min ago" in out
    assert "features/smollm2-bbbb33334444\n    2.0 MB" in out and "(3.0 days ago)" in out
    assert (
        f"IN USE by pid {live_pid}" in out
        and "target /models/smollm2; 24 sequences, 480 tokens, hidden ids [2, 5]" in out
    )
    assert "sharegpt\n" in out and "ShareGPT: sharegpt.jsonl" in out
    assert draftsmith(["data", "ls", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["key"] for r in rows] == ["regen/stories260K-aaaa11112222", "features/smollm2-bbbb33334444", "sharegpt"]
    assert rows[1]["bytes"] >= 2_000_000 and rows[1]["held_by"] == [live_pid] and rows[0]["held_by"] == []


def test_rm_by_key_and_refusal_of_what_a_running_job_holds(home, capsys, live_pid):
    root, d = home
    hold(d["features"], live_pid)
    assert draftsmith(["data", "rm", "features/smollm2-bbbb33334444"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: data rm features/smollm2-bbbb33334444: in use by running process(es) [{live_pid}]; "
        "wait for them to finish (or stop them), then rerun"
    )
    assert d["features"].is_dir()
    assert draftsmith(["data", "rm", "stories260K-aaaa11112222"]) == 0  # the last part of a key is enough
    assert not d["regen"].exists() and "removing regen/stories260K-aaaa11112222" in capsys.readouterr().out
    assert draftsmith(["data", "rm", "nope"]) == 2
    assert "data rm nope: no such entry" in capsys.readouterr().err
    assert draftsmith(["data", "rm"]) == 2 and "give entry keys or --older-than" in capsys.readouterr().err


def test_a_killed_jobs_stale_lock_is_ignored(home):
    root, d = home
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    hold(d["regen"], int(dead.stdout))  # its process has exited: the lock is stale
    assert [e.held_by for e in entries(root) if e.key.startswith("regen")] == [[]]
    assert draftsmith(["data", "rm", "regen/stories260K-aaaa11112222"]) == 0 and not d["regen"].exists()


def test_rm_older_than_keeps_recent_and_held_entries(home, capsys, live_pid):
    root, d = home
    age_by(d["regen"], 10)
    age_by(d["features"], 10)
    age_by(d["sharegpt"], 1)
    hold(d["features"], live_pid)
    assert draftsmith(["data", "rm", "--older-than", "7", "--dry-run"]) == 0
    assert "would remove regen/" in capsys.readouterr().out and d["regen"].exists()
    assert draftsmith(["data", "rm", "--older-than", "7"]) == 0
    out = capsys.readouterr().out
    assert "kept features/smollm2-bbbb33334444: in use" in out and "removing regen/stories260K" in out
    assert not d["regen"].exists() and d["features"].exists() and d["sharegpt"].exists()
    assert draftsmith(["data", "rm", "--older-than", "-1"]) == 2


def test_use_stamps_and_holds_until_exit(tmp_path):
    """A job's lock lasts as long as its process: another process sees it held, then free once it exits."""
    entry = tmp_path / "features/x-1"
    code = (
        f"import sys, time; sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r}); "
        f"from train.data.home import use; use(__import__('pathlib').Path({str(entry)!r}), 'tgt'); "
        "print('held', flush=True); time.sleep(30)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        (e,) = entries(tmp_path)
        assert e.held_by == [p.pid] and e.target == "tgt" and time.time() - e.last_used < 60
    finally:
        p.terminate()  # SIGTERM: no atexit either, so the lock stays behind — stale, and ignored
        p.wait()
    (e,) = entries(tmp_path)
    assert e.held_by == []
