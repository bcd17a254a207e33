"""`skip:i,j,...`: the target with decoder layers i, j, ... (0-based) skipped (Draft & Verify).

The drafter shares the target's KV cache for committed tokens (as Draft & Verify does) and
drops its scratch entries before verification: with layers skipped, its states differ from the
target's, so nothing can be reused.
"""

from __future__ import annotations

from torch import Tensor

from decode.protocol import Budget, TargetStep
from decode.target import Target
from decode.tree import DraftTree
from drafters.common import CachedLM


class SkipDrafter:
    hidden_ids: tuple[int, ...] = ()

    def __init__(self, target: Target, skip: list[int]) -> None:
        L = target.num_layers
        bad = [i for i in skip if not 0 <= i < L]
        if bad or not skip:
            raise ValueError(f"skip:{','.join(map(str, skip))}: layer indices must be in 0..{L - 1} (got {bad or 'none'})")
        if len(set(skip)) >= L:
            raise ValueError("skip: cannot skip every layer")
        self.target, self.skip = target, frozenset(skip)
        self.name = "skip:" + ",".join(map(str, sorted(self.skip)))
        self.lm = CachedLM(self._run, target.dtype, target.device, L)

    @property
    def forward_passes(self) -> int:
        return self.lm.passes

    def _run(self, ids: Tensor, positions: Tensor, mask: Tensor | None, cache) -> tuple[Tensor, Tensor]:
        t = self.target
        h, _ = t.run_layers(t.embed(ids), 0, t.num_layers, cache, positions, mask, skip=self.skip)
        return t.head(h)[0], h[0]

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        self.lm.begin(prompt_ids, step, shared=True)

    def propose(self, budget: Budget) -> DraftTree:
        tree = self.lm.propose(budget)
        self.lm.drop_scratch()
        return tree

    def accept(self, step: TargetStep) -> None:
        self.lm.accept(step)
