"""Test hook: named points where a test may SIGKILL the running process (a real kill: no cleanup, no exception).

    DRAFTSMITH_KILL_AT=NAME:WHERE   e.g. regen.write:shard_00001.jsonl, features.write:shard_00002.safetensors,
                                         train.checkpoint:4, train.saved:4, train.micro:7

The process kills itself the moment it reaches point NAME with tag WHERE. Unset (always, outside the
kill tests of tests/train/test_kill.py) it does nothing. The points sit where an interruption hurts
most: halfway through writing a regenerated shard, a feature shard written but not yet renamed, a
checkpoint saved but not yet renamed; and, for the resume property test, right after a complete checkpoint
(train.saved:STEP) and after any micro-batch (train.micro:N, N counted from 1 over the whole run).
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "DRAFTSMITH_KILL_AT"


def kill_point(name: str, where: object) -> None:
    """SIGKILL this process if $DRAFTSMITH_KILL_AT is `name:where`."""
    want = os.environ.get(ENV)
    if want and want == f"{name}:{where}":
        print(f"[killpoint] {want}: SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
