"""Training and held-out accuracy of the block drafters (DFlash, DSpark): many anchors per sequence, one pass.

`block_states` samples anchors in every sequence and runs all their blocks at once: keys = [the whole
sequence's fused context; every block], an anchor_mask making the blocks independent (drafters/trainable/
block_ops.py). Only rows with a loss go through the LM head. Block position i at anchor p:
- kl (default): KL(P_{p+i-1} || q) to the target's distribution (the same self-distillation the other
  drafters train on; `ce`: the data's token p+i instead), times `ce_weight`;
- plus `l1_weight` x (1 - α), α = Σ min(p, q): the L1 distance of the two distributions halved (DSpark);
- or with train.loss=lk the LK loss (drafters/trainable/lk.py) in place of both;
positions weighted by position_weights (decay exp(-(i-1)/gamma) when `position_decay`) and averaged, plus
the module's extra term (DSpark: its confidence head's BCE). With a draft vocabulary the logits cover its N
columns, the teacher is renormalised over them, and rows whose target (argmax, or the token for `ce`) lies
outside it are skipped, as EAGLE-3 does: the drafter can never propose that token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from drafters.trainable.block_ops import (
    anchor_candidates,
    anchor_mask,
    batch_layout,
    block_positions,
    block_rows,
    position_weights,
    sample_anchors,
)
from drafters.trainable.lk import lk_loss, overlap_rows
from drafters.trainable.losses import (
    conditional_accuracy,
    distill_rows,
    gather_rows,
    hard_ce,
    in_topk,
    loss_metrics,
    masked_mean,
    teacher_argmax,
)


def block_states(module, batch: dict, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Sample anchors in every sequence and run their blocks in one pass.

    -> (h [B, A, K, D] pre-norm block states, rows [B, A, K] each position's sequence position, valid [B, A, K])
    """
    seg, pos = batch_layout(batch)
    anchors, present = sample_anchors(anchor_candidates(seg, pos, batch["loss_mask"]), module.config.anchors, generator)
    rows, valid = block_rows(anchors, present, seg, batch["loss_mask"], module.block_size)
    return anchor_states(module, batch, anchors), rows, valid


def anchor_states(module, batch: dict, anchors: Tensor) -> Tensor:
    """The blocks of anchors [B, A] (positions in the batch's rows), all in one pass: keys = [the fused context of
    every position; every block], anchor_mask keeping each block to its own context and itself. -> [B, A, K, D]"""
    seg, pos = batch_layout(batch)
    k = module.block_size
    ctx = module.fuse(batch["hidden"])  # [B, T, D]
    x = module.block_inputs(batch["input_ids"].gather(1, anchors))  # [B, A, K, D]
    mask = anchor_mask(anchors, seg, k, module.dtype)
    h = module.run_block(x.flatten(1, 2), block_positions(anchors, pos, k), module.context_kvs(ctx, pos), mask)
    return h.view(*anchors.shape, k, -1)


def position_terms(module, logits: Tensor, taught: dict, labels: Tensor, masks: list[Tensor]) -> tuple[list, dict]:
    """Each block position's loss from logits [1, M, V] of M loss rows against their teacher rows `taught`
    (labels [1, M]: the data's tokens); masks[i] [1, M] = the rows of position i + 1. -> (losses, metrics)"""
    cfg, obj, L = module.config, module.objective, module.target.num_layers
    lm_head, vocab = module.target.lm_head, module.draft_ids
    if obj.lk:  # the LK loss replaces both terms
        (alpha,), kls = overlap_rows([logits], taught, lm_head, L, vocab, with_kl=obj.variant == "lambda")
        kl = kls[0] if kls else None
        losses = [lk_loss(alpha, kl, m, obj) for m in masks]
        alphas = [masked_mean(alpha, m).detach() for m in masks]
        return losses, {**loss_metrics("lk", losses), **loss_metrics("alpha", alphas)}
    alpha = None  # the acceptance rows, when l1_weight puts 1 - α in the loss
    if cfg.loss == "ce":
        term = hard_ce(logits, module.columns(labels))
        if cfg.l1_weight > 0:
            (alpha,), _ = overlap_rows([logits], taught, lm_head, L, vocab)
    elif cfg.l1_weight > 0:  # KL and α from one pass of the teacher (DSpark): it is most of a step's head work
        (alpha,), (term,) = overlap_rows([logits], taught, lm_head, L, vocab, with_kl=True)
    else:
        (term,) = distill_rows([logits], [0], taught, lm_head, L, "kl", vocab)
    terms = [masked_mean(term, m) for m in masks]
    metrics = loss_metrics(cfg.loss, terms)
    losses = [cfg.ce_weight * t for t in terms]
    if alpha is not None:
        alphas = [masked_mean(alpha, m) for m in masks]
        losses = [lo + cfg.l1_weight * (1 - a) for lo, a in zip(losses, alphas)]
        metrics.update(loss_metrics("alpha", alphas))
    return losses, metrics


def block_loss(module, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
    """The weighted mean over block positions of position_terms, plus module.extra_loss (DSpark's confidence)."""
    L, k = module.target.num_layers, module.block_size
    argmax = teacher_argmax(batch, module.target.lm_head, L)  # [B, T]
    h, rows, valid = block_states(module, batch, module.anchor_generator(step))
    ids = batch["input_ids"]
    if module.draft_ids is not None:  # a draft vocabulary: skip the rows whose target it cannot propose
        bidx = torch.arange(rows.shape[0], device=rows.device)[:, None, None]
        want = ids[bidx, rows] if module.config.loss == "ce" else argmax[bidx, (rows - 1).clamp(min=0)]
        valid = valid & module.t2d[want]
    b, a, i = valid.nonzero(as_tuple=True)  # [M] each: the loss rows, i in 1..K-1
    src = rows[b, a, i] - 1  # the teacher's row: P_{p+i-1} predicts token p+i
    z = module.head_states(h[b, a, i], ids[b, src])  # [M, D]; DSpark: the previous token's Markov term
    logits = module.logits(z)[None]  # [1, M, V] (or [1, M, N] over a draft vocabulary)
    masks = [(i == j)[None] for j in range(1, k)]  # [1, M] per block position
    losses, metrics = position_terms(module, logits, gather_rows(batch, b, src, L), ids[b, rows[b, a, i]][None], masks)
    hit = module.columns(argmax[b, src]) == logits[0].argmax(-1)  # [M]
    weights = position_weights(k - 1, module.config.position_decay, module.config.gamma)
    total = sum(w * lo for w, lo in zip(weights, losses)) / sum(weights)
    extra = extra_loss(module, z, hit, masks)
    if extra is not None:
        total = total + module.config.conf_weight * extra
        metrics["conf_bce"] = float(extra.detach())
    accs = [masked_mean(hit[None].float(), m) for m in masks]
    return total, {"loss": float(total.detach()), **metrics, **loss_metrics("acc", accs)}


def extra_loss(module, z: Tensor, hit: Tensor, masks: list[Tensor]) -> Tensor | None:
    """The confidence head's BCE against `hit` [M] (the drafter's argmax is the target's, earlier positions
    teacher-forced = accepted), averaged over positions; None without a confidence head. Its input is detached:
    the head reads the drafter's states, it must not bend them toward being easy to score."""
    conf = module.confidence(z.detach())  # [M] probabilities, or None
    if conf is None:
        return None
    bce = torch.nn.functional.binary_cross_entropy(conf.float().clamp(1e-6, 1 - 1e-6), hit.float(), reduction="none")
    return sum(masked_mean(bce[None], m) for m in masks) / len(masks)


@torch.no_grad()
def block_accuracy(module, batch: dict, depth: int | None = None, topk: int = 1) -> list[float]:
    """Top-k agreement with the target's argmax per block position 1..depth, conditional on the earlier ones
    (losses.conditional_accuracy), at the held-out anchors; earlier positions teacher-forced."""
    k = module.block_size
    depth = min(depth or k - 1, k - 1)
    argmax = teacher_argmax(batch, module.target.lm_head, module.target.num_layers)
    h, rows, valid = block_states(module, batch, module.anchor_generator(0))
    bidx = torch.arange(rows.shape[0], device=rows.device)[:, None]
    correct, valids = [], []
    for i in range(1, depth + 1):
        src = (rows[..., i] - 1).clamp(min=0)  # [B, A]
        z = module.head_states(h[:, :, i], batch["input_ids"][bidx, src])
        correct.append(in_topk(module.logits(z), module.columns(argmax[bidx, src]), topk))
        valids.append(valid[..., i])
    return conditional_accuracy(correct, valids)
