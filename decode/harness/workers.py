"""Interleaved evaluation dealt to several processes of one torch thread each: the whole machine, same rows.

A 1-thread decode of a small target leaves the other cores idle (and 1 thread is the fastest setting for
such a target on a shared machine), so a long benchmark (80 MT-bench turns x 13 rows) is fastest as N
independent 1-thread workers. Timing stays honest because each worker interleaves exactly as `decode.harness.evaluate.interleaved`:

1. the parent has resolved every SPEC and fixed the `auto` shapes (calibration and the pass-cost curve
   run once, in the parent, before any worker starts);
2. conversation c goes to worker c % N. Each worker (a spawned process: no OpenMP state is forked) loads
   the target in the parent's dtype and the same rows — each with the parent's shape, so an auto row drafts the
   shape the parent chose —, warms up
   once, and decodes its conversations with `decode_conversation` (row order rotated by c, seeds = the
   global turn index, so every turn is decoded exactly as a 1-process run would decode it);
3. the parent puts the turns back in conversation order.

A row's tokens/s is then its tokens over its summed decoding time, each conversation timed with the other
workers busy beside it — the same load for every row, as in a 1-process run on a busy machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from decode.harness.prompts import Conversation
from decode.harness.report import TurnResult
from decode.target import Target
from decode.tree import Shape


@dataclass(frozen=True)
class Shard:
    """What one worker needs: where the target is, the rows, and its conversations with their indices."""

    target: str  # the target's name_or_path
    dtype: str  # the parent's target dtype (float32 | bfloat16 ...)
    runtime: str  # the parent's target runtime (fast | hf)
    specs: tuple[str, ...]  # the rows, runners[0] (AR) first, in the parent's order
    shapes: tuple[tuple[str, Shape], ...]  # every decoder row's shape in the parent (auto rows: the one it chose)
    convs: tuple[tuple[int, int, Conversation], ...]  # (c, first global turn index, conversation)
    cfg: object  # decode.harness.runs.EvalConfig
    position: int  # its progress bar's line
    progress: bool  # show it
    # make_run (decode.harness.evaluate), warm_up and decode_conversation (decode.harness.runs), passed in and
    # pickled by name: decode.harness.evaluate imports this module, so this module does not import it back
    make_run: Callable
    warm_up: Callable
    decode_conversation: Callable


def exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """Worker initializer: end this worker when its parent is gone. A parent killed by a signal (a benchmark
    stopped with kill or Ctrl-C in another shell) runs no cleanup, and its pool's workers would otherwise go on
    decoding for an hour beside whatever runs next."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def run_shard(shard: Shard) -> list[tuple[int, dict[str, list[TurnResult]]]]:
    """In a worker: load the target and the rows, warm up, decode the shard's conversations interleaved."""
    torch.set_num_threads(1)
    target = Target.load(shard.target, shard.runtime, dtype=shard.dtype)
    runners = [(s, shard.make_run(s, target, shard.cfg)) for s in shard.specs]
    shapes = dict(shard.shapes)
    for spec, r in runners:
        if spec in shapes:
            r.shape = shapes[spec]
    if shard.cfg.warmup and shard.convs:
        shard.warm_up([r for _, r in runners], target, shard.convs[0][2], shard.cfg)
    cold = replace(shard.cfg, warmup=False)
    out = []
    for c, first, conv in tqdm(
        shard.convs,
        desc=f"worker {shard.position}",
        unit="conv",
        position=shard.position,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=False,
        disable=not shard.progress,
    ):
        out.append((c, shard.decode_conversation(target, runners, conv, cold, c, first)))
    return out


def decode_in_workers(
    target: Target,
    runners: list,
    convs: list[Conversation],
    firsts: list[int],
    cfg,
    workers: int,
    progress: bool,
    fns: tuple[Callable, Callable, Callable],
) -> list[dict[str, list[TurnResult]]]:
    """Per conversation (in order), every row's turns, decoded by `workers` 1-thread processes.
    fns: make_run (decode.harness.evaluate), warm_up and decode_conversation (decode.harness.runs)."""
    name = getattr(target, "name_or_path", None)
    if not name:
        raise ValueError("workers > 1 needs a target loaded from a path (Target.load), to load it again in each worker")
    if target.placement is not None:
        raise ValueError("workers > 1 is for a target held in memory, not one streamed with offloaded layers")
    shapes = tuple((spec, r.shape) for spec, r in runners if getattr(r, "shape", None) is not None)
    missing = [spec for spec, r in runners if getattr(r, "shape", "") is None]  # HF peers have no shape
    if missing:
        raise RuntimeError(f"auto rows {missing} have no shape yet: choose_auto_shapes runs before the workers")
    dtype = str(target.dtype).removeprefix("torch.")
    shards = [
        Shard(
            name,
            dtype,
            "fast" if target.runtime is not None else "hf",
            tuple(s for s, _ in runners),
            shapes,
            tuple((c, firsts[c], convs[c]) for c in range(w, len(convs), workers)),
            cfg,
            w,
            progress,
            *fns,
        )
        for w in range(min(workers, len(convs)))
    ]
    with ProcessPoolExecutor(
        len(shards), mp_context=mp.get_context("spawn"), initializer=exit_with_parent, initargs=(os.getpid(),)
    ) as pool:
        results = list(pool.map(run_shard, shards))
    by_conv = dict(item for part in results for item in part)
    return [by_conv[c] for c in range(len(convs))]
