"""The one Llama decoder layer both EAGLE-3 layouts carry (SGLang's under `midlayer.`, speculators' under
`layers.0.`): its config, where its keys come from, the shapes an engine builds from that config, and the
checks of that config against the target. The two layout files add their own envelope around it.

The layer is Llama's, or with `draft_layer: target` on a Qwen3 target Qwen3's: Llama's plus QK-norm
(`self_attn.{q,k}_norm.weight` [head_dim], drafters/trainable/target_layer.py). vLLM 0.32 builds that one from
qwen3_eagle3.py: registry.py maps `Eagle3Qwen3ForCausalLM` there (the SGLang layout names it in architectures),
and speculators' converter picks it for a layer config of model_type qwen3 (configs/speculators/algos.py)."""

from __future__ import annotations

import json

from drafters.serving.layouts.rules import (
    DRAFT_VOCAB_KEYS,
    SHARED_EMBEDDING,
    TARGET_EMBED,
    Problem,
    TargetFacts,
    capture_problems,
    fc_column_order,
    full_draft_vocab,
    rope_settings,
)
from drafters.trainable.target_layer import LAYER_TYPES, layer_type

# Config fields of the layer the engines read to build it (each layout requires them where it keeps the layer).
LAYER_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "vocab_size",
    "tie_word_embeddings",
)
NATIVE_PREFIX = "midlayer."  # where a native EAGLE-3 checkpoint keeps its layer


def layer_config(meta: dict, t: TargetFacts) -> dict:
    """The decoder-layer config of an EAGLE-3 drafter on target t (the target's attention and rope); model_type
    llama, or qwen3 for a Qwen3 target's own layer (`draft_layer: target`)."""
    return {
        "model_type": layer_type(meta["config"].get("draft_layer", "llama"), t.model_type),
        "hidden_size": t.hidden,
        "intermediate_size": meta["config"].get("intermediate_size") or t.intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads,
        "head_dim": t.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": t.max_positions,
        "rms_norm_eps": t.eps,
        "rope_theta": t.rope_theta,
        "rope_scaling": t.rope_scaling,
        "vocab_size": t.vocab,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": t.bos,
        "eos_token_id": t.eos,
    }


def plan_keys(
    meta: dict, native_keys: list[str], t: TargetFacts, prefix: str, with_embeddings: bool
) -> tuple[list[int], dict[str, str]]:
    """(capture ids ascending, {exported key: native key or TARGET_EMBED}) of a native EAGLE-3 drafter:
    the layer moved under `prefix`, no d2t/t2d for a full draft vocabulary, the target's embedding if asked."""
    ids = sorted(int(i) for i in meta["capture_ids"])
    full_vocab = full_draft_vocab(meta["draft_vocab_size"], t)
    sources = {
        k.replace(NATIVE_PREFIX, prefix, 1): k for k in native_keys if not (full_vocab and k in DRAFT_VOCAB_KEYS)
    }
    sources.update(fc_norm_sources([int(i) for i in meta["capture_ids"]], native_keys))
    if with_embeddings:
        sources[SHARED_EMBEDDING] = TARGET_EMBED
    return ids, sources


def fc_norm_sources(ids: list[int], native_keys: list[str]) -> dict[str, str]:
    """{exported fc_norm key: native key}: each capture id's norm follows its block of fc into ascending order
    (the exporter permutes fc by fc_column_order), so engines norm each captured state with its own weight."""
    order = fc_column_order(ids) or list(range(len(ids)))
    return {
        f"fc_norm.{new}.weight": f"fc_norm.{old}.weight"
        for new, old in enumerate(order)
        if f"fc_norm.{old}.weight" in native_keys
    }


def norm_fields(meta: dict) -> dict:
    """EAGLE-3.1's switches as vLLM reads them (top-level `fc_norm`, `norm_output`; speculators' converter copies
    them from the top level too), written only when set: a drafter without them exports as before."""
    cfg = meta["config"]
    return {k: True for k in ("fc_norm", "norm_output") if cfg.get(k)}


def expected_shapes(
    layer: dict, ids: list[int] | None, draft_vocab: int | None, prefix: str, fc_norm: bool = False, kind: str = "llama"
) -> dict[str, tuple[int, ...]]:
    """{key: shape} an engine builds for this layer config (missing fields read as 0), with fc, norm, lm_head,
    fc_norm.{i} per capture id when the config sets fc_norm and, for a reduced draft vocabulary, d2t/t2d."""
    H, V = layer.get("hidden_size", 0), layer.get("vocab_size", 0)
    heads = layer.get("num_attention_heads", 0)
    d = layer.get("head_dim") or (H // heads if heads else 0)
    q, kv, inter = heads * d, (layer.get("num_key_value_heads") or heads) * d, layer.get("intermediate_size", 0)
    n = draft_vocab or V
    shapes = {
        "self_attn.q_proj.weight": (q, 2 * H),
        "self_attn.k_proj.weight": (kv, 2 * H),
        "self_attn.v_proj.weight": (kv, 2 * H),
        "self_attn.o_proj.weight": (H, q),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
        "input_layernorm.weight": (H,),
        "hidden_norm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
    }
    if kind == "qwen3":  # vLLM's Qwen3Attention: RMSNorm(head_dim) on q and on k
        shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    out = {prefix + k: v for k, v in shapes.items()}
    out.update({"fc.weight": (H, len(ids or (0, 0, 0)) * H), "norm.weight": (H,), "lm_head.weight": (n, H)})
    if fc_norm:  # vLLM: RMSNorm(target_hidden_size) per captured state, `fc_norm.{i}`
        out.update({f"fc_norm.{i}.weight": (H,) for i in range(len(ids or (0, 0, 0)))})
    if n != V:  # a full draft vocabulary has no mapping (vLLM refuses one)
        out.update({"d2t": (n,), "t2d": (V,)})
    return out


def problems(
    fmt: str, cfg: dict, layer: dict, where: str, arch: str, t: TargetFacts, kind: str = "llama"
) -> list[Problem]:
    """An EAGLE-3 config (`layer` = where it keeps the layer, `where` its dotted prefix for messages, `kind` the
    layer type an engine builds from it) against the target and draftsmith's decoder: architecture, layer type,
    sizes, attention, rope, draft vocabulary, capture ids."""
    out: list[Problem] = []

    def need(ok: bool, what: str, fix: str, blocks: bool = True) -> None:
        if not ok:
            out.append(Problem(what, fix, blocks))

    need(
        arch in (cfg.get("architectures") or []),
        f"architectures is {cfg.get('architectures')}, not [{arch!r}]",
        f'set "architectures": ["{arch}"] so the engine picks its EAGLE-3 model',
    )
    need(
        kind == "llama" or LAYER_TYPES.get(t.model_type or "") == kind,
        f"the draft layer is a {kind} decoder layer, the target a {t.model_type}",
        f"draftsmith builds a {kind} draft layer (the target's own type) on a {kind} target only: use the "
        "target it was trained for",
    )
    H, V = layer.get("hidden_size"), layer.get("vocab_size")
    need(
        H == t.hidden,
        f"{where}hidden_size is {H}, the target's is {t.hidden}",
        "this drafter reads another model's hidden states: use the target it was trained for",
    )
    need(
        V == t.vocab,
        f"{where}vocab_size is {V}, the target's is {t.vocab}",
        "d2t/t2d map into another vocabulary: use the target (and tokenizer) it was trained for",
    )
    n = cfg.get("draft_vocab_size")
    need(
        isinstance(n, int) and 1 <= n <= t.vocab,
        f"draft_vocab_size is {n}, not in 1..{t.vocab}",
        "set draft_vocab_size to the rows of lm_head.weight",
    )
    need(
        layer.get("num_hidden_layers") == 1,
        f"{where}num_hidden_layers is {layer.get('num_hidden_layers')}",
        "draftsmith decodes one-layer EAGLE-3 drafters (set 1 if the weights have one midlayer)",
    )
    heads = layer.get("num_attention_heads")
    head_dim = layer.get("head_dim") or (H // heads if H and heads else None)
    need(
        head_dim == t.head_dim,
        f"{where}head_dim is {head_dim}, the target's is {t.head_dim}",
        f"set head_dim to {t.head_dim} if the weights were trained with it; draftsmith's decoder runs the "
        "draft layer on the target's rotary embedding, so other head dims cannot be evaluated here",
    )
    for name, want in (("num_attention_heads", t.heads), ("num_key_value_heads", t.kv_heads)):
        got = layer.get(name) if name == "num_attention_heads" else layer.get(name) or heads
        need(
            got == want,
            f"{where}{name} is {got}, the target's is {want}",
            f"set {name} to {want} if that is what the weights hold; draftsmith builds the draft layer with "
            "the target's attention shapes",
        )
    theta, scaling = rope_settings(layer)
    need(
        theta == t.rope_theta,
        f"{where}rope_theta is {theta:g}, the target's is {t.rope_theta:g}",
        f"set rope_theta to {t.rope_theta:g}: the drafter must rotate positions as the target does",
    )
    need(
        scaling == t.rope_scaling,
        f"{where}rope_scaling is {scaling}, the target's is {t.rope_scaling}",
        f"set rope_scaling to {json.dumps(t.rope_scaling)}",
    )
    need(
        layer.get("max_position_embeddings") == t.max_positions,
        f"{where}max_position_embeddings is {layer.get('max_position_embeddings')}, the target's is {t.max_positions}",
        f"set max_position_embeddings to {t.max_positions} (engines cap the draft's context at this value)",
        blocks=False,
    )
    need(
        not layer.get("tie_word_embeddings", False),
        f"{where}tie_word_embeddings is true",
        "set it to false: with tied embeddings SGLang uses the embedding as the draft LM head, not lm_head.weight",
    )
    need(
        layer.get("hidden_act", "silu") == "silu",
        f"{where}hidden_act is {layer.get('hidden_act')}",
        "EAGLE-3's draft layer is a SwiGLU (silu) Llama layer",
    )
    need(
        cfg.get("target_hidden_size") in (None, t.hidden),
        f"target_hidden_size is {cfg.get('target_hidden_size')}",
        "draftsmith supports drafters as wide as the target (target_hidden_size null)",
    )
    return out + capture_problems(fmt, cfg, t)
