"""Draft trees: the DraftTree type, its masks and depths, and the shapes drafters grow (pure functions).

A tree's node i has a token and a parent index (-1 = child of the root, the last emitted token
that the target has not processed yet). Parents precede children. A chain is parents [-1, 0, 1, ...].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from decode.errors import read_json


@dataclass
class DraftTree:
    """What every drafter proposes: tokens [N], parents [N] (-1 = root), and q [N, V] or None.

    q[i] is the distribution node i was drawn from (siblings share it); None means a
    deterministic proposal (top-k, lookup), verified as a point mass. conf[i] is the drafter's
    probability of token i (what adaptive length policies read); None = the drafter exposes none.
    """

    tokens: Tensor  # [N] long
    parents: Tensor  # [N] long
    q: Tensor | None = None  # [N, V]
    iid: bool = False  # siblings drawn i.i.d. (with replacement) rather than without replacement
    conf: Tensor | None = None  # [N] float

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).view(-1)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).view(-1)
        if self.tokens.shape != self.parents.shape:
            raise ValueError(f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} differ")
        if self.size and bool((self.parents >= torch.arange(self.size)).any()):
            raise ValueError("a parent must precede its child")

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @staticmethod
    def empty() -> DraftTree:
        return DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    @staticmethod
    def chain(tokens, q: Tensor | None = None, conf: Tensor | None = None) -> DraftTree:
        tokens = torch.as_tensor(tokens, dtype=torch.long).view(-1)
        return DraftTree(tokens, torch.arange(tokens.numel()) - 1, q, conf=conf)

    def children(self) -> list[list[int]]:
        """children[0] = root's children; children[i + 1] = node i's children, in node order."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out

    def depth(self) -> int:
        return int(tree_depths(self.parents).max()) + 1 if self.size else 0

    def truncate_depth(self, max_depth: int) -> DraftTree:
        """Drop nodes deeper than max_depth (depth 1 = root's children)."""
        if not self.size:
            return self
        keep = (tree_depths(self.parents) + 1 <= max_depth).nonzero().view(-1)
        return self.select(keep)

    def select(self, keep: Tensor) -> DraftTree:
        """The subtree of nodes `keep` (sorted, closed under parents), re-indexed."""
        remap = torch.full((self.size + 1,), -1, dtype=torch.long)
        remap[keep + 1] = torch.arange(keep.numel())
        parents = remap[self.parents[keep] + 1]
        q = self.q[keep] if self.q is not None else None
        conf = self.conf[keep] if self.conf is not None else None
        return DraftTree(self.tokens[keep], parents, q, self.iid, conf)


def tree_depths(parents: Tensor) -> Tensor:
    """Depth of each node, root's children at 0. parents [N] -> [N]."""
    depth = torch.zeros(parents.numel(), dtype=torch.long)
    par = parents.tolist()
    for i, p in enumerate(par):
        depth[i] = 0 if p < 0 else depth[p] + 1
    return depth


def ancestor_matrix(parents: Tensor) -> Tensor:
    """anc[i, j] = node j is node i or one of its ancestors. [N] -> bool [N, N]"""
    n = parents.numel()
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def tree_attention_mask(parents: Tensor, prefix: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """Additive float mask [1, 1, N, prefix + N]: each node sees the whole prefix and its ancestors."""
    n = parents.numel()
    m = torch.zeros(n, prefix + n, dtype=dtype)
    m[:, prefix:].masked_fill_(~ancestor_matrix(parents), torch.finfo(dtype).min)
    return m.to(device).view(1, 1, n, prefix + n)


def path_to(parents: Tensor, node: int) -> list[int]:
    """Node indices from the root's child down to `node` (empty for the root, node = -1)."""
    out, par = [], parents.tolist()
    while node >= 0:
        out.append(node)
        node = par[node]
    return out[::-1]


# --- shapes -------------------------------------------------------------------------------

# A chain's stop rule (set by an adaptive length policy): given the drafter's probabilities of the
# tokens drafted so far this round, True = stop after the last one (it stays in the draft).
StopRule = Callable[[list[float]], bool]


@dataclass(frozen=True)
class Shape:
    """How to grow a draft: `chain` (k tokens), `static` (a choice list), or `dynamic` (EAGLE-2)."""

    kind: str = "chain"
    k: int = 8  # chain length (the most a stop rule lets it reach)
    stop: StopRule | None = field(default=None, compare=False)  # chain: stop early (policies)
    choices: tuple[tuple[int, ...], ...] = ()  # static: each path is a tuple of child ranks
    topk: int = 8  # dynamic: children expanded per frontier node and frontier width
    depth: int = 6  # dynamic: levels
    nodes: int = 60  # dynamic: nodes kept after reranking

    @property
    def max_depth(self) -> int:
        return {"chain": self.k, "static": max((len(c) for c in self.choices), default=0)}.get(self.kind, self.depth)


def parse_shape(spec: str, draft_len: int = 8) -> Shape:
    """`chain`, `static:FILE` (json list of paths), `dynamic:topk=8,depth=6,nodes=60`."""
    kind, _, arg = spec.partition(":")
    if kind == "chain":
        if draft_len < 1:
            raise ValueError(
                f"--draft-len {draft_len}: a chain needs at least 1 token (use --drafter ar for plain decoding)"
            )
        return Shape("chain", k=draft_len)
    if kind == "static":
        return Shape("static", choices=read_choices(arg))
    if kind == "dynamic":
        kw = dict(topk=8, depth=6, nodes=60)
        for part in filter(None, arg.split(",")):
            key, eq, val = part.partition("=")
            if not eq or key not in kw:
                raise ValueError(f"--tree {spec!r}: option {part!r} not one of {sorted(kw)} (form key=value)")
            try:
                kw[key] = int(val)
            except ValueError:
                raise ValueError(f"--tree {spec!r}: {key} needs an integer, got {val!r}") from None
            if kw[key] < 1:
                raise ValueError(
                    f"--tree {spec!r}: {key} must be >= 1, got {kw[key]} (a tree with no nodes drafts "
                    "nothing; use --drafter ar for plain decoding)"
                )
        return Shape("dynamic", **kw)
    raise ValueError(f"--tree {spec!r}: expected chain | static:FILE | dynamic:topk=..,depth=..,nodes=..")


def read_choices(arg: str) -> tuple[tuple[int, ...], ...]:
    """A static tree file: a json list of paths, each a list of child ranks (>= 0), every prefix listed too."""
    if not arg or not Path(arg).is_file():
        raise FileNotFoundError(f"--tree static:FILE needs a json file of choice paths, got {arg!r}")
    form = "write a json list of paths of child ranks, e.g. [[0], [1], [0, 0]]"
    raw = read_json(arg, form)
    if not isinstance(raw, list) or not all(
        isinstance(c, list) and c and all(type(x) is int and x >= 0 for x in c) for c in raw
    ):
        raise ValueError(f"--tree static:{arg}: not a list of non-empty lists of ranks >= 0; {form}")
    choices = tuple(sorted({tuple(c) for c in raw}, key=lambda c: (len(c), c)))
    for c in choices:
        if len(c) > 1 and c[:-1] not in choices:
            raise ValueError(f"--tree static:{arg}: path {list(c)} has no parent path {list(c[:-1])}; add it")
    return choices


# A drafter's step function: given new nodes (ids [n] in grown order, tokens [n], parent ids [n],
# -1 = root), run the drafter on them and return their next-token log-probs [n, V] — or [n, N] over
# the columns of the grower's `vocab` (column j = target token vocab[j]; an EAGLE-3 draft vocabulary),
# so no drafter has to spread a small vocabulary over the target's and rank 49k-wide rows each step.
# The root itself comes first as ids [-1], tokens [root token], parents [-2].
StepFn = Callable[[list[int], list[int], list[int]], Tensor]
# A chain's draw from one row of log-probs: (column, q over the target vocabulary [V] or None).
SampleFn = Callable[[Tensor], tuple[int, Tensor | None]]


def step_root(step: StepFn, root: int) -> Tensor:
    return step([-1], [root], [-2])[0]


def to_ids(cols: Tensor, vocab: Tensor | None) -> list[int]:
    """Log-prob columns [n] -> target token ids (vocab None: the columns are the ids)."""
    return (cols if vocab is None else vocab[cols.to(vocab.device)]).tolist()


def grow_chain(
    step: StepFn, root: int, k: int, sample: SampleFn, stop: StopRule | None = None, vocab: Tensor | None = None
) -> DraftTree:
    """Up to k tokens, each drawn by `sample(logprobs) -> (column, q or None)` from the previous one.

    After each token, `stop(confidences so far)` may end the chain early (before the next drafter
    step is paid for). conf records the drafter's probability of each drafted token.
    """
    if k <= 0:
        return DraftTree.empty()
    lp = step_root(step, root)
    tokens, qs, conf = [], [], []
    for i in range(k):
        col, q = sample(lp)
        tok = col if vocab is None else int(vocab[col])
        tokens.append(tok)
        qs.append(q)
        conf.append(float(lp[col].exp()))
        if i + 1 == k or (stop is not None and stop(conf)):
            break
        lp = step([i], [tok], [i - 1])[0]
    q = torch.stack(qs) if qs and qs[0] is not None else None
    return DraftTree.chain(tokens, q, torch.tensor(conf))


def grow_static(
    step: StepFn, root: int, choices: tuple[tuple[int, ...], ...], vocab: Tensor | None = None
) -> DraftTree:
    """Medusa-style static tree: path (r1, r2, ...) = the r1-th best child, then its r2-th best..."""
    if not choices:
        return DraftTree.empty()
    lp_root = step_root(step, root)
    index: dict[tuple[int, ...], int] = {}
    tokens, parents = [], []
    logprobs: dict[tuple[int, ...], Tensor] = {(): lp_root}
    for depth in range(1, max((len(c) for c in choices), default=0) + 1):
        level = [c for c in choices if len(c) == depth]
        for c in level:
            ranked = torch.topk(logprobs[c[:-1]], c[-1] + 1).indices
            index[c] = len(tokens)
            tokens.append(to_ids(ranked[c[-1] : c[-1] + 1], vocab)[0])
            parents.append(index[c[:-1]] if depth > 1 else -1)
        expand = [c for c in level if any(len(d) == depth + 1 and d[:-1] == c for d in choices)]
        if expand:
            lps = step(
                [index[c] for c in expand], [tokens[index[c]] for c in expand], [parents[index[c]] for c in expand]
            )
            for c, lp in zip(expand, lps):
                logprobs[c] = lp
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def grow_dynamic(step: StepFn, root: int, topk: int, depth: int, nodes: int, vocab: Tensor | None = None) -> DraftTree:
    """EAGLE-2: expand the top-k children of the best frontier nodes by cumulative log-prob, rerank.

    1. root -> its top-k children form the first level;
    2. for each further level, run the drafter on the top-k frontier nodes (by cumulative
       log-prob), each proposing top-k children; keep the best top-k of those as the next frontier;
    3. rerank all grown nodes by cumulative log-prob, keep the best `nodes` (closed under parents
       because a child's score never exceeds its parent's), and order parents before children.
    """
    if depth <= 0 or nodes <= 0:
        return DraftTree.empty()
    lp = step_root(step, root)
    topk = min(topk, lp.numel())
    top = torch.topk(lp, topk)
    tokens, parents, scores = to_ids(top.indices, vocab), [-1] * topk, top.values.tolist()
    frontier = list(range(topk))
    for _ in range(depth - 1):
        lps = step(frontier, [tokens[i] for i in frontier], [parents[i] for i in frontier])
        cand = torch.tensor([scores[i] for i in frontier], device=lps.device).view(-1, 1) + lps  # [F, V or N]
        best = torch.topk(cand.view(-1), topk)
        flat = best.indices
        new = []
        for f, tok, score in zip(
            (flat // cand.shape[1]).tolist(), to_ids(flat % cand.shape[1], vocab), best.values.tolist()
        ):
            new.append(len(tokens))
            tokens.append(tok)
            parents.append(frontier[f])
            scores.append(score)
        frontier = new
    # 3. rerank; ties broken by index so a parent (earlier) always wins over its child.
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[:nodes]
    keep = set(order)
    for i in list(keep):  # close under parents (ties can break the score argument)
        p = parents[i]
        while p >= 0 and p not in keep:
            keep.add(p)
            p = parents[p]
    kept = sorted(keep)
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    return tree.select(torch.tensor(kept, dtype=torch.long))


def grow(step: StepFn, root: int, shape: Shape, sample: SampleFn, vocab: Tensor | None = None) -> DraftTree:
    """Grow a draft of the given shape with a drafter's step function (log-probs over `vocab`'s columns
    when given: `sample` then returns a column and q over the target vocabulary)."""
    if shape.kind == "chain":
        return grow_chain(step, root, shape.k, sample, shape.stop, vocab)
    if shape.kind == "static":
        return grow_static(step, root, shape.choices, vocab)
    if shape.kind == "dynamic":
        return grow_dynamic(step, root, shape.topk, shape.depth, shape.nodes, vocab)
    raise ValueError(f"unknown draft shape {shape.kind!r}")
