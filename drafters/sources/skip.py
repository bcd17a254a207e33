"""`skip:i,j,...`: the target with decoder layers i, j, ... (0-based) skipped (Draft & Verify).

The drafter shares the target's KV cache for committed tokens (as Draft & Verify does) and
drops its scratch entries before verification: with layers skipped, its states differ from the
target's, so nothing can be reused.
"""

from __future__ import annotations

from torch import Tensor

from decode.target import Target
from drafters.common import LMDrafter


def skip_layers(target: Target, skip: list[int]) -> LMDrafter:
    L = target.num_layers
    bad = [i for i in skip if not 0 <= i < L]
    if bad or not skip:
        raise ValueError(f"skip:{','.join(map(str, skip))}: layer indices must be in 0..{L - 1} (got {bad or 'none'})")
    if len(set(skip)) >= L:
        raise ValueError("skip: cannot skip every layer")
    skipped = frozenset(skip)

    def run(ids: Tensor, positions: Tensor, mask: Tensor | None, cache) -> tuple[Tensor, Tensor]:
        h, _ = target.run_layers(target.embed(ids), 0, L, cache, positions, mask, skip=skipped)
        return target.head(h)[0], h[0]

    return LMDrafter("skip:" + ",".join(map(str, sorted(skipped))), run, target.dtype, target.device, L, shared=True)
