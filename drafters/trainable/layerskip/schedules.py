"""LayerSkip's schedules: the per-exit loss scales, the rotational and gradual early-exit curricula, and the
layer-dropout rates (Elhoushi et al., LayerSkip, 2024). Pure functions of the step and the exits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# Scale of exit E (E = layers run before the exit, i.e. LayerSkip's layer index + 1), before normalising.
EXIT_SCALES: dict[str, Callable[[Tensor], Tensor]] = {
    "uniform": torch.ones_like,
    "linear": lambda e: e,
    "sum": lambda e: torch.cumsum(e, 0),
    "sqrt": torch.sqrt,
    "inv": torch.reciprocal,
    "inv_sqrt": torch.rsqrt,
}


def exit_loss_scales(exits: Sequence[int], kind: str = "sum", active: Sequence[bool] | None = None) -> list[float]:
    """LayerSkip's per-exit loss scales over the active exits, normalised to sum 1 (inactive exits: 0).

    All our exits are early exits of a frozen target, so LayerSkip's e_scale (which scales the early
    exits against the last layer) cancels in the normalisation and is not a parameter here.
    """
    if kind not in EXIT_SCALES:
        raise ValueError(f"exit loss scale {kind!r} not one of {sorted(EXIT_SCALES)}")
    active = [True] * len(exits) if active is None else list(active)
    e = torch.tensor([float(x) for x, a in zip(exits, active) if a])
    if e.numel() == 0:
        return [0.0] * len(exits)
    s = EXIT_SCALES[kind](e)
    s = (s / s.sum()).tolist()
    it = iter(s)
    return [next(it) if a else 0.0 for a in active]


def rotational_curriculum(step: int, n: int, every: int = 2) -> list[bool]:
    """LayerSkip's rotation: the initial pattern (every `every`-th exit on) rolled one exit per step.

    The deepest exit stays on (LayerSkip always trains its last layer), so no step is empty.
    """
    initial = [i % every == 0 for i in range(n)]
    on = [initial[(i - step) % n] for i in range(n)]
    on[-1] = True
    return on


def gradual_curriculum(step: int, n: int, max_steps: int, fraction: float = 0.5) -> list[bool]:
    """LayerSkip's gradual schedule: exit i (shallow first) joins once step/max_steps >= fraction*(n-i)/n.

    Deep exits join first; all are on from step = fraction * max_steps. The deepest is always on.
    """
    done = step / max(1, max_steps)
    on = [done >= fraction * (n - i) / n for i in range(n)]
    on[-1] = True
    return on


def exit_curriculum(
    kind: str, step: int, n: int, max_steps: int = 1000, every: int = 2, fraction: float = 0.5
) -> list[bool]:
    """Which of n exits (shallow first) train at `step`: `none` (all), `rotational` or `gradual`."""
    if kind == "none":
        return [True] * n
    if kind == "rotational":
        return rotational_curriculum(step, n, every)
    if kind == "gradual":
        return gradual_curriculum(step, n, max_steps, fraction)
    raise ValueError(f"exit curriculum {kind!r} not one of ['gradual', 'none', 'rotational']")


# --- evaluation --------------------------------------------------------------------------------


def layer_dropout_rates(n: int, p_max: float) -> list[float]:
    """LayerSkip's layer-dropout schedule over n layers: p_l = p_max * (exp(l ln2 / (n-1)) - 1), 0 at l = 0."""
    if n <= 1:
        return [0.0] * n
    return [p_max * (math.exp(i * math.log(2) / (n - 1)) - 1) for i in range(n)]
