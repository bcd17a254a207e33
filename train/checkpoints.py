"""A run directory's accelerate checkpoints: list them, pick and load the one to resume from, write one atomically.

RUN_DIR/checkpoints/step_N holds accelerate's state (optimizer, scheduler, RNG, the drafter's weights) and
RUN_STATE: the step, how many bytes of metrics.jsonl the checkpoint had seen, the losses not yet logged and
the trained tokens so far. A checkpoint is written under `step_N.tmp` and renamed, so a listed one is
always whole; a killed run's `.tmp` leftovers are deleted and metrics.jsonl is cut back to what the resumed
checkpoint had seen, so a killed-and-resumed run logs what an uninterrupted one does.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

from safetensors import SafetensorError

from decode.errors import UserError, one_line
from train.killpoint import kill_point

CKPT_PREFIX = "step_"
RUN_STATE = "draftsmith_state.json"  # in each checkpoint: its step and how much of metrics.jsonl it covers


def checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest first (temporary `.tmp` directories are never listed)."""
    d = run_dir / "checkpoints"
    if not d.is_dir():
        return []
    done = [
        p for p in d.iterdir() if p.is_dir() and p.name.startswith(CKPT_PREFIX) and p.name[len(CKPT_PREFIX) :].isdigit()
    ]
    return sorted(done, key=lambda p: int(p.name[len(CKPT_PREFIX) :]))


def resume_point(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint `train.resume` names: `auto` the newest in run_dir (None if there is none), `never` None."""
    if resume == "never":
        return None
    if resume == "auto":
        found = checkpoints(run_dir)
        return found[-1] if found else None
    if not Path(resume).is_dir():
        raise FileNotFoundError(f"train.resume={resume}: no such checkpoint directory")
    return Path(resume)


def load_checkpoint(acc, path: Path) -> tuple[int, list[float], int]:
    """Restore accelerate's state from `path`; returns (step, losses since the last logged row, trained tokens)."""
    try:
        acc.load_state(str(path))
    except (SafetensorError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise UserError(
            f"checkpoint {path} is unreadable ({type(e).__name__}: {one_line(e)[:200]}); delete "
            "it to resume from the one before, or set train.resume=never"
        ) from None
    step = int(path.name[len(CKPT_PREFIX) :]) if path.name.startswith(CKPT_PREFIX) else 0
    if not (path / RUN_STATE).exists():  # a checkpoint from before RUN_STATE existed: nothing pending
        return step, [], 0
    state = json.loads((path / RUN_STATE).read_text())
    return step, state.get("loss_window", []), state.get("trained_tokens", 0)


def save_checkpoint(acc, run_dir: Path, at: int, log_path: Path, window: list[float], seen: int, keep: int) -> None:
    """Write step `at`'s checkpoint atomically and keep the newest `keep`. Collective: every rank calls it."""
    main = acc.is_main_process
    acc.wait_for_everyone()
    final = run_dir / "checkpoints" / f"{CKPT_PREFIX}{at}"
    tmp = final.with_name(final.name + ".tmp")
    if main and tmp.exists():
        shutil.rmtree(tmp)
    acc.wait_for_everyone()  # sharded saves (FSDP, ZeRO-3) write from every rank: none before the cleanup
    acc.save_state(str(tmp))
    acc.wait_for_everyone()
    if main:
        # how much of metrics.jsonl this checkpoint has seen: a resume from it cuts the file back there
        size = log_path.stat().st_size if log_path.exists() else 0
        (tmp / RUN_STATE).write_text(
            json.dumps({"step": at, "metrics_bytes": size, "loss_window": window, "trained_tokens": seen})
        )
        kill_point("train.checkpoint", at)  # test hook: a kill with the checkpoint written but not renamed
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
        kill_point("train.saved", at)  # test hook: a kill right after a complete checkpoint
    acc.wait_for_everyone()


def drop_unfinished_checkpoints(run_dir: Path) -> None:
    """Delete `step_N.tmp` directories a killed run left mid-write (never loaded: `checkpoints` skips them)."""
    d = run_dir / "checkpoints"
    for p in sorted(d.glob(f"{CKPT_PREFIX}*.tmp")) if d.is_dir() else []:
        shutil.rmtree(p)
        print(f"[train] removed unfinished checkpoint {p} (left by an interrupted run)")


def rewind_metrics(path: Path, resume_from: Path | None) -> None:
    """Cut metrics.jsonl back to what the resumed checkpoint had seen (a fresh start: empty), so the rows
    a killed run logged after its last checkpoint — and a torn last line — are not repeated."""
    if not path.exists():
        return
    keep = 0
    if resume_from is not None:
        state = resume_from / RUN_STATE
        if not state.exists() or resume_from.parent != path.parent / "checkpoints":
            return  # an older checkpoint, or another run's: its count does not describe this file
        keep = json.loads(state.read_text())["metrics_bytes"]
    if path.stat().st_size > keep:
        print(f"[train] {path}: dropping the rows logged after {'the resumed checkpoint' if keep else 'no checkpoint'}")
        os.truncate(path, keep)
