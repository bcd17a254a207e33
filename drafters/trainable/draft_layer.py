"""The one decoder layer an EAGLE drafter trains, with an attention that serves training and decoding alike.

Llama-style (RMSNorm, GQA attention on the target's rotary embedding, SwiGLU MLP), sized from the
target's config. EAGLE-3's variant feeds q/k/v with [RMSNorm(e); RMSNorm(h)] (2H) and keeps the key
names of SGLang's `LlamaForCausalLMEagle3` midlayer (input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj), so exporting is a key rename (DESIGN §5).

Who a row attends to is an attention *context*:
- `CacheContext` (decoding): a one-layer KVCache plus an additive mask, like the target's tree pass;
- `UnrollContext` (training-time test): at unrolled step k, a row attends to the step-0 keys causally
  plus its own keys of steps 1..k, exactly the keys its draft chain would have in the decoding cache.
  The diagonal keys are scored separately, so no (k*T)^2 mask is ever built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from decode.kvcache import KVCache


@dataclass(frozen=True)
class LayerSizes:
    """Attention/MLP sizes of a drafter layer, read from the target's config."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float

    @staticmethod
    def of(config, intermediate: int = 0) -> LayerSizes:
        """The target's sizes; `intermediate` 0 = the target's FFN width."""
        heads = config.num_attention_heads
        return LayerSizes(
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=intermediate or config.intermediate_size,
            eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        )


class RMSNorm(nn.Module):
    """HF's Llama RMSNorm (fp32 statistics, weight applied in the input dtype); key `weight`."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, diag: list[tuple[Tensor, Tensor]] = ()) -> Tensor:
    """Softmax attention of q [B, h, T, d] over k, v [B, kv, S, d] (+ additive mask [B|1, 1, T, S]).

    diag: extra (k_j, v_j) pairs [B, kv, T, d] that row t sees only at its own row t (training-time test).
    Returns [B, h, T, d].
    """
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, h, T, S]
    if mask is not None:
        scores = scores + mask
    extra = [(kj.repeat_interleave(rep, 1), vj.repeat_interleave(rep, 1)) for kj, vj in diag]
    if extra:
        own = torch.stack([(q * kj).sum(-1) * scale for kj, _ in extra], dim=-1)  # [B, h, T, n]
        scores = torch.cat([scores, own], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    s = k.shape[2]
    out = probs[..., :s] @ v
    for j, (_, vj) in enumerate(extra):
        out = out + probs[..., s + j, None] * vj
    return out


class CacheContext:
    """Decoding: new keys/values go into a one-layer KVCache; rows see what `mask` allows (None = all)."""

    def __init__(self, cache: KVCache, mask: Tensor | None) -> None:
        self.cache, self.mask = cache, mask

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_all, v_all = self.cache.update(k, v, 0)
        # SDPA, not `attention`: the key length grows every round, and a matmul of a shape not seen before pays
        # oneDNN's primitive creation on CPU (~0.3 ms per product, measured in bf16 decoding; SDPA's CPU kernel has none)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=self.mask, enable_gqa=True)


class UnrollContext:
    """Training-time test: step 0 attends causally (`mask` [B, 1, T, T]); step k adds its rows' own keys of steps 1..k."""

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask
        self.kv: list[tuple[Tensor, Tensor]] = []

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.kv.append((k, v))
        k0, v0 = self.kv[0]
        return attention(q, k0, v0, self.mask, self.kv[1:])


class DraftAttention(nn.Module):
    """GQA attention reading `in_dim` features (H, or 2H for EAGLE-3), without biases (Llama layout)."""

    def __init__(self, sizes: LayerSizes, in_dim: int) -> None:
        super().__init__()
        self.sizes = sizes
        self.q_proj = nn.Linear(in_dim, sizes.heads * sizes.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, sizes.kv_heads * sizes.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, sizes.kv_heads * sizes.head_dim, bias=False)
        self.o_proj = nn.Linear(sizes.heads * sizes.head_dim, sizes.hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: CacheContext | UnrollContext) -> Tensor:
        b, t, _ = x.shape
        d = self.sizes.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)  # [B, h, T, d]
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)  # [B, kv, T, d]
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q, k = self.norm_qk(q, k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = ctx.attend(q, k, v)  # [B, h, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def norm_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q, k per head before rope: as they are in Llama's layer (target_layer.py's Qwen3 layer norms them)."""
        return q, k


class DraftMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, sizes: LayerSizes) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(sizes.hidden, sizes.intermediate, bias=False)
        self.up_proj = nn.Linear(sizes.hidden, sizes.intermediate, bias=False)
        self.down_proj = nn.Linear(sizes.intermediate, sizes.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """A pre-norm decoder layer. fused=True is EAGLE-3's: attention reads [norm(e); hidden_norm(h)] (2H).

    Returns the pre-norm output [B, T, H] (the residual stream), which EAGLE-3 feeds back as its next h.
    """

    attention: type[DraftAttention] = DraftAttention  # the attention type (target_layer.py: Qwen3's QK-norm)

    def __init__(self, sizes: LayerSizes, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.input_layernorm = RMSNorm(sizes.hidden, sizes.eps)
        if fused:
            self.hidden_norm = RMSNorm(sizes.hidden, sizes.eps)
        self.self_attn = self.attention(sizes, 2 * sizes.hidden if fused else sizes.hidden)
        self.post_attention_layernorm = RMSNorm(sizes.hidden, sizes.eps)
        self.mlp = DraftMLP(sizes)

    def forward(
        self, h: Tensor, cos: Tensor, sin: Tensor, ctx: CacheContext | UnrollContext, emb: Tensor | None = None
    ) -> Tensor:
        # h, emb: [B, T, H]; the residual stream starts at h (EAGLE-3: fc(g) or the fed-back state)
        if self.fused:
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        else:
            x = self.input_layernorm(h)
        h = h + self.self_attn(x, cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


def causal_padding_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive [B, 1, T, T] mask: row t sees real keys at positions <= t. attention_mask [B, T], 1 = real."""
    b, t = attention_mask.shape
    allowed = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = allowed.view(1, t, t) & attention_mask.bool().view(b, 1, t)
    mask = torch.zeros(b, 1, t, t, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill_(~allowed.view(b, 1, t, t), torch.finfo(dtype).min)


def positions_of(attention_mask: Tensor) -> Tensor:
    """Position ids [B, T] that count real tokens only (left padding keeps the first real token at 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
