"""Format `speculators`: vllm-project/speculators' `Eagle3Speculator`, the layout vLLM loads (DESIGN §5).

The decoder layer's Llama config nests under `transformer_layer_config`; the capture ids are top-level in
vLLM's convention, which is the HF one; `speculators_config` names the algorithm, the proposal method and
the verifier (the target); the layer config also carries `num_aux_hidden_states` (the number of capture
ids), which vLLM's Llama EAGLE-3 model sizes fc by. Keys: the layer under `layers.0.`, then `fc`, `norm`, `lm_head`, and
`d2t`/`t2d` for a reduced draft vocabulary. `norm_before_residual` is written false: draftsmith's draft
layer keeps the un-normed state as the residual, and vLLM assumes true when the field is absent. The layer
config's model_type picks vLLM's model (configs/speculators/algos.py: qwen3 -> Eagle3Qwen3ForCausalLM, the QK-norm
layer of a Qwen3 target's own type, `draft_layer: target`; llama -> Eagle3LlamaForCausalLM).
"""

from __future__ import annotations

from drafters.serving.layouts import eagle3_layer
from drafters.serving.layouts.eagle3_layer import LAYER_FIELDS
from drafters.serving.layouts.rules import Problem, TargetFacts, field

ARCH = "Eagle3Speculator"
KINDS = ("eagle3",)  # the drafter kinds this layout holds
LAYER_PREFIX = "layers.0."
# Config fields the exporter must write (dotted = nested); vLLM reads these to build the model.
REQUIRED = (
    "architectures",
    "speculators_model_type",
    "draft_vocab_size",
    "norm_before_residual",
    "eagle_aux_hidden_state_layer_ids",
    "speculators_config.algorithm",
    "speculators_config.default_proposal_method",
    "speculators_config.proposal_methods",
    "speculators_config.verifier.name_or_path",
    "speculators_config.verifier.architectures",
    *(f"transformer_layer_config.{f}" for f in LAYER_FIELDS),
)


def detects(cfg: dict) -> bool:
    return cfg.get("speculators_model_type") == "eagle3" or ARCH in (cfg.get("architectures") or [])


def plan(
    meta: dict, native_keys: list[str], t: TargetFacts, provenance: dict, speculative_tokens: int, with_embeddings: bool
) -> tuple[dict, dict[str, str]]:
    """config.json and {exported key: source} of a native EAGLE-3 drafter; speculative_tokens = the proposal
    length (0 = the drafter's training-time-test depth)."""
    ids, sources = eagle3_layer.plan_keys(meta, native_keys, t, LAYER_PREFIX, with_embeddings)
    provenance["capture_ids_hf"] = ids
    k = speculative_tokens or meta["config"].get("ttt_steps") or 3
    config = {
        "architectures": [ARCH],
        "speculators_model_type": "eagle3",
        # vLLM's converter copies only this dict and the algorithm's fields into the draft config, and its
        # llama_eagle3.py sizes fc from num_aux_hidden_states (3 when absent), not from the top-level ids
        "transformer_layer_config": {**eagle3_layer.layer_config(meta, t), "num_aux_hidden_states": len(ids)},
        "draft_vocab_size": meta["draft_vocab_size"],
        "norm_before_residual": False,
        **eagle3_layer.norm_fields(meta),
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(k),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": t.name_or_path, "architectures": list(t.architectures)},
        },
        "draftsmith": provenance,
    }
    return config, sources


def layer(cfg: dict) -> dict:
    """Where the config keeps the decoder layer's fields: `transformer_layer_config`."""
    return cfg.get("transformer_layer_config") or {}


def layer_type(cfg: dict) -> str:
    """The draft layer type vLLM builds: its converter maps the layer config's model_type (qwen3 | llama)."""
    return "qwen3" if layer(cfg).get("model_type") == "qwen3" else "llama"


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    fc_norm = bool(cfg.get("fc_norm"))  # top level: vLLM's converter reads it there, not from the layer config
    kind = layer_type(cfg)
    return eagle3_layer.expected_shapes(layer(cfg), ids, cfg.get("draft_vocab_size"), LAYER_PREFIX, fc_norm, kind)


def problems(cfg: dict, t: TargetFacts) -> list[Problem]:
    kind = layer_type(cfg)
    out = eagle3_layer.problems("speculators", cfg, layer(cfg), "transformer_layer_config.", ARCH, t, kind)
    if cfg.get("norm_before_residual") is not False:
        out.append(
            Problem(
                f"norm_before_residual is {cfg.get('norm_before_residual')}",
                "draftsmith's draft layer keeps the un-normed state as the residual: norm_before_residual "
                "false (vLLM assumes true when the field is absent)",
            )
        )
    ids, n = cfg.get("eagle_aux_hidden_state_layer_ids") or [], layer(cfg).get("num_aux_hidden_states")
    if ids and (n or 3) != len(ids):  # llama_eagle3.py builds fc for n (3 when absent) captured states
        out.append(
            Problem(
                f"{len(ids)} capture ids but transformer_layer_config.num_aux_hidden_states is {n}",
                f"vLLM sizes fc for num_aux_hidden_states captured states (3 when absent): set it to {len(ids)} "
                "(a draftsmith export writes it)",
            )
        )
    if field(cfg, "speculators_config.algorithm") != "eagle3":
        out.append(
            Problem("speculators_config.algorithm is not eagle3", 'set speculators_config.algorithm to "eagle3"')
        )
    return out
