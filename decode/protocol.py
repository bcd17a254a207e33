"""The drafter protocol: what the generate loop tells a drafter and what it asks of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from torch import Tensor

from decode.kvcache import KVCache
from decode.masks import SideRows
from decode.passes import LayerReuse
from decode.sampling import Rng, SamplingConfig
from decode.tree import DraftTree, Shape


@dataclass
class TargetStep:
    """What the target produced since the drafter last heard from it.

    tokens[-1] is the pending token: emitted, but not yet in the target's KV cache.
    hidden[i][j] is the target's state (hidden id i) at the position that produced tokens[j].
    At `begin`, tokens = prompt[1:] + [first token] and hidden covers every prompt position.
    """

    tokens: Tensor  # [n]
    hidden: dict[int, Tensor]  # id -> [n, D]
    path: list[int]  # accepted node indices of the last draft (empty at begin)
    committed: int  # tokens in the target's KV cache
    cache: KVCache | None = None  # the target's cache: read-only below `committed`, scratch above
    side_logits: Tensor | None = None  # [E, V] the target's logits at the drafter's side rows, if any


@dataclass
class Budget:
    """What to propose this round: the shape (its length already set by the policy) and sampling settings."""

    shape: Shape
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rng: Rng | None = None


@runtime_checkable
class Drafter(Protocol):
    """A draft source. `hidden_ids` are the target hidden-state ids it needs in every TargetStep.

    Optional extras, read with getattr: `reuse()` (see layer_reuse), `side_rows()` (see side_rows),
    and `token_probs = False` to declare that its trees never carry per-token probabilities
    (DraftTree.conf), so length policies that need them refuse it before generating.
    """

    name: str
    hidden_ids: tuple[int, ...]
    forward_passes: int  # drafter forward calls so far (metrics)

    def begin(self, prompt_ids: Tensor, step: TargetStep) -> None: ...

    def propose(self, budget: Budget) -> DraftTree: ...

    def accept(self, step: TargetStep) -> None: ...


def layer_reuse(drafter: Drafter) -> LayerReuse | None:
    """The early layers a drafter already ran for this round's tree (LayerSkip-style), if any."""
    fn = getattr(drafter, "reuse", None)
    return fn() if fn is not None else None


def side_rows(drafter: Drafter) -> SideRows | None:
    """Extra rows the drafter wants run in this round's target pass (lookahead's window), if any.

    Their logits come back in the next TargetStep's side_logits; they are never committed.
    """
    fn = getattr(drafter, "side_rows", None)
    return fn() if fn is not None else None
