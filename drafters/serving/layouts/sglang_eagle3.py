"""Format `eagle3`: SGLang's `LlamaForCausalLMEagle3`, the layout EAGLE-3's own release uses (DESIGN §5).

One flat config: the decoder layer's Llama fields at the top level, `draft_vocab_size`, and the capture ids
in `eagle_config.eagle_aux_hidden_state_layer_ids` in SGLang's convention (HF id - 1, rules.py). vLLM loads
the same layout but reads that field as HF ids, so the field is left out for the engines' shared default
ids and otherwise written for one engine (`--engine`, recorded in `draftsmith.engine`). Keys: the layer
under `midlayer.`, then `fc`, `norm`, `lm_head`, and `d2t`/`t2d` for a reduced draft vocabulary; no
`embed_tokens` (unless --with-embeddings). A Qwen3 target's own layer (`draft_layer: target`) is written under
vLLM's name for it, `Eagle3Qwen3ForCausalLM` (model_type qwen3, and `midlayer.self_attn.{q,k}_norm.weight`);
SGLang 0.5.23 has no class of that name (read in its wheel), so such a directory serves in vLLM only.
"""

from __future__ import annotations

from drafters.serving.layouts import eagle3_layer
from drafters.serving.layouts.eagle3_layer import LAYER_FIELDS
from drafters.serving.layouts.rules import Problem, TargetFacts, engine_default_ids, field

ARCH = "LlamaForCausalLMEagle3"
# draft layer type -> architectures name; vLLM 0.32's registry.py maps these to llama_eagle3.py / qwen3_eagle3.py
ARCHS = {"llama": ARCH, "qwen3": "Eagle3Qwen3ForCausalLM"}
KINDS = ("eagle3",)  # the drafter kinds this layout holds
LAYER_PREFIX = "midlayer."
# Config fields the exporter must write (dotted = nested); SGLang and vLLM read these to build the model.
REQUIRED = ("architectures", *LAYER_FIELDS, "draft_vocab_size", "eagle_config.use_aux_hidden_state")


def detects(cfg: dict) -> bool:
    return any(a in ARCHS.values() for a in cfg.get("architectures") or [])


def layer_type(cfg: dict) -> str:
    """The draft layer type an engine builds: vLLM picks its model by architecture, whatever the model_type."""
    return "qwen3" if ARCHS["qwen3"] in (cfg.get("architectures") or []) else "llama"


def plan(
    meta: dict, native_keys: list[str], t: TargetFacts, provenance: dict, engine: str, with_embeddings: bool
) -> tuple[dict, dict[str, str]]:
    """config.json and {exported key: source} of a native EAGLE-3 drafter; `engine` reads non-default ids."""
    ids, sources = eagle3_layer.plan_keys(meta, native_keys, t, LAYER_PREFIX, with_embeddings)
    provenance["capture_ids_hf"] = ids
    eagle = {"use_aux_hidden_state": True}
    if ids == engine_default_ids(t.layers):
        provenance["note"] = (
            "no eagle_aux_hidden_state_layer_ids: the ids are SGLang's and vLLM's shared default, which both read right"
        )
    else:  # SGLang reads id i as the output of layer i (HF id - 1), vLLM as HF id i
        provenance["engine"] = engine
        provenance["note"] = (
            f"eagle_aux_hidden_state_layer_ids are {engine}'s "
            f"({'HF ids - 1' if engine == 'sglang' else 'HF ids'}): this directory "
            f"captures the trained layers in {engine} only"
        )
        eagle["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids] if engine == "sglang" else ids
    layer_config = eagle3_layer.layer_config(meta, t)
    config = {
        "architectures": [ARCHS[layer_config["model_type"]]],
        **layer_config,
        "draft_vocab_size": meta["draft_vocab_size"],
        **eagle3_layer.norm_fields(meta),
        "eagle_config": eagle,
        "draftsmith": provenance,
    }
    return config, sources


def layer(cfg: dict) -> dict:
    """Where the config keeps the decoder layer's fields: the top level."""
    return cfg


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    ids = field(cfg, "eagle_config.eagle_aux_hidden_state_layer_ids")
    fc_norm = bool(cfg.get("fc_norm"))
    return eagle3_layer.expected_shapes(cfg, ids, cfg.get("draft_vocab_size"), LAYER_PREFIX, fc_norm, layer_type(cfg))


def problems(cfg: dict, t: TargetFacts) -> list[Problem]:
    kind = layer_type(cfg)
    return eagle3_layer.problems("eagle3", cfg, cfg, "", ARCHS[kind], t, kind)
