"""EAGLE-3's draft layer of the target's own decoder-layer type (`drafter.eagle3.draft_layer: target`).

EAGLE-3 trains a Llama layer whatever the target (`draft_layer: llama`). `target` builds the target's own layer
type instead, where DraftLayer can express it, keeping EAGLE-3's [RMSNorm(e); RMSNorm(h)] (2H) input to q/k/v:
- llama, mistral: Llama's layer itself (Mistral's sliding window is an attention range, not a weight);
- qwen3: Llama's plus QK-norm, an RMSNorm over head_dim on q and on k after projection and before rope (HF's
  Qwen3Attention; vLLM 0.32's qwen3_eagle3.py, whose Qwen3Eagle3DecoderLayer is a Qwen3DecoderLayer), with the
  weights under the names vLLM loads: `self_attn.q_norm.weight`, `self_attn.k_norm.weight` [head_dim].
Anything else is refused. Qwen2 too: its q/k/v projections carry biases, which this layer has not, and vLLM's
Llama EAGLE-3 model cannot load them alone (its `attention_bias` puts a bias on o_proj as well).
"""

from __future__ import annotations

from torch import Tensor

from drafters.trainable.draft_layer import DraftAttention, DraftLayer, LayerSizes, RMSNorm

DRAFT_LAYERS = ("llama", "target")  # drafter.eagle3.draft_layer: EAGLE-3's Llama layer | the target's own type
# target model_type -> the layer type `target` builds for it
LAYER_TYPES = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3"}


def check_draft_layer(draft_layer: str) -> None:
    if draft_layer not in DRAFT_LAYERS:
        raise ValueError(f"draft_layer must be one of {list(DRAFT_LAYERS)}, got {draft_layer!r}")


def layer_type(draft_layer: str, model_type: str | None) -> str:
    """The draft layer's type ('llama' | 'qwen3') for a `draft_layer` choice on a target of `model_type`.

    Raises for `target` on a model type whose decoder layer cannot be built here (before any weight is made)."""
    check_draft_layer(draft_layer)
    if draft_layer == "llama":
        return "llama"
    if model_type not in LAYER_TYPES:
        raise ValueError(
            f"drafter.eagle3.draft_layer=target: draftsmith cannot build the decoder layer of a {model_type!r} "
            f"target (it builds those of {', '.join(LAYER_TYPES)} targets); set drafter.eagle3.draft_layer=llama, "
            "EAGLE-3's own Llama layer"
        )
    return LAYER_TYPES[model_type]


class QKNormAttention(DraftAttention):
    """DraftAttention with Qwen3's QK-norm: RMSNorm over head_dim on q and k, after projection, before rope."""

    def __init__(self, sizes: LayerSizes, in_dim: int) -> None:
        super().__init__(sizes, in_dim)
        # HF's Qwen3RMSNorm (= Llama's) with the target's epsilon, as vLLM's Qwen3Attention builds them
        self.q_norm = RMSNorm(sizes.head_dim, sizes.eps)
        self.k_norm = RMSNorm(sizes.head_dim, sizes.eps)

    def norm_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        # q [B, h, T, d], k [B, kv, T, d]: each head's vector normed on its own (over d)
        return self.q_norm(q), self.k_norm(k)


class QKNormDraftLayer(DraftLayer):
    """A Qwen3 decoder layer as EAGLE-3's draft layer (fused [norm(e); hidden_norm(h)] input, QK-norm attention)."""

    attention = QKNormAttention


LAYERS: dict[str, type[DraftLayer]] = {"llama": DraftLayer, "qwen3": QKNormDraftLayer}


def eagle3_layer(sizes: LayerSizes, draft_layer: str, model_type: str | None) -> DraftLayer:
    """EAGLE-3's fused draft layer for a target of `model_type` (`llama`: today's DraftLayer, the same weights
    drawn in the same order)."""
    return LAYERS[layer_type(draft_layer, model_type)](sizes, fused=True)
