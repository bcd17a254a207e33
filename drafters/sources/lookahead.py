"""`lookahead[:window=8,ngram=4,guesses=8]`: lookahead decoding (Fu et al. 2024), training-free and lossless.

The target drafts for itself. Every target pass carries two branches under one combined mask:
- the verification branch: the n-grams of the pool that start with the pending token, merged into
  a tree and verified like any draft (so the output is exactly the target's);
- the lookahead branch: a window of Jacobi iterates whose outputs become new n-grams for the pool.
These side rows see the prefix, the pending token and each other, never the tree; the tree never
sees them, and their KV is dropped when the cache is compacted (decode.masks.SideRows).

The window (W = window, N = ngram) has rows 0..N-2 over columns 0..W-1, root = the pending token
at position p. Row 0 holds columns 1..W-1 (column 0 is the root); rows r >= 1 hold all W columns.
Token (r, j) sits at position p + j + r and sees the root, row 0 up to column j and rows 1..r of
column j: a consecutive sequence p .. p + j + r, one Jacobi trajectory per column. Per pass:
1. the top row's outputs o_j (target argmax) close one n-gram per column:
   (key_j, row_1[j], ..., row_{N-2}[j], o_j), key_0 = root, key_j = row_0[j]; the pool keeps the
   `guesses` most recent per key (LRU), only once the window holds model outputs;
2. the window moves one position (as the reference implementation does, whatever was accepted):
   row 0 <- row 1 without column 0, row r <- row r + 1, top row <- o.
The window starts as tokens copied at random (seeded) from the prompt, as in the reference code.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from decode.masks import SideRows
from decode.protocol import Budget, TargetStep
from decode.target import Target
from decode.tree import DraftTree
from drafters.sources.prompt_lookup import trie


def window_layout(window: int, ngram: int) -> tuple[list[tuple[int, int]], Tensor, Tensor]:
    """Side-row order [(row, column)], position offsets [E] and visibility [E, 1 + E] (column 0 = root)."""
    cells = [(0, j) for j in range(1, window)] + [(r, j) for r in range(1, ngram - 1) for j in range(window)]
    where = {c: i for i, c in enumerate(cells)}
    see = torch.zeros(len(cells), 1 + len(cells), dtype=torch.bool)
    for i, (r, j) in enumerate(cells):
        see[i, 0] = True  # the root
        for c in range(1, j + 1):  # row 0 up to this column
            see[i, 1 + where[(0, c)]] = True
        for s in range(1, r + 1):  # this column, rows 1..r
            see[i, 1 + where[(s, j)]] = True
    offsets = torch.tensor([r + j for r, j in cells], dtype=torch.long)
    return cells, offsets, see


class LookaheadDrafter:
    hidden_ids: tuple[int, ...] = ()
    forward_passes = 0  # the target runs the lookahead branch in its own pass
    token_probs = False  # pool n-grams carry no probabilities: confidence-based length policies refuse

    def __init__(self, target: Target, window: int = 8, ngram: int = 4, guesses: int = 8, seed: int = 0) -> None:
        if window < 2 or ngram < 3 or guesses < 1:
            raise ValueError(
                f"lookahead: need window >= 2, ngram >= 3, guesses >= 1 "
                f"(got window={window}, ngram={ngram}, guesses={guesses})"
            )
        self.target, self.window, self.ngram, self.guesses = target, window, ngram, guesses
        self.name = f"lookahead:window={window},ngram={ngram},guesses={guesses}"
        self.cells, self.offsets, self.see = window_layout(window, ngram)
        self.seed = seed
        self.context: list[int] = []
        self.rows: list[list[int]] = []  # rows[0]: W - 1 tokens (columns 1..W-1); rows[r >= 1]: W tokens
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> following N-1 tokens, oldest first
        self.passes = 0  # lookahead passes so far (the window holds model outputs after N - 1)
        self.committed = 0
        self._side: SideRows | None = None

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        self.context = prompt_ids.tolist()[:1] + step.tokens.tolist()
        rng = random.Random(self.seed)
        prompt = prompt_ids.tolist()
        self.rows = [[rng.choice(prompt) for _ in range(self.window - (r == 0))] for r in range(self.ngram - 1)]
        self.pool, self.passes, self.committed, self._side = {}, 0, step.committed, None

    def propose(self, budget: Budget) -> DraftTree:
        # 1. lookahead branch: the window as side rows, unless it would run past the model's positions
        fits = self.committed + int(self.offsets.max()) < self.target.max_positions
        tokens = torch.tensor([self.rows[r][j - (r == 0)] for r, j in self.cells], dtype=torch.long)
        self._side = SideRows(tokens, self.offsets, self.see) if fits else None
        # 2. verification branch: the pool's n-grams that continue the pending token, newest first
        depth = min(self.ngram - 1, budget.shape.max_depth)
        if depth <= 0:
            return DraftTree.empty()
        grams = reversed(self.pool.get(self.context[-1], []))
        return trie([list(g[:depth]) for g in grams])

    def side_rows(self) -> SideRows | None:
        return self._side

    def accept(self, step: TargetStep) -> None:
        root = self.context[-1]
        self.context.extend(step.tokens.tolist())
        self.committed = step.committed
        if self._side is None or step.side_logits is None:
            return
        top = step.side_logits[-self.window :].argmax(-1).tolist()  # the top row's outputs, columns 0..W-1
        # 1. harvest one n-gram per column once every row holds model outputs
        if self.passes >= self.ngram - 1:
            for j in range(self.window):
                key = root if j == 0 else self.rows[0][j - 1]
                self.remember(key, tuple(self.rows[r][j] for r in range(1, self.ngram - 1)) + (top[j],))
        # 2. move the window one position
        self.rows = [self.rows[1][1:]] + self.rows[2:] + [top]
        self.passes += 1

    def remember(self, key: int, gram: tuple[int, ...]) -> None:
        """Add an n-gram to the pool, most recent last, keeping `guesses` per key (LRU)."""
        grams = self.pool.setdefault(key, [])
        if gram in grams:
            grams.remove(gram)
        grams.append(gram)
        if len(grams) > self.guesses:
            del grams[0]
