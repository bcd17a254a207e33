"""Sampling settings and the logits -> probabilities transform shared by AR and speculative decoding.

Temperature, top-k and top-p are applied to the target's logits *before* verification, exactly as
in the AR reference, so speculative sampling reproduces the AR sampling distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # named as the CLI options are: that is where a bad value comes from
        if not self.temperature >= 0:
            raise ValueError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p}: must be in (0, 1] (1 = no nucleus filter)")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k}: must be >= 0 (0 = no top-k filter)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """[.., V] logits -> [.., V] float64 probabilities after temperature, top-k, top-p (greedy: one-hot)."""
    logits = logits.double()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


class Rng(Protocol):
    """The randomness verification uses: a biased coin and a categorical draw (tests enumerate both)."""

    def accept(self, prob: float) -> bool: ...

    def categorical(self, probs: Tensor) -> int: ...


class TorchRng:
    """Default randomness from a seeded torch.Generator."""

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def accept(self, prob: float) -> bool:
        return bool(torch.rand((), generator=self.gen, dtype=torch.float64) < prob)

    def categorical(self, probs: Tensor) -> int:
        return int(torch.multinomial(probs.double().cpu(), 1, generator=self.gen))


def draw_without_replacement(probs: Tensor, n: int, rng: Rng) -> list[int]:
    """n distinct tokens drawn one by one from probs, each time renormalised without the earlier ones."""
    p = probs.double().clone()
    out = []
    for _ in range(n):
        if p.sum() <= 0:
            break
        tok = rng.categorical(p / p.sum())
        out.append(tok)
        p[tok] = 0
    return out
