"""DFlash: a block drafter on a frozen target — K - 1 tokens from one drafter pass (z-lab's DFlash, block diffusion).

The target's states at the capture ids (default EAGLE-3's low/mid/high) are concatenated and fused:
ctx = hidden_norm(fc([h_a; h_b; h_c])) (n*D -> D). A round drafts the block [anchor, MASK x (K-1)] at positions
p..p+K-1 (the anchor = the last verified token, MASK = a learned vector or the embedding of `mask_token_id`)
through `num_layers` Llama-style draft layers whose attention reads, besides the block itself (non-causally),
the fused context at every position before p as extra keys/values: each layer projects ctx with its own k/v
projections (RoPE at the true positions), as DFlash's Qwen3DFlashAttention does. Then the drafter's own norm
and the target's frozen LM head (shared, like the embedding). Block position i predicts token p + i.

Keys: `fc.weight`, `hidden_norm.weight`, `layers.{l}.*` (draft_layer.py's Llama layer names; with `qk_norm` also
`self_attn.{q,k}_norm.weight`, the layer vLLM's qwen3_dflash.py builds), `norm.weight`, `mask_embedding` (learned
mask only), and with `draft_vocab_size` N the buffers `d2t`, `t2d` (EAGLE-3's maps): the head then scores only the
rows of the N most frequent training tokens, so each drafted position reads N/V of it. Training (`loss`,
drafters/trainable/block_loss.py) runs many anchors of a sequence in one pass; decoding (`drafter()`,
drafters/trainable/block_drafter.py) caches the context's K/V.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import rotate_half

from decode.runtime import Packed
from decode.target import Target
from drafters.trainable.block_drafter import BlockDrafter
from drafters.trainable.block_loss import block_accuracy, block_loss
from drafters.trainable.block_ops import KVPair
from drafters.trainable.draft_layer import DraftAttention, DraftLayer, LayerSizes, RMSNorm
from drafters.trainable.eagle3 import build_draft_vocab, default_capture_ids
from drafters.trainable.lk import KL
from drafters.trainable.losses import head_rows
from drafters.trainable.noise import noise_seed
from drafters.trainable.target_layer import QKNormDraftLayer


@dataclass
class DFlashConfig:
    """DFlash: fused capture states, draft layers over a masked block, one pass per round."""

    capture_ids: tuple[int, ...] = ()  # target hidden ids fused by fc; () = EAGLE-3's default (2, L//2, L-3)
    num_layers: int = 1  # draft layers (DFlash uses 5 on Qwen3-14B-sized targets)
    block_size: int = 8  # K: the anchor + K-1 masked positions, drafted together (a chain of at most K-1)
    mask_token_id: int = -1  # -1 = a learned mask embedding; else this target token's (frozen) embedding
    intermediate_size: int = 0  # FFN width of the draft layers; 0 = the target's
    anchors: int = 32  # anchors (blocks) sampled per training sequence, all trained in one pass
    loss: Literal["kl", "ce"] = "kl"  # kl: to the target's next-token distributions | ce: the data's tokens
    ce_weight: float = 1.0  # weight of the kl/ce term of each block position
    l1_weight: float = 0.0  # weight of the L1 distance of the probabilities, halved: 1 - α (acceptance rate)
    position_decay: bool = False  # weight block position i by exp(-(i-1)/gamma) (DFlash, D-PACE)
    gamma: float = 4.0  # the decay's scale (DFlash: 4 for blocks of 8, 7 for 16)
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on q and k, context keys too (vLLM's DFlash layers always have it)
    # 0 = the target's whole vocabulary; N: the frozen head reads only the rows of the N most frequent training
    # tokens (no new weights: a cheaper head per drafted position, as EAGLE-3's draft vocabulary)
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size}: a block needs the anchor and at least 1 masked position")
        if self.num_layers < 1 or self.anchors < 1:
            raise ValueError(f"num_layers and anchors must be >= 1, got {self.num_layers}, {self.anchors}")
        if not (self.gamma > 0 and self.ce_weight >= 0 and self.l1_weight >= 0):
            raise ValueError("gamma must be > 0, ce_weight and l1_weight >= 0")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size}: 0 = the target's vocabulary, else N >= 1")

    def resolved(self, num_layers: int, vocab_size: int) -> DFlashConfig:
        """Defaults filled in for a target, checked (capture ids and the mask token in range)."""
        ids = tuple(int(i) for i in self.capture_ids) or default_capture_ids(num_layers)
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(
                f"{type(self).__name__} capture ids {bad} out of range 0..{num_layers - 1} for a {num_layers}-layer "
                "target (hidden ids: 0 = embeddings, i = output of layer i)"
            )
        if not -1 <= self.mask_token_id < vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target's vocabulary 0..{vocab_size - 1}; "
                "use -1 for a learned mask embedding"
            )
        n = self.draft_vocab_size
        return replace(self, capture_ids=ids, draft_vocab_size=0 if n >= vocab_size else n)

    def feature_ids(self, num_layers: int) -> tuple[int, ...]:
        """Hidden ids a training batch needs: the capture ids, and L for the target's distribution."""
        ids = tuple(self.capture_ids) or default_capture_ids(num_layers)
        return tuple(sorted(set(ids) | {num_layers}))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of keys x [B, kv, S, d] with cos, sin [B, S, d] (the target's rotary_emb)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def context_kv(attn: DraftAttention, ctx: Tensor, cos: Tensor, sin: Tensor) -> KVPair:
    """A draft layer's keys/values of the fused context ctx [B, S, D] (already normed by hidden_norm, so no
    input norm, as DFlash feeds it) at the positions of cos, sin. -> (k, v) [B, kv, S, d]"""
    b, s, _ = ctx.shape
    d = attn.sizes.head_dim
    k = attn.k_proj(ctx).view(b, s, -1, d).transpose(1, 2)
    v = attn.v_proj(ctx).view(b, s, -1, d).transpose(1, 2)
    norm = getattr(attn, "k_norm", None)  # a QK-norm layer norms the context's keys as it norms the block's
    if norm is not None:
        k = norm(k)
    return rope(k, cos, sin), v


class BlockContext:
    """A layer's attention context: the block's queries see the context keys (as `mask` allows) and the block's."""

    def __init__(self, kv: KVPair, mask: Tensor | None) -> None:
        self.kv, self.mask = kv, mask

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_all = torch.cat([self.kv[0].to(k.dtype), k], dim=2)  # [B, kv, S + Q, d]
        v_all = torch.cat([self.kv[1].to(v.dtype), v], dim=2)
        mask = None if self.mask is None else self.mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)


class AnchorDraws:
    """Generators of the training anchors, never the global RNG: seeded from (seed, rank, step, call within the step)
    so a resumed run draws what an uninterrupted one does and a step's micro-batches differ; in eval mode one fixed
    seed (every evaluation scores the same held-out anchors)."""

    def __init__(self, seed: int, rank: int) -> None:
        self.key = (seed, rank)
        self.calls = (-1, 0)  # (step, training calls seen at that step)

    def __call__(self, step: int, training: bool, device: torch.device) -> torch.Generator:
        g = torch.Generator(device=device)
        if not training:
            return g.manual_seed(noise_seed(*self.key, -1, 0))
        last, calls = self.calls
        self.calls = (step, calls + 1 if step == last else 0)
        return g.manual_seed(noise_seed(*self.key, step, self.calls[1]))


class DFlash(nn.Module):
    """The block drafter's weights and forward; `module(batch, step)` is the training loss."""

    kind = "dflash"
    objective = KL  # the distillation term's objective (train.loss; lk.use_objective sets it)
    conditions_on_prev = False  # DSpark's head states read the previous token; DFlash's positions never do

    def __init__(
        self,
        target: Target,
        config: DFlashConfig | None = None,
        seed: int = 0,
        rank: int = 0,
        token_counts: Tensor | None = None,
    ) -> None:
        """seed, rank: of the training anchors' draws; token_counts [V]: training-token frequencies that pick the
        draft vocabulary (draft_vocab_size > 0; None: the first N ids, replaced by a checkpoint's own d2t/t2d)."""
        super().__init__()
        self.target = target  # a plain attribute: the frozen target is not part of this module
        for piece in (target.embed_tokens, target.lm_head, target.norm):
            piece.requires_grad_(False)
        self.config = cfg = (config or self.default_config()).resolved(target.num_layers, target.vocab_size)
        sizes = LayerSizes.of(target.config, cfg.intermediate_size)
        H = sizes.hidden
        with torch.device(target.device):
            self.fc = nn.Linear(len(cfg.capture_ids) * H, H, bias=False)
            self.hidden_norm = RMSNorm(H, sizes.eps)
            layer = QKNormDraftLayer if cfg.qk_norm else DraftLayer
            self.layers = nn.ModuleList(layer(sizes, fused=False) for _ in range(cfg.num_layers))
            self.norm = RMSNorm(H, sizes.eps)
            if cfg.mask_token_id < 0:  # a learned vector at the embeddings' scale
                w = target.embed_tokens.weight  # on a meta skeleton (export's shape check) there are no values
                std = 1.0 if w.is_meta else float(w.float().std())
                self.mask_embedding = nn.Parameter(torch.randn(H) * std)
        with torch.no_grad():
            self.norm.weight.copy_(target.norm.weight)
        self.draws = AnchorDraws(seed, rank)
        if cfg.draft_vocab_size:  # buffers, so a checkpoint carries the vocabulary its drafts were trained on
            counts = torch.arange(target.vocab_size, 0, -1) if token_counts is None else token_counts
            d2t, t2d = build_draft_vocab(counts, cfg.draft_vocab_size)
            self.register_buffer("d2t", d2t.to(target.device))
            self.register_buffer("t2d", t2d.to(target.device))

    @staticmethod
    def default_config() -> DFlashConfig:
        return DFlashConfig()

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def decode_hidden_ids(self) -> tuple[int, ...]:
        return tuple(self.config.capture_ids)

    def feature_ids(self, num_layers: int | None = None) -> tuple[int, ...]:
        return self.config.feature_ids(num_layers or self.target.num_layers)

    def forward(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        """= loss(batch, step); call the module itself so DDP/accelerate wrappers see the forward."""
        return self.loss(batch, step)

    def loss(self, batch: dict, step: int = 0) -> tuple[Tensor, dict[str, float]]:
        return block_loss(self, batch, step)

    def position_accuracy(self, batch: dict, depth: int | None = None, topk: int = 1) -> list[float]:
        return block_accuracy(self, batch, depth, topk)

    def anchor_generator(self, step: int) -> torch.Generator:
        """The generator of this call's anchors (AnchorDraws: per training step and call; fixed in eval mode)."""
        return self.draws(step, self.training, self.fc.weight.device)

    def embed(self, ids: Tensor) -> Tensor:
        """The target's frozen embedding, in the drafter's dtype. [..] -> [.., D]"""
        with torch.no_grad():
            return self.target.embed_tokens(ids.to(self.target.device)).to(self.dtype)

    def fuse(self, hidden: dict[int, Tensor]) -> Tensor:
        """The fused context: hidden_norm(fc(concat of the capture states)). {id: [.., D]} -> [.., D]"""
        return self.hidden_norm(self.fc(torch.cat([hidden[i].to(self.dtype) for i in self.config.capture_ids], -1)))

    def block_inputs(self, anchor_ids: Tensor) -> Tensor:
        """[anchor, MASK x (K-1)] embedded. anchor_ids [B, A] -> [B, A, K, D]"""
        first = self.embed(anchor_ids)[:, :, None]  # [B, A, 1, D]
        if self.config.mask_token_id >= 0:
            mask = self.embed(torch.tensor(self.config.mask_token_id, device=anchor_ids.device))
        else:
            mask = self.mask_embedding.to(first.dtype)
        return torch.cat([first, mask.expand(*first.shape[:2], self.block_size - 1, -1)], dim=2)

    def context_kvs(self, ctx: Tensor, positions: Tensor) -> list[KVPair]:
        """Every draft layer's keys/values of the fused context ctx [B, S, D] at positions [B, S]."""
        cos, sin = self.target.rotary_emb(ctx, positions)
        return [context_kv(layer.self_attn, ctx, cos, sin) for layer in self.layers]

    def run_block(self, x: Tensor, positions: Tensor, kvs: list[KVPair], mask: Tensor | None) -> Tensor:
        """The draft layers over block rows x [B, Q, D] at positions [B, Q], each layer's attention over its
        context (k, v) [B, kv, S, d] and the rows (mask [B, 1, Q, S + Q] or None = all). -> [B, Q, D] pre-norm"""
        cos, sin = self.target.rotary_emb(x, positions)
        for layer, kv in zip(self.layers, kvs):
            x = layer(x, cos, sin, BlockContext(kv, mask))
        return x

    def head_states(self, h: Tensor, prev: Tensor) -> Tensor:
        """The states the LM head reads: norm(h) (DSpark adds its Markov term of `prev`). h [.., D], prev [..]"""
        return self.norm(h)

    @property
    def draft_ids(self) -> Tensor | None:
        """Target id of each logit column [N] with a draft vocabulary; None: the columns are the target's ids."""
        if not self.config.draft_vocab_size:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def columns(self, ids: Tensor) -> Tensor:
        """The logit column of each target id (-1: outside the draft vocabulary). [..] -> [..]"""
        if not self.config.draft_vocab_size:
            return ids
        col = torch.cumsum(self.t2d.long(), 0) - 1
        return torch.where(self.t2d[ids], col[ids], -1)

    def head_rows(self) -> tuple[Tensor, Tensor | None]:
        """The rows of the target's frozen LM head the drafter scores: weight [N, D], bias [N] or None (all V
        without a draft vocabulary)."""
        ids = self.draft_ids
        return head_rows(self.target.lm_head, None if ids is None else ids.to(self.target.lm_head.weight.device))

    def decode_head(self) -> Callable[[Tensor], Tensor]:
        """logits() for decoding: the target's packed head, or the draft-vocabulary rows packed once."""
        if not self.config.draft_vocab_size:
            return self.logits
        w, b = self.head_rows()
        rows = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
        rows.weight = nn.Parameter(w.detach(), requires_grad=False)
        if b is not None:
            rows.bias = nn.Parameter(b.detach(), requires_grad=False)
        packed = Packed.of([rows], keep_rows=True)
        return lambda z: packed(z.to(w.dtype))

    def logits(self, z: Tensor) -> Tensor:
        """The target's frozen LM head (through its packed runtime when decoding: decode.runtime), over the draft
        vocabulary's rows when there is one. [.., D] -> [.., V] or [.., N]"""
        if self.config.draft_vocab_size:
            w, b = self.head_rows()
            return F.linear(z.to(w.dtype), w, b)
        fast = self.target.fast()
        if fast is not None:
            return fast.head(z.to(self.target.dtype))
        return self.target.lm_head(z.to(self.target.lm_head.weight.dtype))

    def confidence(self, z: Tensor) -> Tensor | None:
        """P(accepted) of each position from head states z [.., D] (DSpark); None: DFlash has no such head."""
        return None

    def drafter(self, name: str | None = None) -> BlockDrafter:
        """The decode-time drafter (drafter protocol) running this module."""
        return BlockDrafter(self.eval(), name or self.kind)
