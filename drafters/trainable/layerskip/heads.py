"""LayerSkip's exit heads: per exit layer E, RMSNorm (initialised from the target's final norm) plus an
optional low-rank adapter, before the target's frozen LM head. Untrained, exit E is exactly `early-exit:E`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from drafters.trainable.draft_layer import RMSNorm


class ExitHead(nn.Module):
    """RMSNorm (+ z + up(down(z)), up zero-init) before the frozen LM head."""

    def __init__(self, norm_weight: Tensor, eps: float, rank: int) -> None:
        super().__init__()
        H = norm_weight.numel()
        self.norm = RMSNorm(H, eps)
        with torch.no_grad():
            self.norm.weight.copy_(norm_weight)
        if rank:
            self.down = nn.Linear(H, rank, bias=False)
            self.up = nn.Linear(rank, H, bias=False)
            nn.init.zeros_(self.up.weight)

    def forward(self, h: Tensor) -> Tensor:
        z = self.norm(h)
        return z + self.up(self.down(z)) if hasattr(self, "up") else z


def exit_logits(head: ExitHead, lm_head: nn.Linear, h: Tensor) -> Tensor:
    """Exit head + frozen LM head on pre-norm layer-E states [.., H] -> logits [.., V]."""
    z = head(h.to(head.norm.weight.dtype))
    return lm_head(z.to(lm_head.weight.dtype))
