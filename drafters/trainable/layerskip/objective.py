"""LayerSkip's training objective: the early-exit loss over the exits the curriculum turns on, each scaled by
LayerSkip's exit-loss scale, and the draft exit's chain accuracy for evaluation. The scale functions and the
rotational/gradual curricula themselves are pure functions in drafters/trainable/losses.py."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from drafters.trainable.layerskip.config import LayerSkipConfig
from drafters.trainable.layerskip.schedules import exit_curriculum, exit_loss_scales
from drafters.trainable.lk import KL, Objective, lk_losses
from drafters.trainable.losses import (
    ahead,
    conditional_accuracy,
    distill_rows,
    gather_rows,
    hard_ce,
    in_topk,
    masked_mean,
    next_valid,
    teacher_argmax,
)

ExitLogits = Callable[[int, Tensor], Tensor]  # (exit E, layer-E states [B, T, H]) -> logits [B, T, V]
ExitStates = Callable[[dict, int], Tensor]  # (batch, exit E) -> layer-E states [B, T, H]


def exit_loss(
    cfg: LayerSkipConfig,
    batch: dict,
    step: int,
    lm_head: nn.Linear,
    num_layers: int,
    logits_at: ExitLogits,
    states_at: ExitStates,
    objective: Objective = KL,
) -> tuple[Tensor, dict[str, float]]:
    """Sum over the exits the curriculum turns on at `step` of scale_E * loss_E (KL to the target's
    distribution, or CE to the next token; `objective` lk: the LK loss against the target's distribution),
    with per-exit loss (and acceptance, lk) and top-1 agreement in the metrics."""
    valid = next_valid(batch)
    argmax = teacher_argmax(batch, lm_head, num_layers)
    on = exit_curriculum(
        cfg.curriculum, step, len(cfg.exits), cfg.curriculum_steps, cfg.rotation_every, cfg.gradual_fraction
    )
    scales = exit_loss_scales(cfg.exits, cfg.scale, on)
    # only rows with a loss go through the exit heads (prompt and padding rows have none: ~55% of a padded
    # chat batch), as one row [1, M]
    b, t = valid.nonzero(as_tuple=True)
    taught = gather_rows(batch, b, t, num_layers) if cfg.loss == "kl" or objective.lk else None
    name = "lk" if objective.lk else cfg.loss
    want = argmax[b, t][None]  # [1, M]
    every = torch.ones_like(want, dtype=torch.bool)
    total, metrics = 0.0, {}
    for e, scale, active in zip(cfg.exits, scales, on):
        if not active:
            continue
        logits = logits_at(e, states_at(batch, e)[b, t][None])  # [1, M, V]
        if objective.lk:  # the acceptance rate against P_t (drafters/trainable/lk.py)
            (loss_e,), (alpha,) = lk_losses([logits], [every], taught, lm_head, num_layers, objective)
            metrics[f"alpha_exit{e}"] = float(alpha)
        else:  # KL to the target's P_t, built a chunk of rows at a time (drafters/trainable/losses.py distill_rows)
            per_row = (
                distill_rows([logits], [0], taught, lm_head, num_layers, "kl")[0]
                if cfg.loss == "kl"
                else hard_ce(logits, batch["input_ids"][b, t + 1][None])
            )
            loss_e = masked_mean(per_row, every)
        total = total + scale * loss_e
        metrics[f"{name}_exit{e}"] = float(loss_e.detach())
        metrics[f"acc_exit{e}"] = float(masked_mean((logits.argmax(-1) == want).float(), every))
    return total, {"loss": float(total.detach()), **metrics}


def chain_accuracy(
    cfg: LayerSkipConfig,
    batch: dict,
    depth: int,
    topk: int,
    lm_head: nn.Linear,
    num_layers: int,
    logits_at: ExitLogits,
    states_at: ExitStates,
) -> list[float]:
    """Chain accuracy of the draft exit per position 1..depth, conditional on earlier positions being right.

    Position k of a chain rooted at row t is the exit's prediction at row t+k-1 given the tokens
    before it, as when decoding. Exact when the batch's tokens are the target's greedy output
    (self-distilled data): then accepted drafts are exactly the batch's tokens.
    """
    argmax = teacher_argmax(batch, lm_head, num_layers)
    E = cfg.draft_exit
    correct = in_topk(logits_at(E, states_at(batch, E)), argmax, topk)
    valid = next_valid(batch)
    return conditional_accuracy(
        [ahead(correct, k, False) for k in range(depth)], [ahead(valid, k, False) for k in range(depth)]
    )
