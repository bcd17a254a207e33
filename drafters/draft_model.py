"""`draft-model:DIR`: a separate small causal LM sharing the target's tokenizer, with its own KV cache."""

from __future__ import annotations

from torch import Tensor

from decode.protocol import Budget, TargetStep
from decode.target import Target
from decode.tree import DraftTree
from drafters.common import CachedLM


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


class DraftModelDrafter:
    hidden_ids: tuple[int, ...] = ()

    def __init__(self, target: Target, draft: Target, name: str = "draft-model") -> None:
        check_same_tokenizer(target, draft, name)
        self.target, self.draft, self.name = target, draft, name
        self.lm = CachedLM(self._run, draft.dtype, draft.device, draft.num_layers)

    @property
    def forward_passes(self) -> int:
        return self.lm.passes

    def _run(self, ids: Tensor, positions: Tensor, mask: Tensor | None, cache) -> tuple[Tensor, Tensor]:
        out = self.draft.forward(ids, cache, positions, mask)
        return out.logits[:, : self.target.vocab_size], out.last

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None:
        self.lm.begin(prompt_ids, step, shared=False)

    def propose(self, budget: Budget) -> DraftTree:
        tree = self.lm.propose(budget)
        self.lm.drop_scratch()
        return tree

    def accept(self, step: TargetStep) -> None:
        self.lm.accept(step)
