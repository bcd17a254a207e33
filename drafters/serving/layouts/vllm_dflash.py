"""Format `vllm-dflash`: z-lab's DFlash release layout, which vLLM 0.32 loads as `DFlashDraftModel`
(model_executor/models/qwen3_dflash.py, `DFlashQwen3ForCausalLM`).

vLLM's DFlash draft layer is a Qwen3 decoder layer: it always norms q and k per head (`DFlashQwen3Attention`
builds `q_norm`/`k_norm` unconditionally) and norms the context keys with the same `k_norm`
(`_normalize_context_k`), so only a DFlash trained with `drafter.dflash.qk_norm: true` computes there what it
computes here; the export refuses the others. The context is `hidden_norm(fc([h_a; h_b; ...]))` with the captured
states concatenated in layer order (ids ascending, fc's column blocks permuted to match), as ours.

Config: a Qwen3 config (model_type qwen3, `num_hidden_layers` = draft layers), `block_size` K, and
`dflash_config` {mask_token_id, target_layer_ids, causal: false, use_aux_hidden_state}. DFlash's
`target_layer_ids` count decoder layers whose *output* is read: HF hidden id i is DFlash id i - 1 (vLLM adds 1
back, v1/worker/gpu/spec_decode/eagle/eagle3_utils.py); `eagle_aux_hidden_state_layer_ids` carries the HF ids
too (vLLM reads that field first). vLLM drafts `num_speculative_tokens` + 1 query rows non-causally, so a
block of K is served with num_speculative_tokens = K - 1 exactly (another count changes every draft).

The mask: vLLM embeds masked rows as the token `mask_token_id`. A drafter trained on a token's embedding writes
that id; a learned mask vector is written as one extra embedding row: `vocab_size` V + 1, `mask_token_id` V,
and `embed_tokens.weight` = [the target's embedding; the learned vector] (vLLM keeps a draft's own embedding when
it differs from the target's; no real token is ever V, so anchors embed as the target's). The LM head stays the
target's (no `lm_head.weight`: vLLM shares it); `draft_vocab_size` V. A drafter with a draft vocabulary of N
tokens ships its N rows of the target's head as `lm_head.weight` [N, H] and `d2t` [N] (target id = draft id +
d2t), `draft_vocab_size` N: vLLM then keeps that head and maps the logits back (qwen3_dflash.py, compute_logits).
Keys: `fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.{l}.{input_layernorm,post_attention_layernorm}.
weight`, `layers.{l}.self_attn.{q,k,v,o}_proj.weight`, `layers.{l}.self_attn.{q,k}_norm.weight`,
`layers.{l}.mlp.{gate,up,down}_proj.weight` (our native names), and `embed_tokens.weight` for a learned mask.
"""

from __future__ import annotations

from drafters.serving.layouts.rules import DRAFT_HEAD, Problem, TargetFacts, field

ARCH = "DFlashDraftModel"
KINDS = ("dflash",)  # DSpark's Markov and confidence heads have no place in this layout
MASK_ROWS = "<target embed_tokens + the learned mask row>"  # source of embed_tokens.weight for a learned mask
EMBED = "embed_tokens.weight"
# The Qwen3 fields vLLM builds the draft layers from (top level here, transformer_layer_config in speculators').
LAYER_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "vocab_size",
)
REQUIRED = (
    "architectures",
    *LAYER_FIELDS,
    "draft_vocab_size",
    "block_size",
    "dflash_config.mask_token_id",
    "dflash_config.target_layer_ids",
    "dflash_config.causal",
)
LAYER_KEYS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def detects(cfg: dict) -> bool:
    return ARCH in (cfg.get("architectures") or []) and "speculators_model_type" not in cfg


def unfit(meta: dict, speculative_tokens: int) -> str | None:
    """Why a native DFlash cannot be written for vLLM (None: it can), with what to do instead."""
    c, kind = meta["config"], meta.get("draftsmith_drafter", "dflash")
    if not c.get("qk_norm"):
        return (
            "vLLM's DFlash draft layers norm q and k per head (qwen3_dflash.py, DFlashQwen3Attention), this drafter's "
            f"layers do not, so vLLM would draft other tokens: train it with drafter.{kind}.qk_norm=true"
        )
    k = int(c["block_size"])
    if speculative_tokens and speculative_tokens != k - 1:
        return (
            f"--speculative-tokens {speculative_tokens}: vLLM runs num_speculative_tokens + 1 block rows "
            f"non-causally, so this drafter's block of {k} is served with exactly {k - 1} (leave the option out)"
        )
    return None


def layer_config(meta: dict, t: TargetFacts) -> dict:
    """The Qwen3 config vLLM builds the draft layers from (the target's attention and rope)."""
    c = meta["config"]
    learned = int(c["mask_token_id"]) < 0
    rope = {"rope_type": "default", **(t.rope_scaling or {}), "rope_theta": t.rope_theta}
    return {
        "model_type": "qwen3",
        "hidden_size": t.hidden,
        "intermediate_size": c.get("intermediate_size") or t.intermediate,
        "num_hidden_layers": int(c["num_layers"]),
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.kv_heads,
        "head_dim": t.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": t.max_positions,
        "rms_norm_eps": t.eps,
        "rope_theta": t.rope_theta,
        "rope_parameters": rope,
        "vocab_size": t.vocab + 1 if learned else t.vocab,  # a learned mask is one extra row (module docstring)
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": t.bos,
        "eos_token_id": t.eos,
    }


def plan_keys(meta: dict, native_keys: list[str]) -> dict[str, str]:
    """{exported key: native key, MASK_ROWS or DRAFT_HEAD}: the names are ours, the learned mask becomes an embedding
    row, a draft vocabulary its head rows + d2t (t2d is the target-sized mask vLLM skips: left out)."""
    sources = {k: k for k in native_keys if k not in ("mask_embedding", "t2d")}
    if "mask_embedding" in native_keys:
        sources[EMBED] = MASK_ROWS
    if "d2t" in native_keys:
        sources["lm_head.weight"] = DRAFT_HEAD
    return sources


def vocab_of(meta: dict, t: TargetFacts) -> int:
    """The draft vocabulary's size N, or the target's V (a drafter without one)."""
    return int(meta["config"].get("draft_vocab_size") or 0) or t.vocab


def dflash_fields(meta: dict, t: TargetFacts) -> tuple[list[int], dict]:
    """(HF capture ids ascending, dflash_config) of a native DFlash."""
    ids = sorted(int(i) for i in meta["capture_ids"])
    mask = int(meta["config"]["mask_token_id"])
    return ids, {
        "mask_token_id": t.vocab if mask < 0 else mask,
        "target_layer_ids": [i - 1 for i in ids],  # DFlash counts layer outputs: HF id - 1
        "causal": False,  # the block attends to itself both ways
        "use_aux_hidden_state": True,
    }


def plan(meta: dict, native_keys: list[str], t: TargetFacts, provenance: dict) -> tuple[dict, dict[str, str]]:
    """config.json and {exported key: source} of a native DFlash drafter."""
    ids, dflash = dflash_fields(meta, t)
    provenance["capture_ids_hf"] = ids
    provenance["note"] = f"serve with num_speculative_tokens {int(meta['config']['block_size']) - 1} (block_size - 1)"
    config = {
        "architectures": [ARCH],
        **layer_config(meta, t),
        "draft_vocab_size": vocab_of(meta, t),
        "target_hidden_size": t.hidden,
        "block_size": int(meta["config"]["block_size"]),
        "num_target_layers": t.layers,
        "eagle_aux_hidden_state_layer_ids": ids,
        "dflash_config": dflash,
        "draftsmith": provenance,
    }
    return config, plan_keys(meta, native_keys)


def capture_ids_hf(cfg: dict) -> list[int] | None:
    """HF capture ids of a DFlash config (vLLM's precedence: eagle_aux ids, else DFlash ids + 1)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or cfg.get("aux_hidden_state_layer_ids")
    if ids:
        return [int(i) for i in ids]
    dflash = field(cfg, "dflash_config.target_layer_ids")
    return [int(i) + 1 for i in dflash] if dflash else None


def layer(cfg: dict) -> dict:
    return cfg


def shapes_of(layer_cfg: dict, n_ids: int) -> dict[str, tuple[int, ...]]:
    """{key: shape} vLLM's DFlashQwen3Model loads for this layer config and capture count (missing fields: 0)."""
    H, heads = layer_cfg.get("hidden_size", 0), layer_cfg.get("num_attention_heads", 0)
    d = layer_cfg.get("head_dim") or (H // heads if heads else 0)
    q, kv, inter = heads * d, (layer_cfg.get("num_key_value_heads") or heads) * d, layer_cfg.get("intermediate_size", 0)
    per_layer = dict(
        zip(LAYER_KEYS, [(H,), (H,), (q, H), (kv, H), (kv, H), (H, q), (d,), (d,), (inter, H), (inter, H), (H, inter)])
    )
    out = {"fc.weight": (H, n_ids * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for n in range(layer_cfg.get("num_hidden_layers", 0)):
        out.update({f"layers.{n}.{k}": s for k, s in per_layer.items()})
    return out


def expected_shapes(cfg: dict, t: TargetFacts) -> dict[str, tuple[int, ...]]:
    return vocab_shapes(shapes_of(cfg, len(capture_ids_hf(cfg) or ())), cfg, cfg, t)


def vocab_shapes(out: dict, cfg: dict, layer_cfg: dict, t: TargetFacts) -> dict[str, tuple[int, ...]]:
    """The shapes besides the layers': a learned mask's embedding (vocab_size V + 1), a draft vocabulary's head
    rows and d2t (draft_vocab_size N < V)."""
    V, H, n = layer_cfg.get("vocab_size", 0), layer_cfg.get("hidden_size", 0), cfg.get("draft_vocab_size") or 0
    if V == t.vocab + 1:  # a learned mask: the extra embedding row
        out[EMBED] = (V, H)
    if 0 < n < t.vocab:
        out.update({"lm_head.weight": (n, H), "d2t": (n,)})
    return out


def problems(cfg: dict, t: TargetFacts) -> list[Problem]:
    mask, causal = field(cfg, "dflash_config.mask_token_id"), field(cfg, "dflash_config.causal")
    return dflash_problems(cfg, cfg, "", mask, causal is False, t)


def dflash_problems(cfg: dict, layer_cfg: dict, where: str, mask, non_causal: bool, t: TargetFacts) -> list[Problem]:
    """A DFlash config (`layer_cfg` = where it keeps the Qwen3 fields, `mask` its mask token id, `non_causal`
    whether vLLM runs the block non-causally) against the target and our decoder."""
    out: list[Problem] = []

    def need(ok: bool, what: str, fix: str, blocks: bool = True) -> None:
        if not ok:
            out.append(Problem(what, fix, blocks))

    for name, want in (
        ("hidden_size", t.hidden),
        ("num_attention_heads", t.heads),
        ("num_key_value_heads", t.kv_heads),
        ("head_dim", t.head_dim),
    ):
        need(
            layer_cfg.get(name) == want,
            f"{where}{name} is {layer_cfg.get(name)}, the target's is {want}",
            "this drafter reads another model's hidden states and rotary embedding: use the target it was trained for",
        )
    V, n = layer_cfg.get("vocab_size"), cfg.get("draft_vocab_size", layer_cfg.get("vocab_size"))
    need(
        isinstance(n, int) and 1 <= n <= t.vocab,
        f"draft_vocab_size is {n}, the target's vocabulary is {t.vocab}",
        "a DFlash drafts over the target's vocabulary or a part of it (d2t): use the target it was trained for",
    )
    need(
        V in (t.vocab, t.vocab + 1),
        f"{where}vocab_size is {V}, the target's is {t.vocab}",
        "use the target (and tokenizer) the drafter was trained for",
    )
    need(
        isinstance(mask, int) and 0 <= mask < (V or 0) and (mask < t.vocab or V == t.vocab + 1),
        f"mask_token_id {mask} is outside the drafter's vocabulary 0..{(V or 0) - 1}",
        "set it to the token whose embedding the drafter was trained on (a learned mask: the extra row, vocab_size)",
    )
    ids = capture_ids_hf(cfg) or []
    need(bool(ids), "no capture ids (dflash_config.target_layer_ids)", "name the target layers the drafter reads")
    need(
        all(0 <= i < t.layers for i in ids),
        f"capture ids (HF) {ids} out of range 0..{t.layers - 1} for a {t.layers}-layer target",
        "the ids must name layers of this target: was the drafter trained for a deeper model?",
    )
    need(ids == sorted(ids), f"capture ids {ids} are not ascending", "re-export with draftsmith export")
    need(
        float(layer_cfg.get("rope_theta") or 0.0) == t.rope_theta,
        f"{where}rope_theta is {layer_cfg.get('rope_theta')}, the target's is {t.rope_theta:g}",
        f"set rope_theta to {t.rope_theta:g}: the drafter rotates positions as the target does",
    )
    need(
        non_causal,
        "the block's attention is not marked non-causal",
        "draftsmith's DFlash attends within the block both ways: set dflash_config.causal to false",
    )
    k = cfg.get("block_size")
    need(isinstance(k, int) and k >= 2, f"block_size is {k}", "set block_size to the trained block (anchor + masks)")
    need(
        layer_cfg.get("num_hidden_layers", 0) >= 1,
        f"{where}num_hidden_layers is {layer_cfg.get('num_hidden_layers')}",
        "set it to the number of draft layers in the weights",
    )
    return out
