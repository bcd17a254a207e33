"""`--tree auto`: the draft shape with the most expected tokens per second (Sequoia-style sizing).

The model, as pure functions:
- acceptance: p[d][r] = probability that the rank-r child (r-th most likely under the drafter) of a
  node at depth d is the target's token, given that node was accepted (greedy). **Independence
  assumption:** p depends only on (depth, rank), not on the ranks along the path above, and at most
  one sibling matches (greedy verification has one right token). A node is then accepted with the
  product of p over its path, and a tree's expected accepted length is the sum of that over its nodes.
- cost of a round: the drafter's per-round work + its calls (a chain of k makes k calls of one node;
  EAGLE-2's dynamic tree one root call and depth - 1 calls of top-k nodes) + the target pass over
  1 + nodes rows (the pass-cost curve decode.costmodel measures in this run) + the verify step's work
  beyond that bare pass (a line in the rows: AR's at one row, the calibration tree's at its rows) + the
  loop's overhead.
- tokens/s = E[accepted + 1] / round cost; a small grid of chains and dynamic trees is searched, and "no drafting"
  (a chain of 0: plain decoding, speedup 1 by definition) competes with them — on a CPU without bf16 no shape of the
  chat drafter pays (a verify pass grows steeply with its rows in fp32), and auto then decodes plainly.
p and the costs come from decode.harness.calibration (measured with the real decoder; p cached with the drafter).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from decode.costmodel import cost_at, measure_pass_cost
from decode.harness import calibration as cal
from decode.protocol import Drafter
from decode.target import Target
from decode.tree import Shape

AUTO = "auto"
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
    verify_extra_1: float = 0.0  # the verify step's seconds beyond the bare pass, at one row (AR)
    verify_extra_per_row: float = 0.0  # ... and per further row (tree mask, LM head on visited rows)

    def call(self, w: int) -> float:
        """A drafter call over w nodes: linear between the two measured widths."""
        if self.width <= 1:
            return self.call_1
        return max(0.0, self.call_1 + (self.call_w - self.call_1) * (w - 1) / (self.width - 1))

    def verify_extra(self, rows: int) -> float:
        """The verify step's seconds beyond the bare pass over `rows` rows: linear from AR's one row."""
        return self.verify_extra_1 + self.verify_extra_per_row * (rows - 1)


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
        return f"chain k={shape.k}" if shape.k else "no drafting (chain k=0)"
    return f"dynamic:topk={shape.topk},depth={shape.depth},nodes={shape.nodes}"


def predict(p: Acceptance, shape: Shape, costs: Costs, verify_s: Callable[[float], float]) -> Candidate:
    """Expected tokens per round, its seconds and the speedup over AR for a chain or dynamic shape."""
    ar_s = verify_s(1) + costs.verify_extra(1) + costs.round_ar_s
    if shape.kind == "chain" and shape.k == 0:  # no drafting: the drafter is never called, AR's round
        return Candidate(shape, shape_spec(shape), 1.0, ar_s, 1.0)
    if shape.kind == "chain":
        paths, draft = chain_paths(shape.k), costs.round_draft_s + shape.k * costs.call(1)
    else:
        paths = dynamic_paths(p, shape.topk, shape.depth, shape.nodes)
        draft = costs.round_draft_s + costs.call(1) + (shape.depth - 1) * costs.call(shape.topk)
    tau = 1.0 + expected_accepted(p, paths)
    rows = 1 + len(paths)
    round_s = draft + verify_s(rows) + costs.verify_extra(rows) + costs.round_s
    return Candidate(shape, shape_spec(shape), tau, round_s, (tau / round_s) * ar_s)


def grid(max_depth: int, width: int) -> list[Shape]:
    """No drafting (chain 0), chains of 1..max_depth and dynamic trees (top-k 2/4/8 up to the calibrated width,
    depth 1 (the root's top-k) and a few more depths and sizes)."""
    shapes = [Shape("chain", k=k) for k in range(0, max_depth + 1)]
    for topk in (t for t in (2, 4, 8) if t <= width):
        # depth 1: the root's top-k, one drafter call; on a bf16 CPU it beat every deeper shape for the chat
        # drafter (top-4: 1.31-1.35x AR vs 1.22x for topk=4,depth=2,nodes=8), the verify pass being flat in rows
        shapes.append(Shape("dynamic", topk=topk, depth=1, nodes=topk))
        for depth in (d for d in (2, 3, 4, 6, 8) if d <= max_depth):
            for nodes in (n for n in (4, 8, 12, 16, 24, 32, 48, 64) if topk < n <= topk * depth):
                shapes.append(Shape("dynamic", topk=topk, depth=depth, nodes=nodes))
    return shapes


def choose(
    p: Acceptance, costs: Costs, verify_s: Callable[[float], float], max_depth: int, width: int
) -> tuple[Candidate, list[Candidate]]:
    """The grid's best candidate by predicted tokens/s (ties: the fewer rows), and every candidate."""
    cands = [predict(p, s, costs, verify_s) for s in grid(max_depth, width)]
    best = max(cands, key=lambda c: (round(c.tau / c.round_s, 9), -c.round_s))
    return best, cands


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
        return {
            "shape": shape_spec(self.shape),
            "follows_shape": self.follows_shape,
            "predicted_tau": pred.tau if pred else None,
            "predicted_speedup_vs_ar": pred.speedup if pred else None,
            "predicted_round_s": pred.round_s if pred else None,
            "calibration": self.calibration,
            "calibration_cached": self.cached,
            "acceptance_by_depth_rank": self.acceptance,
        }

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
    # the fastest of 5 rotated rounds: the cost of the pass itself, not of the other jobs pre-empting it (the
    # calibrated drafter costs and the measured rows pay the machine's load alike)
    return measure_pass_cost(
        target, tokens, prefix=min(prefix, target.max_positions - max(tokens)), repeats=5, reduce=min
    )


def resolve(
    decode: cal.DecodeFn,
    target: Target,
    drafter: Drafter,
    spec: str,
    prompts: list[Tensor],
    curve: dict[int, float],
    run_dir: str | Path | None = None,
    max_new_tokens: int = 64,
    depth: int = 8,
    width: int = 8,
    fallback: Shape = Shape(),
) -> AutoChoice:
    """Calibrate the acceptance (or read it from the cache), measure the costs, then choose the shape with the
    most predicted tokens per second.

    A drafter that proposes its own trees (lookup) cannot be given a shape: it keeps `fallback`.
    """
    path = cal.cache_path(spec, run_dir)
    key = cal.cache_key(
        cal.target_identity(target), str(target.dtype).removeprefix("torch."), depth, width, cal.drafter_stamp(spec)
    )
    entry = cal.load_cached(path, key) if path is not None else None
    if entry is not None and entry.get("prompts", 0) < len(prompts):
        entry = None  # measured on fewer prompts than this run calibrates on (a one-prompt `generate`): measure again
    cached = entry is not None
    if entry is None:
        entry = cal.measure_acceptance(decode, drafter, prompts, max_new_tokens, depth, width)
        if path is not None and not cal.store(path, key, entry):
            path = None
    p = acceptance(entry["hits"], entry["trials"])
    if not (entry["follows_shape"] and p):
        return AutoChoice(fallback, None, str(path or ""), cached, entry["follows_shape"], p)
    costs = Costs(width=width, **cal.measure_costs(decode, drafter, prompts[0], max_new_tokens, depth, width, curve))
    verify_s = lambda n: cost_at(curve, n)  # noqa: E731
    best, _ = choose(p, costs, verify_s, len(p), width)
    return AutoChoice(best.shape, best, str(path or ""), cached, True, p)
