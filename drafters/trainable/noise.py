"""EAGLE's hidden-state noise lever: the kinds, their settings check, the draw and its per-step seed.

The field perturbs the features a drafter trains on (EAGLE-1: uniform noise on the input feature; speculators'
EAGLE-3: Gaussian 0.05 on the captured states), since at decode time the drafter reads its own, slightly
wrong, predictions. `drafter.eagle3.noise` / `drafter.eagle1.noise` choose the kind (default none; the chat
recipe sets gaussian), `noise_std` its size.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

NOISE_KINDS = ("none", "gaussian", "uniform", "relative")


def check_noise(noise: str, noise_std: float) -> None:
    """The hidden-state noise settings both EAGLE configs share, checked (errors name the key)."""
    if noise not in NOISE_KINDS:
        raise ValueError(f"noise {noise!r} not one of {list(NOISE_KINDS)}")
    if not noise_std >= 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")


def add_noise(x: Tensor, kind: str, std: float, generator: torch.Generator) -> Tensor:
    """x + N(0, std^2) (gaussian) or + U(-std, std) (uniform), as speculators' AddGaussianNoise / AddUniformNoise;
    relative: x * (1 + N(0, std^2)), each element moved by `std` of its own size.

    Why relative: an absolute std means nothing across targets and layers (SmolLM2's captured states have an
    RMS of 3 to 64 per element, so speculators' 0.05 moves them by 0.1-2%), and a per-row RMS scale would be
    set by the few massive activations; a multiplicative draw perturbs every element by the same fraction.
    Drawn in float32 from `generator` (never the global RNG), then cast: the draws do not depend on x's dtype.
    [..] -> [..]
    """
    if kind == "uniform":
        n = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) * 2 - 1
    else:
        n = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    if kind == "relative":
        return (x.float() * (1 + n * std)).to(x.dtype)
    return x + (n * std).to(x.dtype)


def noise_seed(*parts: int) -> int:
    """A 64-bit generator seed from integers (run seed, rank, step, call): stable across processes and resumes."""
    digest = hashlib.blake2b(":".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2^63: torch.Generator.manual_seed takes it on any device
