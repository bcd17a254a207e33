"""The math of block drafters (DFlash, DSpark) as small pure functions: anchors, block rows, masks, weights.

A block drafter drafts K - 1 tokens in one pass: the block [anchor, MASK x (K-1)] sits at positions
p..p+K-1 (p = the anchor's position; the anchor is the last verified token), its queries attend to the
target's fused features at every context position before p and to the whole block (non-causally).
Training runs many anchors of a sequence in one pass: each anchor's block sees the context strictly
before its own position (in its own packed sequence) and its own block, never another anchor's block.
Block position i (1..K-1) predicts token p+i; its teacher is the target's P_{p+i-1} (batch contract,
train/features.py: P_t predicts token t+1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

KVPair = tuple[Tensor, Tensor]  # a draft layer's keys, values [B, kv, S, d]


def segment_positions(segments: Tensor) -> Tensor:
    """Position of each token within its own packed sequence. segments [B, T] (0 = padding) -> [B, T] long"""
    t = segments.shape[1]
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    idx = torch.arange(t, device=segments.device).expand_as(segments)
    return idx - torch.cummax(torch.where(starts, idx, 0), dim=1).values


def batch_layout(batch: dict) -> tuple[Tensor, Tensor]:
    """(segments [B, T] long, 0 = padding; positions [B, T] long within each sequence) of a training batch."""
    seg = batch["attention_mask"].long()
    pos = batch.get("position_ids")
    return seg, (segment_positions(seg) if pos is None else pos.long())


def anchor_candidates(seg: Tensor, pos: Tensor, loss_mask: Tensor) -> Tensor:
    """[B, T] bool: position p can anchor a block — a real token with context before it (pos >= 1, as when
    decoding: a prompt has at least one token) whose next token, in the same sequence, is trained."""
    nxt = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt[:, :-1] = loss_mask[:, 1:].bool() & (seg[:, 1:] == seg[:, :-1])
    return (seg > 0) & (pos >= 1) & nxt


def sample_anchors(candidates: Tensor, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to n anchors per row drawn uniformly without replacement from `candidates` [B, T], ascending.

    Drawn from `generator` (never the global RNG), so a resumed run draws what an uninterrupted one does.
    -> (anchors [B, A] long, present [B, A] bool: False where a row had fewer than A candidates)
    """
    b, t = candidates.shape
    scores = torch.rand(b, t, generator=generator, device=candidates.device)
    scores = scores.masked_fill(~candidates, -math.inf)
    picked = torch.topk(scores, min(n, t), dim=1).indices.sort(dim=1).values  # [B, A]
    return picked, candidates.gather(1, picked)


def block_rows(anchors: Tensor, present: Tensor, seg: Tensor, loss_mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each block position's sequence position and whether it carries a loss.

    -> (rows [B, A, K] long: anchor + i, clamped into the row; valid [B, A, K] bool: i >= 1, the anchor
    present, p + i inside the row and the anchor's sequence, and token p + i trained)
    """
    t = seg.shape[1]
    rows = anchors[..., None] + torch.arange(k, device=anchors.device)  # [B, A, K]
    inside = rows < t
    rows = rows.clamp(max=t - 1)
    b = torch.arange(seg.shape[0], device=seg.device)[:, None, None]
    same = seg[b, rows] == seg.gather(1, anchors)[..., None]
    valid = present[..., None] & inside & same & loss_mask.bool()[b, rows]
    valid[..., 0] = False  # the anchor itself is known
    return rows, valid


def anchor_mask(anchors: Tensor, seg: Tensor, k: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [B, 1, A*K, T + A*K] of a multi-anchor training pass over keys [context T; blocks A*K]:
    anchor a's K queries see context positions j < p_a of the anchor's own sequence and anchor a's block."""
    b, a = anchors.shape
    t = seg.shape[1]
    j = torch.arange(t, device=seg.device)
    seg_p = seg.gather(1, anchors)  # [B, A]
    ctx = (j < anchors[..., None]) & (seg[:, None, :] == seg_p[..., None])  # [B, A, T]
    ctx = ctx[:, :, None, :].expand(b, a, k, t).reshape(b, a * k, t)
    own = torch.eye(a, dtype=torch.bool, device=seg.device).repeat_interleave(k, 0).repeat_interleave(k, 1)
    allowed = torch.cat([ctx, own.expand(b, a * k, a * k)], dim=-1)  # every query sees its own block: no empty row
    mask = torch.zeros(b, 1, a * k, t + a * k, dtype=dtype, device=seg.device)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def block_positions(anchors: Tensor, pos: Tensor, k: int) -> Tensor:
    """RoPE positions of the blocks: the anchor's true position + i. anchors [B, A], pos [B, T] -> [B, A*K]"""
    start = pos.gather(1, anchors)  # [B, A]
    return (start[..., None] + torch.arange(k, device=pos.device)).flatten(1)


def position_weights(n: int, decay: bool, gamma: float) -> list[float]:
    """Loss weight of block positions i = 1..n: exp(-(i-1)/gamma) with `decay` (DFlash / D-PACE: an early
    position's miss ends the accepted run, so it matters most), else 1."""
    return [math.exp(-i / gamma) if decay else 1.0 for i in range(n)]
