"""Additive float attention masks and positions for the passes the target runs: causal, tree (+ side rows),
packed batches. Pure functions: boolean 4D masks are silently wrong with eager attention, so every mask here is
0 where a row may attend and the dtype's minimum where it may not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from decode.tree import DraftTree, ancestor_matrix, tree_attention_mask, tree_depths


def causal_mask(past: int, t: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """Additive float causal mask [1, 1, t, past + t] for t new tokens after `past` cached ones."""
    m = torch.full((t, past + t), torch.finfo(dtype).min, dtype=dtype, device=device)
    m[:, :past] = 0
    m[:, past:] = torch.triu(m[:, past:], diagonal=1)
    return m.view(1, 1, t, past + t)


@dataclass
class SideRows:
    """Rows verified alongside a tree but never committed (lookahead decoding's Jacobi window).

    Each sees the whole cached prefix, the root if see[i, 0], side row j if see[i, 1 + j], and no
    tree node; it sits at position (root's position + offsets[i]).
    """

    tokens: Tensor  # [E] long
    offsets: Tensor  # [E] long
    see: Tensor  # [E, 1 + E] bool


def side_mask(parents: Tensor, side: SideRows, prefix: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """Additive float mask [1, 1, R, prefix + R] for R = 1 + N + E rows: [root] + tree, then side rows."""
    n, e = parents.numel(), side.tokens.numel()
    allowed = torch.zeros(n + e, n + e, dtype=torch.bool)
    allowed[:n, :n] = ancestor_matrix(parents)  # the tree (root included) never sees side rows
    see = side.see.cpu().bool()
    allowed[n:, 0] = see[:, 0]
    allowed[n:, n:] = see[:, 1:]
    m = torch.zeros(n + e, prefix + n + e, dtype=dtype)
    m[:, prefix:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return m.to(device).view(1, 1, n + e, prefix + n + e)


def tree_rows(
    root: int, tree: DraftTree, prefix: int, side: SideRows | None, dtype: torch.dtype, device: torch.device | str
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The rows of a tree pass: ids [R], positions [R] (prefix + depth) and mask [1, 1, R, prefix + R] or None.

    R = 1 + N (+ E side rows): the root (the pending token), the tree's nodes, then side rows. A node sees the
    prefix and its ancestors; side rows see what `side.see` says and no tree node.
    """
    parents = torch.cat([torch.tensor([-1]), tree.parents.cpu() + 1]) if tree.size else torch.tensor([-1])
    ids = torch.cat([torch.tensor([root]), tree.tokens.cpu()])
    positions = prefix + tree_depths(parents).to(device)
    mask = tree_attention_mask(parents, prefix, dtype, device) if tree.size else None
    if side is not None and side.tokens.numel():
        ids = torch.cat([ids, side.tokens.cpu()])
        positions = torch.cat([positions, prefix + side.offsets.to(device)])
        mask = side_mask(parents, side, prefix, dtype, device)
    return ids, positions, mask


def packed_rows(seg: Tensor, dtype: torch.dtype, position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Positions [B, T] and mask [B, 1, T, T] of a padded or packed batch; seg [B, T]: 0 = padding, k > 0 = the
    k-th sequence packed into the row. A token attends to earlier tokens of its own sequence; positions restart
    where the segment value changes unless `position_ids` are given."""
    b, t = seg.shape
    ar = torch.arange(t, device=seg.device).expand(b, t)
    if position_ids is None:  # restart counting where the segment value changes
        new = torch.ones_like(seg, dtype=torch.bool)
        new[:, 1:] = seg[:, 1:] != seg[:, :-1]
        position_ids = ar - torch.cummax(torch.where(new, ar, 0), dim=1).values
    allowed = (ar[:, None, :] <= ar[:, :, None]) & (seg[:, None, :] == seg[:, :, None]) & (seg[:, None, :] > 0)
    allowed |= torch.eye(t, dtype=torch.bool, device=seg.device)  # no fully masked row (padding)
    mask = torch.zeros(b, 1, t, t, dtype=dtype, device=seg.device)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)  # additive float [B, 1, T, T]
    return position_ids.to(seg.device), mask
