"""Calibration for `--tree auto`: acceptance by (depth, rank) and the drafter's costs, measured with the real
decoder, and their cache (decode.harness.autoshape turns them into a shape).

Greedy decoding on a few prompts drafts a *caterpillar*: the rank-0 chain to depth D with ranks 0..W-1 as
siblings at every depth (D x W nodes), so each round whose accepted path stayed on rank 0 shows which rank,
if any, was right at the next depth. A wrapper drafter (Recorder) keeps each round's tree, its accepted
path and the seconds `propose` took; three more short runs (AR, chains of 1, a top-W dynamic tree) give the
loop's overheads and the cost of a drafter call over 1 and over W nodes, on one prompt, every run.

The acceptance counts are cached as json next to the drafter (DRAFTER_DIR/calibration.json) or in the run
dir for SPEC drafters, under a key of the target's identity, dtype, the caterpillar's size and the drafter's
files (a re-export into the same directory recalibrates). Costs are not cached: they move with the
machine's load and threads, like the pass-cost curve they are set against.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from torch import Tensor

from decode.ar import ARDrafter
from decode.costmodel import cost_at
from decode.metrics import GenStats
from decode.protocol import Budget, Drafter, TargetStep
from decode.target import Target
from decode.tree import DraftTree, Shape

KIND = "draftsmith-calibration"
CACHE_FILE = "calibration.json"


# --- the caterpillar and what its rounds show -----------------------------------------------------


def caterpillar(depth: int, width: int) -> Shape:
    """The rank-0 chain to `depth` with ranks 0..width-1 at every depth (a static tree of depth x width nodes)."""
    return Shape("static", choices=tuple((0,) * d + (r,) for d in range(depth) for r in range(width)))


def caterpillar_parents(depth: int, width: int) -> list[int]:
    """parents of the caterpillar as grow_static orders it: level by level, ranks in order."""
    return [-1 if d == 0 else (d - 1) * width for d in range(depth) for _ in range(width)]


def count_ranks(
    rounds: list[tuple[DraftTree, list[int]]], depth: int, width: int
) -> tuple[list[list[int]], list[int], bool]:
    """hits[d][r], trials[d] from (tree, accepted path) rounds of the caterpillar; False = the drafter did
    not draft the caterpillar (it proposes its own trees, e.g. a lookup drafter).

    A trial at depth d is a round whose path reached the rank-0 node at depth d - 1 (or the root) and
    whose tree has children there; the hit is the rank of the accepted child, none on a miss.
    """
    hits, trials, follows = [[0] * width for _ in range(depth)], [0] * depth, True
    for tree, path in rounds:
        if not tree.size:
            continue
        levels = tree.depth()
        if tree.parents.tolist() != caterpillar_parents(levels, width):
            follows = False
            continue
        for d in range(levels):
            trials[d] += 1
            if d >= len(path):
                break
            r = path[d] - d * width
            hits[d][r] += 1
            if r:  # a rank > 0 node has no children in the caterpillar: nothing more to see
                break
    return hits, trials, follows


# --- measuring ------------------------------------------------------------------------------------


class Recorder:
    """A drafter wrapper that keeps each round's tree, the seconds `propose` took, and the accepted path."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.rounds: list[tuple[DraftTree, list[int]]] = []
        self.propose_s: list[float] = []

    def __getattr__(self, name: str):  # name, hidden_ids, forward_passes, reuse, side_rows, token_probs
        return getattr(self.inner, name)

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        self.inner.begin(prompt_ids, step)

    def propose(self, budget: Budget) -> DraftTree:
        t0 = time.perf_counter()
        tree = self.inner.propose(budget)
        self.propose_s.append(time.perf_counter() - t0)
        self.rounds.append((tree, []))
        return tree

    def accept(self, step: TargetStep) -> None:
        if self.rounds:
            self.rounds[-1] = (self.rounds[-1][0], list(step.path))
        self.inner.accept(step)


# decode.generate.generate, passed in (decode.generate's CLI imports this module): (drafter, prompt ids,
# max new tokens, shape) -> the statistics of a greedy generation.
DecodeFn = Callable[[Drafter, Tensor, int, Shape], GenStats]


def loop_overhead(s: GenStats) -> float:
    """Seconds per speculative round outside drafting and the verify step (commit, bookkeeping)."""
    return max(0.0, s.wall_s - s.prefill_s - s.draft_s - s.verify_s) / s.rounds if s.rounds else 0.0


def verify_extra(runs: list[GenStats], curve: dict[int, float]) -> float:
    """Seconds per round the decoder's verify step takes beyond the curve's bare pass at its rows (the tree
    mask, the greedy walk, the LM head on visited rows), averaged over the runs' rounds."""
    rounds = sum(s.rounds for s in runs)
    bare = sum(s.rounds * cost_at(curve, 1 + s.draft_nodes / s.rounds) for s in runs if s.rounds)
    return max(0.0, (sum(s.verify_s for s in runs) - bare) / rounds) if rounds else 0.0


def measure_acceptance(
    decode: DecodeFn, drafter: Drafter, prompts: list[Tensor], max_new_tokens: int, depth: int, width: int
) -> dict:
    """Rank counts from the caterpillar on every prompt (what the cache keeps; the costs are measured afresh)."""
    hits, trials, follows = [[0] * width for _ in range(depth)], [0] * depth, True
    decode(drafter, prompts[0], min(8, max_new_tokens), caterpillar(depth, width))  # warm-up
    for ids in prompts:
        cat = Recorder(drafter)
        decode(cat, ids, max_new_tokens, caterpillar(depth, width))
        h, t, f = count_ranks(cat.rounds, depth, width)
        hits = [[a + b for a, b in zip(x, y)] for x, y in zip(hits, h)]
        trials = [a + b for a, b in zip(trials, t)]
        follows = follows and f
    return {
        "hits": hits,
        "trials": trials,
        "follows_shape": follows,
        "depth": depth,
        "width": width,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
    }


def measure_costs(
    decode: DecodeFn,
    drafter: Drafter,
    prompt: Tensor,
    max_new_tokens: int,
    depth: int,
    width: int,
    curve: dict[int, float],
) -> dict[str, float]:
    """The drafter's and the loop's seconds on one prompt, now (the machine's load moves them, as it moves `curve`).

    1. untimed warm-up, then AR: the loop's overhead per round without drafting;
    2. the caterpillar, chains of 1 and a dynamic tree of top-`width`: the per-round drafting work and the cost
       of a call over 1 and over `width` nodes (call_costs), and the round overhead;
    3. the verify step's extra over `curve` (its bare pass) as a line in the rows verified: AR's at one row,
       the caterpillar's at its rows (one pooled constant would charge the 64-node caterpillar's tree-mask
       and LM-head work to AR's single row too).
    """
    decode(ARDrafter(), prompt, min(8, max_new_tokens), Shape())
    ar = decode(ARDrafter(), prompt, max_new_tokens, Shape())
    runs, stats = {}, {}
    for name, shape in (
        ("narrow", caterpillar(depth, width)),
        ("chain", Shape("chain", k=1)),
        ("wide", Shape("dynamic", topk=width, depth=depth, nodes=width * depth)),
    ):
        rec = Recorder(drafter)
        stats[name] = decode(rec, prompt, max_new_tokens, shape)
        runs[name] = list(zip(rec.propose_s, (tree.depth() for tree, _ in rec.rounds)))
    narrow = stats["narrow"]
    e1, en = verify_extra([ar], curve), verify_extra([narrow], curve)
    rows = 1 + narrow.draft_nodes / narrow.rounds if narrow.rounds else 1.0
    slope = max(0.0, (en - e1) / (rows - 1)) if rows > 1 else 0.0
    return {
        **call_costs(runs["chain"], runs["narrow"], runs["wide"]),
        "verify_extra_1": e1,
        "verify_extra_per_row": slope,
        "round_s": loop_overhead(narrow),
        "round_ar_s": loop_overhead(ar),
    }


def call_costs(
    one: list[tuple[float, int]], narrow: list[tuple[float, int]], wide: list[tuple[float, int]]
) -> dict[str, float]:
    """Per-round drafting seconds a + calls x c(width), from (propose seconds, levels) of three runs.

    one: chains of 1 (a + c1); narrow: the caterpillar (a + levels x c1, every call over one node);
    wide: a dynamic tree of top-W (a + c1 + (levels - 1) x cW). Rounds that drafted nothing are left out.
    """

    def mean(rows: list[tuple[float, int]]) -> tuple[float, float]:
        rows = [r for r in rows if r[1]]
        return (sum(s for s, _ in rows) / len(rows), sum(n for _, n in rows) / len(rows)) if rows else (0.0, 0.0)

    (m1, _), (mc, lc), (mw, lw) = mean(one), mean(narrow), mean(wide)
    c1 = max(0.0, (mc - m1) / (lc - 1)) if lc > 1 else m1
    a = max(0.0, m1 - c1)
    cw = max(0.0, (mw - a - c1) / (lw - 1)) if lw > 1 else c1
    return {"round_draft_s": a, "call_1": c1, "call_w": cw}


# --- the cache --------------------------------------------------------------------------------


def target_identity(target: Target) -> str:
    """The target's name and a digest of its config (weights of another model under the same name differ there)."""
    cfg = json.dumps(target.config.to_dict(), sort_keys=True, default=str)
    name = Path(getattr(target, "name_or_path", "") or "model").name
    return f"{name}-{hashlib.sha256(cfg.encode()).hexdigest()[:12]}"


def drafter_stamp(spec: str) -> str:
    """A drafter directory's files (names, sizes, mtimes; the cache itself left out) as a short digest; else
    the SPEC string (a SPEC drafter has no weights of its own)."""
    path = Path(spec)
    if not path.is_dir():
        return spec
    files = sorted(
        (f.relative_to(path).as_posix(), f.stat().st_size, f.stat().st_mtime_ns)
        for f in path.rglob("*")
        if f.is_file() and f.name != CACHE_FILE
    )
    return hashlib.sha256(repr(files).encode()).hexdigest()[:12]


def cache_key(target_id: str, dtype: str, depth: int, width: int, drafter: str = "") -> str:
    """One acceptance calibration per target, dtype (bf16 moves near-ties), caterpillar size and drafter version."""
    return f"{target_id}|{dtype}|depth={depth},width={width}|drafter={drafter}"


def load_cached(path: Path, key: str) -> dict | None:
    """The entry stored under `key`, or None (no file, another kind of file, or another key)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc.get("entries", {}).get(key) if doc.get("kind") == KIND else None


def store(path: Path, key: str, entry: dict) -> bool:
    """Add `entry` under `key` (other keys kept), atomically; False when the place is not writable."""
    try:
        doc = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        doc = {}
    if doc.get("kind") != KIND:
        doc = {"kind": KIND, "entries": {}}
    doc["entries"][key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def cache_path(spec: str, run_dir: str | Path | None) -> Path | None:
    """DRAFTER_DIR/calibration.json for a drafter directory; else RUN_DIR/calibration/<spec>.json (None: no cache)."""
    if Path(spec).is_dir() and os.access(spec, os.W_OK):
        return Path(spec) / CACHE_FILE
    if run_dir is None:
        return None
    slug = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in spec)
    return Path(run_dir) / "calibration" / f"{slug}.json"
