"""Verification of a draft tree against the target: pure functions, greedy and lossless sampling."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from decode.sampling import Rng
from decode.tree import DraftTree


@dataclass
class Verdict:
    """The accepted root-to-node path (node indices, shallowest first) and the bonus token after it."""

    path: list[int]
    bonus: int


@dataclass
class LazyRows:
    """Per-row target outputs computed on first use, memoised: `fn(h[rows])` for the requested row and `also(row)`.

    Verification only looks at the rows on the accepted path (about τ of the 1 + N), so the LM head
    (49k words on a chat model: a sixth of a pass per row) need not run over every tree node.
    `also(row)`: rows to compute in the same call (the row's children: the walk's next request is one of
    them). The head streams all its weights whatever the rows — in bf16 on a CPU one row costs 4.6 ms,
    five 5.8 ms — so a visit costs one stream per two levels of the path instead of one per level.
    Indexable like the [1 + N, ...] tensor it stands for.
    """

    fn: Callable[[Tensor], Tensor]  # [M, D] -> [M, ...]
    h: Tensor  # [1 + N, D]
    also: Callable[[int], list[int]] | None = None
    memo: dict[int, Tensor] = field(default_factory=dict)

    def __getitem__(self, row: int) -> Tensor:
        if row not in self.memo:
            rows = [row] + [r for r in (self.also(row) if self.also else []) if r not in self.memo]
            self.memo.update(zip(rows, self.fn(self.h[rows])))
        return self.memo[row]


def child_rows(tree: DraftTree) -> Callable[[int], list[int]]:
    """LazyRows' `also` for a draft tree: row -> the rows of its children (node i sits at row i + 1)."""
    children = tree.children()
    return lambda row: [c + 1 for c in children[row]]


def verify_greedy(tree: DraftTree, argmax: Tensor | LazyRows) -> Verdict:
    """Walk the tree accepting a child whose token is the target's argmax at its parent.

    argmax: [1 + N] target argmax at the root (row 0) and at every node (row i + 1), or LazyRows.
    """
    tokens = tree.tokens.tolist()
    children = tree.children()
    path, row = [], 0
    while True:
        want = int(argmax[row])
        nxt = next((c for c in children[row] if tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, want)
        path.append(nxt)
        row = nxt + 1


def verify_sampling(tree: DraftTree, p: Tensor | LazyRows, rng: Rng) -> Verdict:
    """Multi-draft recursive rejection sampling (SpecInfer; without-replacement variant), lossless.

    p: [1 + N, V] target probabilities (after temperature/top-k/top-p) at the root and every node
    (or LazyRows computing them row by row).
    At an accepted node with children x_1..x_m drawn from q:
      1. q_i = q with x_1..x_{i-1} zeroed and renormalised (i.i.d. draws: q_i = q);
      2. accept x_i with probability min(1, p(x_i) / q_i(x_i));
      3. on rejection p <- norm(max(p - q_i, 0)) and try the next child.
    Deterministic proposals (q is None) are point masses: accept x_i with probability p(x_i), else
    zero p(x_i) and renormalise. If every child is rejected, the bonus is drawn from the residual p.
    """
    tokens = tree.tokens.tolist()
    children = tree.children()
    path, row = [], 0
    while True:
        kids = children[row]
        residual = p[row].double().clone()
        q_cur = tree.q[kids[0]].double().clone() if (kids and tree.q is not None) else None
        accepted = None
        for x in kids:
            tok = tokens[x]
            if q_cur is None:  # point mass at tok
                if rng.accept(float(residual[tok])):
                    accepted = x
                    break
                residual[tok] = 0.0
            else:
                q_i = q_cur / q_cur.sum()
                if rng.accept(min(1.0, float(residual[tok] / q_i[tok]))):
                    accepted = x
                    break
                residual = torch.clamp(residual - q_i, min=0.0)
                if not tree.iid:
                    q_cur[tok] = 0.0
            total = residual.sum()
            if total <= 1e-300:  # only reachable through rounding when p == q_i exactly
                residual = p[row].double().clone()
                total = residual.sum()
            residual = residual / total
        if accepted is None:
            return Verdict(path, rng.categorical(residual))
        path.append(accepted)
        row = accepted + 1
