"""`--tree auto`: the draft shape with the most expected tokens per second (Sequoia-style sizing).

The model, as pure functions:
- acceptance: p[d][r] = probability that the rank-r child (r-th most likely under the drafter) of a
  node at depth d is the target's token, given that node was accepted (greedy). **Independence
  assumption:** p depends only on (depth, rank), not on the ranks along the path above, and at most
  one sibling matches (greedy verification has one right token). A node is then accepted with the
  product of p over its path, and a tree's expected accepted length is the sum of that over its nodes.
- cost of a round: the drafter's calls (a chain of k makes k calls of one node; EAGLE-2's dynamic tree
  makes one root call and depth - 1 calls of top-k nodes) + the target pass over 1 + nodes rows (the
  measured pass-cost curve, decode.costmodel) + the loop's per-round overhead (commit, bookkeeping).
- tokens/s = E[accepted + 1] / round cost; the grid of chains and dynamic trees is searched for the best.

Calibration measures p with the real decoder, greedy, on a few prompts, drafting a *caterpillar*: the
rank-0 chain to depth D with ranks 0..W-1 as siblings at every depth, so each round whose path stayed on
rank 0 shows which rank (if any) was right at the next depth. It also times the drafter's calls (width 1
there, width W in one dynamic-tree run) and the round overhead (and AR's). The result is cached as json
next to the drafter (DRAFTER_DIR/calibration.json) or in the run dir, keyed by target identity, dtype and
threads; the pass-cost curve is measured afresh each run (the machine's load moves it).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from decode.costmodel import cost_at, measure_pass_cost
from decode.metrics import GenStats
from decode.protocol import Budget, Drafter, TargetStep
from decode.target import Target
from decode.tree import DraftTree, Shape

AUTO = "auto"
KIND = "draftsmith-calibration"
CURVE_TOKENS = (1, 2, 4, 8, 16, 32, 64)

Acceptance = list[list[float]]  # p[d][r]: depth d (0 = the root's children), rank r


# --- the model (pure) ---------------------------------------------------------------------


def path_prob(p: Acceptance, path: tuple[int, ...]) -> float:
    """P(the node reached by these child ranks is accepted) = product of p[d][r] along it (0 past the data)."""
    out = 1.0
    for d, r in enumerate(path):
        out *= p[d][r] if d < len(p) and r < len(p[d]) else 0.0
    return out


def expected_accepted(p: Acceptance, paths: list[tuple[int, ...]]) -> float:
    """Expected accepted draft tokens of a tree given as rank paths (closed under prefixes)."""
    return sum(path_prob(p, c) for c in paths)


def chain_paths(k: int) -> list[tuple[int, ...]]:
    return [(0,) * d for d in range(1, k + 1)]


def dynamic_paths(p: Acceptance, topk: int, depth: int, nodes: int) -> list[tuple[int, ...]]:
    """The tree EAGLE-2 would keep if the drafter's scores were the model's: best-first by path probability.

    1. start from the root's top-k children; 2. repeatedly take the most probable open node (ranks < topk,
    depth <= depth, at most topk nodes per level: EAGLE-2's frontier width) and open its children;
    3. stop at `nodes`. A child is never likelier than its parent, so the set stays closed under parents.
    """
    heap = [(-path_prob(p, (r,)), (r,)) for r in range(topk)]
    heapq.heapify(heap)
    kept: list[tuple[int, ...]] = []
    per_level = [0] * (depth + 1)
    while heap and len(kept) < nodes:
        _, c = heapq.heappop(heap)
        if per_level[len(c)] >= topk:
            continue
        kept.append(c)
        per_level[len(c)] += 1
        if len(c) < depth:
            for r in range(topk):
                heapq.heappush(heap, (-path_prob(p, (*c, r)), (*c, r)))
    return kept


@dataclass(frozen=True)
class Costs:
    """Seconds: a drafter call over 1 node and over `width` nodes, and the per-round overheads."""

    round_draft_s: float  # drafting work per round whatever the shape (catching up on accepted tokens)
    call_1: float
    call_w: float
    width: int
    round_s: float  # commit + loop bookkeeping per speculative round
    round_ar_s: float  # the same for plain decoding

    def call(self, w: int) -> float:
        """A drafter call over w nodes: linear between the two measured widths."""
        if self.width <= 1:
            return self.call_1
        return max(0.0, self.call_1 + (self.call_w - self.call_1) * (w - 1) / (self.width - 1))


@dataclass(frozen=True)
class Candidate:
    """One shape with its predicted expected tokens per round, seconds per round and speedup vs AR."""

    shape: Shape
    label: str
    tau: float
    round_s: float
    speedup: float


def shape_spec(shape: Shape) -> str:
    """A chain or dynamic shape as text: `chain k=K` (--tree chain --draft-len K) or its --tree spec."""
    if shape.kind == "chain":
        return f"chain k={shape.k}"
    return f"dynamic:topk={shape.topk},depth={shape.depth},nodes={shape.nodes}"


def predict(p: Acceptance, shape: Shape, costs: Costs, verify_s: Callable[[float], float]) -> Candidate:
    """Expected tokens per round, its seconds and the speedup over AR for a chain or dynamic shape."""
    if shape.kind == "chain":
        paths, draft = chain_paths(shape.k), costs.round_draft_s + shape.k * costs.call(1)
    else:
        paths = dynamic_paths(p, shape.topk, shape.depth, shape.nodes)
        draft = costs.round_draft_s + costs.call(1) + (shape.depth - 1) * costs.call(shape.topk)
    tau = 1.0 + expected_accepted(p, paths)
    round_s = draft + verify_s(1 + len(paths)) + costs.round_s
    ar_s = verify_s(1) + costs.round_ar_s
    return Candidate(shape, shape_spec(shape), tau, round_s, (tau / round_s) * ar_s)


def grid(max_depth: int, width: int) -> list[Shape]:
    """Chains of 1..max_depth and dynamic trees (top-k 2/4/8 up to the calibrated width, a few depths and sizes)."""
    shapes = [Shape("chain", k=k) for k in range(1, max_depth + 1)]
    for topk in (t for t in (2, 4, 8) if t <= width):
        for depth in (d for d in (2, 3, 4, 6, 8) if d <= max_depth):
            for nodes in (n for n in (4, 8, 12, 16, 24, 32, 48, 64) if topk < n <= topk * depth):
                shapes.append(Shape("dynamic", topk=topk, depth=depth, nodes=nodes))
    return shapes


def choose(p: Acceptance, costs: Costs, verify_s: Callable[[float], float], max_depth: int,
           width: int) -> tuple[Candidate, list[Candidate]]:
    """The grid's best candidate by predicted tokens/s (ties: the fewer rows), and every candidate."""
    cands = [predict(p, s, costs, verify_s) for s in grid(max_depth, width)]
    best = max(cands, key=lambda c: (round(c.tau / c.round_s, 9), -c.round_s))
    return best, cands


# --- calibration ----------------------------------------------------------------------------


def caterpillar(depth: int, width: int) -> Shape:
    """The rank-0 chain to `depth` with ranks 0..width-1 at every depth (a static tree of depth x width nodes)."""
    return Shape("static", choices=tuple((0,) * d + (r,) for d in range(depth) for r in range(width)))


def caterpillar_parents(depth: int, width: int) -> list[int]:
    """parents of the caterpillar as grow_static orders it: level by level, ranks in order."""
    return [-1 if d == 0 else (d - 1) * width for d in range(depth) for _ in range(width)]


def count_ranks(rounds: list[tuple[DraftTree, list[int]]], depth: int, width: int
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


def acceptance(hits: list[list[int]], trials: list[int], prior: float = 4.0) -> Acceptance:
    """p[d][r] = (hits + prior * p[d-1][r]) / (trials + prior): each depth's rates shrunk towards the depth
    above's with the weight of `prior` trials (a Beta prior), so a depth seen twice does not read as certain;
    depth 0 shrinks towards 0. Depths never tried are left out (the model drafts no deeper)."""
    out: Acceptance = []
    above = [0.0] * (len(hits[0]) if hits else 0)
    for row, n in zip(hits, trials):
        if not n:
            break
        above = [(h + prior * a) / (n + prior) for h, a in zip(row, above)]
        out.append(above)
    return out


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
    """Seconds per round the decoder's verify step takes beyond the curve's bare pass at its rows (the greedy
    walk, the LM head on visited rows), pooled over runs so one run's load spike weighs less."""
    rounds = sum(s.rounds for s in runs)
    bare = sum(s.rounds * cost_at(curve, 1 + s.draft_nodes / s.rounds) for s in runs if s.rounds)
    return max(0.0, (sum(s.verify_s for s in runs) - bare) / rounds) if rounds else 0.0


def calibrate(decode: DecodeFn, drafter: Drafter, prompts: list[Tensor], max_new_tokens: int, depth: int,
              width: int, curve: dict[int, float]) -> dict:
    """Acceptance by (depth, rank) and the drafter's costs, measured with the real decoder (greedy).

    1. untimed warm-up, then AR on the first prompt: the loop's overhead per round without drafting;
    2. the caterpillar on every prompt: rank counts, the cost of a one-node call, the round overhead;
    3. a dynamic tree of top-`width` on the first prompt: the cost of a `width`-node call.
    The overheads are read against `curve` (the pass cost measured now), which the cache then assumes.
    """
    hits, trials, follows = [[0] * width for _ in range(depth)], [0] * depth, True
    decode(NoDraft(), prompts[0], min(8, max_new_tokens), Shape())  # 1. warm-up (lazy init, allocator)
    decode(drafter, prompts[0], min(8, max_new_tokens), caterpillar(depth, width))
    ar = decode(NoDraft(), prompts[0], max_new_tokens, Shape())
    stats, narrow = GenStats(), []
    for ids in prompts:  # 2. the caterpillar
        cat = Recorder(drafter)
        stats = stats.merge(decode(cat, ids, max_new_tokens, caterpillar(depth, width)))
        h, t, f = count_ranks(cat.rounds, depth, width)
        hits = [[a + b for a, b in zip(x, y)] for x, y in zip(hits, h)]
        trials = [a + b for a, b in zip(trials, t)]
        follows = follows and f
        narrow += zip(cat.propose_s, (tree.depth() for tree, _ in cat.rounds))
    runs = {}
    for name, shape in (("chain", Shape("chain", k=1)), ("wide", Shape("dynamic", topk=width, depth=depth,
                                                                          nodes=width * depth))):
        rec = Recorder(drafter)  # 3. one-call rounds and width-W calls
        decode(rec, prompts[0], max_new_tokens, shape)
        runs[name] = list(zip(rec.propose_s, (tree.depth() for tree, _ in rec.rounds)))
    return {"hits": hits, "trials": trials, "follows_shape": follows, "depth": depth, "width": width,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "costs": {**call_costs(runs["chain"], narrow, runs["wide"]),
                      "round_s": loop_overhead(stats) + verify_extra([ar, stats], curve),
                      "round_ar_s": loop_overhead(ar) + verify_extra([ar, stats], curve)}}


def call_costs(one: list[tuple[float, int]], narrow: list[tuple[float, int]], wide: list[tuple[float, int]]
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


class NoDraft:
    """Plain decoding inside the calibration (decode's core may not import drafters.ar)."""

    name, hidden_ids, forward_passes = "ar", (), 0

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        pass

    def propose(self, budget: Budget) -> DraftTree:
        return DraftTree.empty()

    def accept(self, step: TargetStep) -> None:
        pass


# --- the cache --------------------------------------------------------------------------------


def target_identity(target: Target) -> str:
    """The target's name and a digest of its config (weights of another model under the same name differ there)."""
    cfg = json.dumps(target.config.to_dict(), sort_keys=True, default=str)
    name = Path(getattr(target, "name_or_path", "") or "model").name
    return f"{name}-{hashlib.sha256(cfg.encode()).hexdigest()[:12]}"


def cache_key(target_id: str, dtype: str, threads: int, depth: int, width: int) -> str:
    """One calibration per target, dtype, threads and caterpillar size (costs move with all of them)."""
    return f"{target_id}|{dtype}|threads={threads}|depth={depth},width={width}"


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
        return Path(spec) / "calibration.json"
    if run_dir is None:
        return None
    slug = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in spec)
    return Path(run_dir) / "calibration" / f"{slug}.json"


# --- putting it together ------------------------------------------------------------------------


@dataclass
class AutoChoice:
    """What --tree auto picked for one drafter, with the prediction the report sets against the measurement."""

    shape: Shape
    predicted: Candidate | None  # None: the drafter proposes its own trees (no shape to size)
    calibration: str  # the cache file ("" = not cached)
    cached: bool  # True: the calibration was read from the cache
    follows_shape: bool
    acceptance: Acceptance

    def summary(self) -> dict:
        pred = self.predicted
        return {"shape": shape_spec(self.shape), "follows_shape": self.follows_shape,
                "predicted_tau": pred.tau if pred else None,
                "predicted_speedup_vs_ar": pred.speedup if pred else None,
                "predicted_round_s": pred.round_s if pred else None,
                "calibration": self.calibration, "calibration_cached": self.cached,
                "acceptance_by_depth_rank": self.acceptance}

    def describe(self) -> str:
        """One line for the console: the choice and its predicted τ and speedup."""
        pred = self.predicted
        if pred is None:
            return f"{shape_spec(self.shape)} (the drafter proposes its own trees: nothing to size)"
        src = "cached calibration" if self.cached else "calibrated"
        return f"{pred.label}, predicted tau {pred.tau:.2f}, speedup {pred.speedup:.2f}x vs AR ({src})"


def pass_cost_curve(target: Target, prefix: int = 64) -> dict[int, float]:
    """The verification pass's seconds vs rows on this target, dtype and threads (decode.costmodel)."""
    tokens = tuple(n for n in CURVE_TOKENS if prefix + n <= target.max_positions)
    return measure_pass_cost(target, tokens, prefix=min(prefix, target.max_positions - max(tokens)), repeats=3)


def resolve(decode: DecodeFn, target: Target, drafter: Drafter, spec: str, prompts: list[Tensor],
            curve: dict[int, float], run_dir: str | Path | None = None, max_new_tokens: int = 64,
            depth: int = 8, width: int = 8, fallback: Shape = Shape()) -> AutoChoice:
    """Calibrate (or read the cache), then choose the shape with the most predicted tokens per second.

    A drafter that proposes its own trees (lookup) cannot be given a shape: it keeps `fallback`.
    """
    path = cache_path(spec, run_dir)
    key = cache_key(target_identity(target), str(target.dtype).removeprefix("torch."), torch.get_num_threads(),
                    depth, width)
    entry = load_cached(path, key) if path is not None else None
    cached = entry is not None
    if entry is None:
        entry = calibrate(decode, drafter, prompts, max_new_tokens, depth, width, curve)
        if path is not None and not store(path, key, entry):
            path = None
    p = acceptance(entry["hits"], entry["trials"])
    costs = Costs(width=entry["width"], **entry["costs"])
    verify_s = lambda n: cost_at(curve, n)  # noqa: E731
    if not (entry["follows_shape"] and p):
        return AutoChoice(fallback, None, str(path or ""), cached, entry["follows_shape"], p)
    best, _ = choose(p, costs, verify_s, len(p), entry["width"])
    return AutoChoice(best.shape, best, str(path or ""), cached, True, p)
