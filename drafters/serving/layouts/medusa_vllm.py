"""Format `medusa-vllm`: vLLM's `MedusaModel` (DESIGN §5).

Config: `num_heads`, `num_hidden_layers` (ResBlocks per head), `hidden_size`, `vocab_size`. Keys: the
ResBlocks as they are, `blocks.{k}.layers.{l}.weight|bias`, and a vocabulary head per Medusa head,
`lm_heads.{k}.weight`. vLLM always reads a head per Medusa head, so heads trained on the target's frozen
LM head get copies of it — or one copy with `original_lm_head` (`--medusa-shared-head`).
"""

from __future__ import annotations

from drafters.serving.layouts.rules import TARGET_HEAD, Problem, TargetFacts

ARCH = "MedusaModel"
KINDS = ("medusa",)  # the drafter kinds this layout holds
# Config fields the exporter must write; vLLM reads these to build the model.
REQUIRED = (
    "architectures",
    "model_type",
    "hidden_size",
    "vocab_size",
    "num_heads",
    "num_hidden_layers",
    "medusa_fc_bias",
    "truncated_vocab_size",
)


def detects(cfg: dict) -> bool:
    return cfg.get("model_type") == "medusa" or ARCH in (cfg.get("architectures") or [])


def plan(
    meta: dict, native_keys: list[str], t: TargetFacts, provenance: dict, shared_head_once: bool
) -> tuple[dict, dict[str, str]]:
    """config.json and {exported key: native key or TARGET_HEAD} of a native Medusa drafter; shared_head_once:
    with the target's head, write it once with vLLM's `original_lm_head` instead of one copy per head."""
    c = meta["config"]
    heads, per_head = c["num_heads"], c.get("per_head_vocab", False)
    sources = {k: k for k in native_keys}
    once = shared_head_once and not per_head
    if not per_head:  # the target's frozen head: copies (or one, with original_lm_head)
        sources.update({f"lm_heads.{k}.weight": TARGET_HEAD for k in range(1 if once else heads)})
        provenance["note"] = (
            "lm_heads.0.weight is the target's LM head; original_lm_head shares it across heads"
            if once
            else "every lm_heads.{k}.weight is a copy of the target's LM head"
        )
    config = {
        "architectures": [ARCH],
        "model_type": "medusa",
        "hidden_size": t.hidden,
        "vocab_size": t.vocab,
        "num_heads": heads,
        "num_hidden_layers": c.get("num_layers", 1),
        "medusa_fc_bias": True,
        "truncated_vocab_size": t.vocab,
        "max_paths": 64,
        "topk": 10,
        "draftsmith": provenance,
    }
    if once:
        config["original_lm_head"] = True
    return config, sources


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """{key: shape} vLLM's MedusaModel builds for this config (missing fields read as 0)."""
    H, V = cfg.get("hidden_size", 0), cfg.get("vocab_size", 0)
    out = {}
    for k in range(cfg.get("num_heads", 0)):
        for j in range(cfg.get("num_hidden_layers", 0)):
            out[f"blocks.{k}.layers.{j}.weight"] = (H, H)
            if cfg.get("medusa_fc_bias", False):
                out[f"blocks.{k}.layers.{j}.bias"] = (H,)
        if k == 0 or not cfg.get("original_lm_head", False):
            out[f"lm_heads.{k}.weight"] = (cfg.get("truncated_vocab_size") or V, H)
    return out


def problems(cfg: dict, t: TargetFacts) -> list[Problem]:
    """The config against the target: heads, sizes, vocabulary."""
    out = []
    if not (isinstance(cfg.get("num_heads"), int) and cfg["num_heads"] >= 1):
        out.append(Problem(f"num_heads is {cfg.get('num_heads')}", "set num_heads to the number of Medusa heads"))
    if cfg.get("hidden_size") != t.hidden:
        out.append(
            Problem(
                f"hidden_size is {cfg.get('hidden_size')}, the target's is {t.hidden}",
                "these heads read another model's hidden states: use the target they were trained for",
            )
        )
    if cfg.get("vocab_size") != t.vocab:
        out.append(
            Problem(
                f"vocab_size is {cfg.get('vocab_size')}, the target's is {t.vocab}",
                "use the target (and tokenizer) the heads were trained for",
            )
        )
    if cfg.get("truncated_vocab_size", t.vocab) != cfg.get("vocab_size"):
        out.append(
            Problem(
                "truncated_vocab_size differs from vocab_size",
                "draftsmith writes full-vocabulary Medusa heads (no token_map)",
            )
        )
    return out
