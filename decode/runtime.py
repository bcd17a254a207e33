"""The fast decode runtime: a standard decoder layer as a few fused ops over weights packed once.

HF's decoder layer spends a decode step in three projections for attention, two for the MLP, and some forty small
ops around them, and BLAS multiplies the 1-25 rows of a decode pass poorly: on a 2-core AMD EPYC (avx2, fp32,
1 thread) a one-row product streams a wide `[out, in]` weight at 13-14 GB/s, and 8 rows cost 2.4x one row. Levers,
each measured alone (`scripts/bench_gemm.py`, `scripts/profile_round.py --runtimes hf,fast`):
1. fusion: q/k/v one product, gate/up one product (one weight stream each, fewer calls);
2. fp32 on an AVX2 CPU: decode.gemm's kernel over weights packed once into column panels, every row count one
   read of the weight (8 rows 1.8x one row), and its one-call RMSNorm, SiLU-gate and in-place rotary embedding;
3. elsewhere (bf16, GPUs, other CPUs): each linear in the layout its shape prefers for one-row products — a wide
   matrix stored `[in, out]` (23-24 GB/s against 13-14 as `[out, in]`), a tall one as `[out, in]`.

The packs are copies of the HF weights (the HF modules stay untouched for training and the offload hooks), stamped
with each weight's identity and version: a LoRA attached to the target, merged weights, or a training step changes
a stamp and the next pass repacks. Only layers of the families below run here, only without autograd and without
streamed (offloaded) layers; anything else runs through HF's own modules, as before.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decode import gemm
from decode.kvcache import KVCache

FAMILIES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")


def prefers_transposed(w: Tensor) -> bool:
    """Store `[in, out]` (and multiply `x @ w`) when the matrix is wide: measured faster for one-row products."""
    return w.shape[0] > w.shape[1]


@dataclass
class Packed:
    """One or more linears fused along their outputs, laid out for the few-row products of decoding."""

    w: Tensor  # fp32 on an AVX2 CPU: decode.gemm's panels [out / 16, in, 16]; else [in, out] when transposed, or [out, in]
    b: Tensor | None  # [out]
    transposed: bool
    rows: Tensor | None = None  # [out, in] kept beside a transposed w for products over several rows
    panels: int = 0  # outputs, when w holds decode.gemm's panels (0: it does not)

    @classmethod
    def of(cls, linears: list[nn.Linear], keep_rows: bool = False) -> Packed:
        """keep_rows: also keep the `[out, in]` weight (no copy for one linear) for multi-row products, where
        it is the faster layout for a very wide matrix (the LM head over 49k words: 19 vs 25 ms for 4 rows)."""
        w = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
        has_bias = any(m.bias is not None for m in linears)
        b = torch.cat([m.bias if m.bias is not None else w.new_zeros(m.out_features) for m in linears])
        if gemm.usable(w):  # one layout for every row count: the kernel reads each weight once per pass
            return cls(gemm.pack(w), b if has_bias else None, False, panels=w.shape[0])
        t = prefers_transposed(w)
        rows = w if t and keep_rows else None
        return cls(w.t().contiguous() if t else w.contiguous(), b if has_bias else None, t, rows)

    def __call__(self, x: Tensor) -> Tensor:  # [.., in] -> [.., out]
        if self.panels:
            y = gemm.gemm(x, self.w, self.panels)
        elif self.rows is not None and x.numel() > x.shape[-1]:
            y = F.linear(x, self.rows)
        else:
            y = x @ self.w if self.transposed else F.linear(x, self.w)
        return y if self.b is None else y + self.b


@dataclass
class LayerPack:
    """One decoder layer's weights, packed: norms, fused q/k/v, o, fused gate/up, down."""

    ln1: Tensor  # [D]
    ln2: Tensor  # [D]
    eps: float
    qkv: Packed
    o: Packed
    gate_up: Packed
    down: Packed
    q_norm: Tensor | None  # [head_dim] (Qwen3's per-head norms)
    k_norm: Tensor | None
    heads: int
    kv_heads: int
    head_dim: int
    scale: float


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on x [1, H, T, hd] with cos/sin [1, 1, T, hd] (HF's rotate_half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def layer_step(
    p: LayerPack, i: int, h: Tensor, cache: KVCache | None, cos: Tensor, sin: Tensor, mask: Tensor | None
) -> Tensor:
    """One decoder layer on h [1, T, D]; K/V appended to `cache` layer i. cos/sin [1, 1, T, hd]; mask: additive
    [1, 1, T, S] or None. fp32 on an AVX2 CPU the small ops are decode.gemm's (one call each), else aten's."""
    t, d = h.shape[1], h.shape[2]
    ops = gemm.kernel() if p.qkv.panels and gemm.fused(h) else None
    # 1. attention: norm, one fused q/k/v product, per-head norms (Qwen3), rotary, cache, SDPA, o.
    if ops is not None and p.q_norm is None:
        qkv = p.qkv(ops.rms_norm(h.view(t, d), p.ln1, p.eps))  # [T, (H + 2 KV) hd]
        ops.rope_(qkv, cos[0, 0], sin[0, 0], p.heads + p.kv_heads, p.head_dim)
        q, k, v = heads_of(p, qkv.view(1, t, -1))
    else:
        q, k, v = heads_of(p, p.qkv(F.rms_norm(h, (d,), p.ln1, p.eps)))
        if p.q_norm is not None:
            q, k = F.rms_norm(q, (p.head_dim,), p.q_norm, p.eps), F.rms_norm(k, (p.head_dim,), p.k_norm, p.eps)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, i)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p.scale, enable_gqa=p.heads != p.kv_heads)
    h = h + p.o(a.transpose(1, 2).reshape(1, t, p.heads * p.head_dim))
    # 2. MLP: norm, one fused gate/up product, SiLU gate, down.
    if ops is not None:
        return h + p.down(ops.silu_mul(p.gate_up(ops.rms_norm(h.view(t, d), p.ln2, p.eps)))).view(1, t, d)
    gate, up = p.gate_up(F.rms_norm(h, (d,), p.ln2, p.eps)).chunk(2, dim=-1)
    return h + p.down(F.silu(gate) * up)


def heads_of(p: LayerPack, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The fused product's output [1, T, (H + 2 KV) hd] -> q [1, H, T, hd], k, v [1, KV, T, hd] (views)."""
    t = qkv.shape[1]
    q, k, v = qkv.split([p.heads * p.head_dim, p.kv_heads * p.head_dim, p.kv_heads * p.head_dim], dim=-1)
    q, k, v = q.view(1, t, p.heads, -1), k.view(1, t, p.kv_heads, -1), v.view(1, t, p.kv_heads, -1)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def unsupported(layers: nn.ModuleList, config) -> str | None:
    """Why these layers cannot run here (None: they can)."""
    names = {type(layer).__name__ for layer in layers}
    if not names <= set(FAMILIES):
        return f"layer type {sorted(names - set(FAMILIES))} is not one of {FAMILIES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    for layer in layers:
        if getattr(layer.self_attn, "sliding_window", None):
            return "sliding-window attention"
        mods = [getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        mods += [getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not nn.Linear for m in mods):  # a LoRA or quantized wrapper
            return f"a projection is a {sorted({type(m).__name__ for m in mods} - {'Linear'})}, not a plain Linear"
    return None


def pack_layer(layer: nn.Module) -> LayerPack:
    a, m = layer.self_attn, layer.mlp
    qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    return LayerPack(
        ln1=layer.input_layernorm.weight,
        ln2=layer.post_attention_layernorm.weight,
        eps=float(layer.input_layernorm.variance_epsilon),
        qkv=Packed.of([a.q_proj, a.k_proj, a.v_proj]),
        o=Packed.of([a.o_proj]),
        gate_up=Packed.of([m.gate_proj, m.up_proj]),
        down=Packed.of([m.down_proj]),
        q_norm=None if qn is None else qn.weight,
        k_norm=None if kn is None else kn.weight,
        heads=a.q_proj.out_features // a.head_dim,
        kv_heads=a.k_proj.out_features // a.head_dim,
        head_dim=a.head_dim,
        scale=float(a.scaling),
    )


Stamp = tuple[
    nn.Module, str, nn.Module, Tensor | None, int
]  # parent, child name, child, its weight, the weight's version


def stamps(layers: nn.ModuleList, norm: nn.Module, lm_head: nn.Module) -> list[Stamp]:
    """Every weight the packs copy, with where its module hangs: a replaced module (a LoRA wrapper), a replaced
    weight, or an in-place update (an optimizer step, a merge) makes the packs stale."""
    parents: list[nn.Module] = []
    for layer in layers:
        parents += [layer, layer.self_attn, layer.mlp]
    out = [(p, name, c) for p in parents for name, c in p.named_children()] + [(norm, "", norm), (lm_head, "", lm_head)]
    return [(p, name, c, w, w._version if w is not None else 0) for p, name, c in out for w in [weight(c)]]


def weight(m: nn.Module) -> Tensor | None:
    w = getattr(m, "weight", None)
    return w if isinstance(w, Tensor) else None


def fresh(stamp: list[Stamp]) -> bool:
    """True when no stamped module, weight or version moved (about 50 us for a 30-layer model)."""
    for parent, name, child, w, version in stamp:
        if (
            (name and parent._modules[name] is not child)
            or weight(child) is not w
            or (w is not None and w._version != version)
        ):
            return False
    return bool(stamp)


class Runtime:
    """Packed copies of a target's decoder layers and LM head, repacked when the HF weights change."""

    def __init__(self, layers: nn.ModuleList, norm: nn.Module, lm_head: nn.Linear, config) -> None:
        self.layers, self.norm, self.lm_head, self.config = layers, norm, lm_head, config
        self.packs: list[LayerPack] = []
        self.head: Packed | None = None
        self.stamp: list[Stamp] = []
        self.note: str | None = unsupported(layers, config)  # why the layers run through HF instead (None: they don't)

    def ready(self) -> bool:
        """(Re)pack when any watched module or weight changed since the last pack; False: these layers can't run here."""
        if fresh(self.stamp):
            return self.note is None
        self.stamp, self.note = stamps(self.layers, self.norm, self.lm_head), unsupported(self.layers, self.config)
        if self.note is None:
            with torch.inference_mode(False), torch.no_grad():  # plain tensors: usable in and out of inference mode
                self.packs = [pack_layer(layer) for layer in self.layers]
                self.head = Packed.of([self.lm_head], keep_rows=True)
        return self.note is None

    def step(
        self, i: int, h: Tensor, cache: KVCache | None, rope: tuple[Tensor, Tensor], mask: Tensor | None
    ) -> Tensor:
        cos, sin = rope
        return layer_step(self.packs[i], i, h, cache, cos.unsqueeze(1), sin.unsqueeze(1), mask)

    def logits(self, h: Tensor) -> Tensor:
        """Final norm + LM head on pre-norm states. [.., D] -> [.., V]"""
        return self.head(self.norm(h))


class PackedLinear(nn.Module):
    """An nn.Linear whose product runs through Packed: for decode-time copies of drafters (no autograd)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        with torch.no_grad():
            self.packed = Packed.of([linear])
        self.weight, self.bias = linear.weight, linear.bias  # the originals, for code that reads them
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:  # [.., in] -> [.., out]
        return self.packed(x)


def packed_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` for decoding whose every nn.Linear is a PackedLinear. Shallow where it can be: parameters,
    buffers and plain attributes (a frozen target held as one) are shared, only the module tree is new, so the
    trained module itself is never touched."""
    new = copy.copy(module)
    new._modules = {
        name: None if child is None else PackedLinear(child) if type(child) is nn.Linear else packed_copy(child)
        for name, child in module._modules.items()
    }
    return new
