"""The target's two passes beyond a plain forward: over a draft tree (verification) and over a packed batch
(feature extraction for training). Functions of a Target: the state they touch is the KVCache they are given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from decode.kvcache import KVCache
from decode.masks import SideRows, packed_rows, tree_rows
from decode.target import ForwardOut, Target
from decode.tree import DraftTree


@dataclass
class LayerReuse:
    """Layers [0, layers) already run for the first rows of a tree pass (their KV sits in the target cache)."""

    layers: int
    hidden: Tensor  # [n, D] pre-norm output of layer `layers` for rows 0..n-1 of [root] + nodes


def forward_tree(
    target: Target,
    root: int,
    tree: DraftTree,
    cache: KVCache,
    hidden_ids: tuple[int, ...] = (),
    reuse: LayerReuse | None = None,
    side: SideRows | None = None,
    logits: bool = True,
) -> ForwardOut:
    """One pass over [root] + tree nodes; returns logits [1 + N, V] (row 0 = root).

    logits=False skips the LM head (logits None; `last` holds the pre-norm rows for `head`), for a
    verifier that applies it only to the rows it visits (decode.verify.LazyRows).

    Positions are prefix length + depth, the mask lets a node see the prefix and its ancestors.
    With `reuse`, the first `reuse.layers` layers were already run (by an early-exit drafter,
    writing those layers' scratch KV) for the first rows: only the rest go through them.
    With `side`, E more rows ride along in the same pass (logits [1 + N + E, V]): no tree row
    sees them, so the tree's logits are unchanged, and their KV lands past the tree's, where
    compacting to the accepted path drops it.
    """
    prefix = cache.lens[-1]
    if side is not None and side.tokens.numel() and reuse is not None:
        raise ValueError("side rows and early-layer reuse cannot be combined in one tree pass")
    ids, positions, mask = tree_rows(root, tree, prefix, side, target.dtype, target.device)
    k = reuse.layers if reuse is not None else 0
    n = reuse.hidden.shape[0] if reuse is not None else 0
    if any(ln != prefix + (n if i < k else 0) for i, ln in enumerate(cache.lens)):
        raise RuntimeError(
            f"target cache lengths {cache.lens} do not match prefix {prefix} (+{n} reused "
            f"in layers < {k}): a drafter left scratch entries in the target cache"
        )
    target.check_hidden_ids(hidden_ids)
    if reuse is None:
        h, hid = target.run_layers(target.embed(ids), 0, target.num_layers, cache, positions, mask, tuple(hidden_ids))
        return ForwardOut(target.head(h)[0] if logits else None, hid, h[0])
    # LayerSkip-style reuse: rows [0, n) already have layer-K states and K-layer KV in the cache.
    if any(i <= k for i in hidden_ids if i > 0) or 0 in hidden_ids:
        raise ValueError("hidden ids at or below the reused layers are not available with reuse")
    rest = ids[n:]
    h_k = reuse.hidden.unsqueeze(0)
    if rest.numel():
        sub = mask[:, :, n:] if mask is not None else None
        h_rest, _ = target.run_layers(target.embed(rest), 0, k, cache, positions[n:], sub, ())
        h_k = torch.cat([h_k, h_rest], dim=1)
    h, hid = target.run_layers(h_k, k, target.num_layers, cache, positions, mask, tuple(hidden_ids))
    return ForwardOut(target.head(h)[0] if logits else None, hid, h[0])


def forward_batch(
    target: Target,
    ids: Tensor,
    attention_mask: Tensor,
    hidden_ids: tuple[int, ...] = (),
    position_ids: Tensor | None = None,
) -> tuple[Tensor, dict[int, Tensor]]:
    """No-cache pass over a padded or packed batch: ids [B, T], attention_mask [B, T].

    attention_mask: 0 = padding, k > 0 = the k-th sequence packed into the row (plain padding: 1);
    a token attends to earlier tokens with the same nonzero value (left or right padding both work).
    position_ids [B, T] default to the index within each sequence. Returns the pre-norm output of
    the last layer [B, T, D] and {id: [B, T, D]} at `hidden_ids`; padded positions hold garbage.
    """
    target.check_hidden_ids(hidden_ids)
    ids, seg = ids.to(target.device), attention_mask.to(target.device)
    pos, mask = packed_rows(seg, target.dtype, None if position_ids is None else position_ids.to(target.device))
    h = target.embed_tokens(ids)  # [B, T, D]
    rope = target.rotary_emb(h, pos)
    captured = {0: h} if 0 in hidden_ids else {}
    for i, layer in enumerate(target.layers):
        h = layer(h, attention_mask=mask, position_ids=pos, cache=None, use_cache=False, position_embeddings=rope)
        if i + 1 in hidden_ids:
            captured[i + 1] = target.norm(h) if i + 1 == target.num_layers else h
    return h, captured
