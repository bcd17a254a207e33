"""Killed, not excepted: `python -m train` and `python -m train.features` run as subprocesses and are
SIGKILLed — at named points inside a shard or checkpoint write (DRAFTSMITH_KILL_AT, train/killpoint.py)
and from outside when a file appears — then rerun with the same command. The result must equal an
uninterrupted run's: byte-identical regenerated and feature shards, the same training losses in
metrics.jsonl (each step once) and the same exported weights (tolerances of test_loop's resume test).
Half-written files are never read; the rerun removes them and says so."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
RECIPE = f"""
target: {REPO / "recipes" / "targets" / "stories260K"}
data:
  max_length: 40
  held_out: 0.2
  regenerate: {{enabled: true, num_samples: 24, max_new_tokens: 24, batch_size: 4, shard_size: 4, stop_ids: [1]}}
features: {{dtype: fp32, shard_size: 8, batch_size: 4}}
drafter: {{kind: medusa}}
train: {{steps: 6, batch_size: 4, lr: 3e-3, warmup_steps: 2, eval_every: 0, eval_batches: 1, save_every: 2,
         log_every: 1, report_to: none, threads: 1}}
"""
KILLED = -signal.SIGKILL


def start(module: str, tmp: Path, kill_at: str = "") -> tuple[subprocess.Popen, Path]:
    """`python -m MODULE tiny.yaml` with its data home and run dir in `tmp`, output to a log file
    (a file, not a pipe: nothing can block). Run from `tmp`, not the repository."""
    recipe = tmp / "tiny.yaml"
    recipe.write_text(RECIPE)
    env = {
        **os.environ,
        "DRAFTSMITH_DATA": str(tmp / "data"),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("DRAFTSMITH_KILL_AT", None)
    if kill_at:
        env["DRAFTSMITH_KILL_AT"] = kill_at
    n = len(list(tmp.glob("log_*.txt")))
    log = tmp / f"log_{n}.txt"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(recipe), f"run_dir={tmp / 'run'}"],
            cwd=tmp,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    return proc, log


def finish(module: str, tmp: Path, kill_at: str = "") -> tuple[int, str]:
    proc, log = start(module, tmp, kill_at)
    rc = proc.wait(timeout=600)
    return rc, log.read_text()


def kill_when(module: str, tmp: Path, pattern: str) -> tuple[int, str]:
    """Start the command, SIGKILL it from outside as soon as a path matching `pattern` appears."""
    proc, log = start(module, tmp)
    deadline = time.monotonic() + 600
    while not list(tmp.glob(pattern)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.kill()
    return proc.wait(timeout=60), log.read_text()


def shard_hashes(home: Path) -> dict[str, str]:
    """sha256 of every regenerated and feature shard, manifest and index, by path under the data home."""
    files = [
        p
        for p in home.rglob("*")
        if p.is_file() and (p.name.startswith("shard_") or p.name in ("_regen.json", "index.json"))
    ]
    return {str(p.relative_to(home)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def assert_same_result(ref: Path, tmp: Path) -> None:
    want, got = shard_hashes(ref / "data"), shard_hashes(tmp / "data")
    assert sum("regen" in k for k in want) == 7 and sum("features" in k for k in want) == 4  # 6 + manifest, 3 + index
    assert got == want
    assert not [p for p in tmp.rglob("*") if p.name.endswith(".tmp")]  # nothing half-written left behind
    a, b = losses(ref / "run"), losses(tmp / "run")
    assert [s for s, _ in b] == [s for s, _ in a] == list(range(1, 7))  # every step logged exactly once
    torch.testing.assert_close([x for _, x in b], [x for _, x in a], atol=1e-6, rtol=1e-5)
    wa, wb = load_file(str(ref / "run/export/model.safetensors")), load_file(str(tmp / "run/export/model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run of the same recipe, in this process (saves a subprocess start): regenerates,
    extracts, trains, exports into its own data home."""
    from train.__main__ import run
    from train.config import load_recipe

    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "tiny.yaml").write_text(RECIPE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTSMITH_DATA", str(tmp / "data"))
        mp.chdir(tmp)
        run(load_recipe(tmp / "tiny.yaml", [f"run_dir={tmp / 'run'}"]))
    assert (tmp / "run/export/model.safetensors").exists()
    return tmp


def test_killed_inside_each_write_resumes_to_the_same_result(reference, tmp_path):
    # 1. halfway through writing regenerated shard 1: shard 0 is done, shard 1 is only a hidden .tmp
    rc, out = finish("train", tmp_path, "regen.write:shard_00001.jsonl")
    assert rc == KILLED, out[-2000:]
    (regen,) = (tmp_path / "data/regen").iterdir()
    assert sorted(p.name for p in regen.glob("shard_*")) == ["shard_00000.jsonl"]
    assert len(list(regen.glob(".shard_00001.jsonl.*.tmp"))) == 1
    # 2. the same command: finishes the regeneration, then dies with feature shard 1 written but not renamed
    rc, out = finish("train", tmp_path, "features.write:shard_00001.safetensors")
    assert rc == KILLED, out[-2000:]
    assert "[regen] removed 1 unfinished file(s)" in out and "1/6 shards done" in out
    (feats,) = (tmp_path / "data/features").iterdir()
    assert [p.name for p in feats.glob("shard_*")] == ["shard_00000.safetensors"]
    assert not (feats / "index.json").exists()
    # 3. the same command: finishes the cache, then dies with checkpoint step_4 written but not renamed
    rc, out = finish("train", tmp_path, "train.checkpoint:4")
    assert rc == KILLED, out[-2000:]
    assert "[features] removed 1 unfinished file(s)" in out and "1/3 shards done" in out
    ckpts = tmp_path / "run/checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_4.tmp"]
    # 4. the same command, to the end
    rc, out = finish("train", tmp_path)
    assert rc == 0, out[-3000:]
    assert "removed unfinished checkpoint" in out and "resumed from" in out and "step_2 at step 2" in out
    assert "dropping the rows logged after the resumed checkpoint" in out  # steps 3-4 of the killed run
    assert_same_result(reference, tmp_path)


@pytest.mark.slow  # three more subprocesses: ~30 s of CPU, minutes on a busy machine
def test_killed_from_outside_resumes_to_the_same_result(reference, tmp_path):
    # the cache alone (python -m train.features), killed once the first regenerated shard exists
    rc, out = kill_when("train.features", tmp_path, "data/regen/*/shard_00000.jsonl")
    assert rc == KILLED, out[-2000:]
    # the one command, killed as soon as the first checkpoint starts being written
    rc, out = kill_when("train", tmp_path, "run/checkpoints/step_2*")
    assert rc == KILLED, out[-2000:]
    assert "shards done, sampling the rest" in out and "tokens in 3 shards" in out
    rc, out = finish("train", tmp_path)
    assert rc == 0, out[-3000:]
    assert "reusing all 6 shards" in out and "up to date (24 sequences): reusing it" in out  # nothing rebuilt
    assert_same_result(reference, tmp_path)
