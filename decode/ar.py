"""`ar`: no drafter. Every round verifies the pending token alone: plain autoregressive decoding."""

from __future__ import annotations

from torch import Tensor

from decode.protocol import Budget, TargetStep
from decode.tree import DraftTree


class ARDrafter:
    """Proposes nothing: every round verifies the pending token alone."""

    name = "ar"
    hidden_ids: tuple[int, ...] = ()
    forward_passes = 0

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        pass

    def propose(self, budget: Budget) -> DraftTree:
        return DraftTree.empty()

    def accept(self, step: TargetStep) -> None:
        pass
