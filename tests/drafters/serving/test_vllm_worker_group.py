"""`run_worker` leaves nothing running: vLLM's engine core is a child of the worker that outlives it, so the
worker runs in its own process group, killed whole when the call ends (timeout included) and when the
caller itself is killed (the worker's parent-death signal). A fake worker stands in for vLLM: it starts a
grandchild that sleeps, as the engine core would, and writes the grandchild's pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drafters.serving.vllm_env import run_worker

REPO = Path(__file__).resolve().parents[3]

FAKE_WORKER = """
import json, subprocess, sys, time
job = json.load(open(sys.argv[1]))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(job["pid_file"], "w").write(str(child.pid))
if job["finish"]:
    json.dump({"ok": True}, open(sys.argv[2], "w"))
else:
    time.sleep(120)
"""


def alive(pid: int) -> bool:
    """A live process (a zombie, dead but not reaped by its parent, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_for(path: Path, seconds: float = 30.0) -> int:
    end = time.monotonic() + seconds
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < end, f"{path} never written"
        time.sleep(0.05)
    return int(path.read_text())


def gone_within(pid: int, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not alive(pid)


@pytest.fixture
def worker(tmp_path) -> Path:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    return script


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc: Linux")


def test_a_clean_exit_leaves_no_engine_process(tmp_path, worker):
    pid_file = tmp_path / "grandchild.pid"
    result = run_worker(Path(sys.executable), worker, {"pid_file": str(pid_file), "finish": True}, tmp_path / "w")
    assert result == {"ok": True}
    assert gone_within(wait_for(pid_file))


def test_a_timeout_kills_the_worker_and_its_engine(tmp_path, worker):
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_worker(
            Path(sys.executable), worker, {"pid_file": str(pid_file), "finish": False}, tmp_path / "w", timeout=3
        )
    assert gone_within(wait_for(pid_file))


def test_killing_the_caller_kills_the_worker_and_its_engine(tmp_path, worker):
    """The case that left an engine core at 100% of a core: `pkill -f train.features` during regeneration."""
    pid_file = tmp_path / "grandchild.pid"
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from drafters.serving.vllm_env import run_worker; "
            f"run_worker(Path(sys.executable), Path({str(worker)!r}), {{'pid_file': {str(pid_file)!r}, 'finish': False}}, "
            f"Path({str(tmp_path / 'w')!r}))",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        grandchild = wait_for(pid_file)
        assert alive(grandchild)
        caller.send_signal(signal.SIGTERM)  # Python's default: die at once, no finally blocks run
        caller.wait(timeout=10)
        assert gone_within(grandchild), "the engine process outlived the killed caller"
    finally:
        caller.kill()
