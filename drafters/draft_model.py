"""`draft-model:DIR`: a separate small causal LM sharing the target's tokenizer, with its own KV cache."""

from __future__ import annotations

from torch import Tensor

from decode.target import Target
from drafters.common import LMDrafter


def check_same_tokenizer(target: Target, draft: Target, what: str) -> None:
    """Refuse a drafter whose vocabulary (token -> id) or special tokens differ from the target's."""
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is None or dt is None:
        if target.vocab_size != draft.vocab_size:
            raise ValueError(f"{what}: vocab size {draft.vocab_size} differs from the target's {target.vocab_size}")
        return
    if tt.get_vocab() != dt.get_vocab():
        a, b = tt.get_vocab(), dt.get_vocab()
        diff = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise ValueError(f"{what}: its tokenizer differs from the target's ({len(a)} vs {len(b)} tokens; "
                         f"e.g. {diff}); a draft model must share the target's tokenizer")
    for attr in ("bos_token_id", "eos_token_id"):
        if getattr(tt, attr) != getattr(dt, attr):
            raise ValueError(f"{what}: {attr} {getattr(dt, attr)} differs from the target's {getattr(tt, attr)}")
    if draft.vocab_size < len(tt.get_vocab()):
        raise ValueError(f"{what}: LM head covers {draft.vocab_size} tokens, the tokenizer has {len(tt.get_vocab())}")


def draft_model(target: Target, draft: Target, name: str = "draft-model") -> LMDrafter:
    """A separate model drafting on its own KV cache (catching up on accepted tokens each round)."""
    check_same_tokenizer(target, draft, name)

    def run(ids: Tensor, positions: Tensor, mask: Tensor | None, cache) -> tuple[Tensor, Tensor]:
        out = draft.forward(ids, cache, positions, mask)
        return out.logits[:, : target.vocab_size], out.last

    return LMDrafter(name, run, draft.dtype, draft.device, draft.num_layers, shared=False)
