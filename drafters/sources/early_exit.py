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

from decode.target import Target
from drafters.common import LMDrafter


def early_exit(
    target: Target, k: int, reuse: bool = True, head: Callable[[Tensor], Tensor] | None = None, name: str | None = None
) -> LMDrafter:
    """head: pre-norm layer-K states [1, T, D] -> logits [1, T, V]; None = the target's norm + LM head
    (LayerSkip passes its trained exit head)."""
    if not 1 <= k < target.num_layers:
        raise ValueError(
            f"early-exit:{k}: K must be in 1..{target.num_layers - 1} for a {target.num_layers}-layer target"
        )
    head = head or target.head

    def run(ids: Tensor, positions: Tensor, mask: Tensor | None, cache) -> tuple[Tensor, Tensor]:
        h, _ = target.run_layers(target.embed(ids), 0, k, cache, positions, mask)
        return head(h)[0], h[0]  # [T, V], [T, D]

    return LMDrafter(
        name or f"early-exit:{k}",
        run,
        target.dtype,
        target.device,
        target.num_layers,
        shared=True,
        reuse_layers=k if reuse else 0,
    )
