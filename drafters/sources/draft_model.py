"""`draft-model:DIR`: a separate small causal LM sharing the target's tokenizer, with its own KV cache."""

from __future__ import annotations

from torch import Tensor

from decode.loading import check_same_tokenizer
from decode.target import Target
from drafters.common import LMDrafter


def draft_model(target: Target, draft: Target, name: str = "draft-model") -> LMDrafter:
    """A separate model drafting on its own KV cache (catching up on accepted tokens each round)."""
    check_same_tokenizer(target, draft, name)

    def run(ids: Tensor, positions: Tensor, mask: Tensor | None, cache) -> tuple[Tensor, Tensor]:
        out = draft.forward(ids, cache, positions, mask)
        return out.logits[:, : target.vocab_size], out.last

    return LMDrafter(name, run, draft.dtype, draft.device, draft.num_layers, shared=False)
