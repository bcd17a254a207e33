"""Draft-length policies: how long a draft to ask for each round (they never change the output)."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from decode.tree import Shape


class Policy(Protocol):
    """Picks this round's shape from the base shape, then hears how the round went."""

    def shape(self, base: Shape) -> Shape: ...

    def observe(self, proposed_depth: int, accepted: int, draft_s: float, verify_s: float) -> None: ...


class FixedPolicy:
    """Always the base shape (chain of k = --draft-len)."""

    def shape(self, base: Shape) -> Shape:
        return base

    def observe(self, proposed_depth: int, accepted: int, draft_s: float, verify_s: float) -> None:
        pass


POLICIES = {"fixed": FixedPolicy}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"--policy {name!r}: available policies are {sorted(POLICIES)}")
    return POLICIES[name]()


def capped(shape: Shape, max_depth: int) -> Shape:
    """The shape with its depth limited (near max_new_tokens or the model's max positions)."""
    if shape.kind == "chain":
        return replace(shape, k=max(0, min(shape.k, max_depth)))
    if shape.kind == "dynamic":
        return replace(shape, depth=max(0, min(shape.depth, max_depth)))
    return shape  # static trees are truncated after growing
