"""`early-exit:K`: the target's first K layers + its final norm + LM head, untrained (LayerSkip-style).

Drafting runs layers [0, K) on the target's own KV cache: below the committed length those
entries are exactly what the target computed, and the draft tokens' entries written past it are
exactly what verification would compute for layers [0, K). So a chain's verification pass
*reuses* them and the layer-K states, running only layers [K, L) for the drafted rows (plus
layers [0, K) for the last draft token, which the drafter never ran). Trees grown in another
order than their verification rows drop the scratch and verify from scratch.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from decode.protocol import Budget, TargetStep
from decode.target import LayerReuse, Target
from decode.tree import DraftTree
from drafters.common import CachedLM


class EarlyExitDrafter:
    hidden_ids: tuple[int, ...] = ()

    def __init__(self, target: Target, k: int, reuse: bool = True, head: Callable[[Tensor], Tensor] | None = None,
                 name: str | None = None) -> None:
        """head: pre-norm layer-K states [1, T, D] -> logits [1, T, V]; None = the target's norm + LM head
        (LayerSkip passes its trained exit head)."""
        if not 1 <= k < target.num_layers:
            raise ValueError(f"early-exit:{k}: K must be in 1..{target.num_layers - 1} for a {target.num_layers}-layer target")
        self.target, self.k, self.use_reuse = target, k, reuse
        self.head = head or target.head
        self.name = name or f"early-exit:{k}"
        self.lm = CachedLM(self._run, target.dtype, target.device, target.num_layers)
        self._reuse: LayerReuse | None = None

    @property
    def forward_passes(self) -> int:
        return self.lm.passes

    def _run(self, ids: Tensor, positions: Tensor, mask: Tensor | None, cache) -> tuple[Tensor, Tensor]:
        h, _ = self.target.run_layers(self.target.embed(ids), 0, self.k, cache, positions, mask)
        return self.head(h)[0], h[0]  # [T, V], [T, D]

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        self.lm.begin(prompt_ids, step, shared=True)

    def propose(self, budget: Budget) -> DraftTree:
        tree = self.lm.propose(budget)
        self._reuse = None
        if self.use_reuse and budget.shape.kind == "chain" and tree.size:
            # chain: scratch slots (root, d1..d_{k-1}) are verification rows 0..k-1, in order
            self._reuse = LayerReuse(self.k, self.lm.scratch_states())
        else:
            self.lm.drop_scratch()
        return tree

    def reuse(self) -> LayerReuse | None:
        return self._reuse

    def accept(self, step: TargetStep) -> None:
        self.lm.accept(step)
