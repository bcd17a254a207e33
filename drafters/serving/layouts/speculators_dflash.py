"""Format `speculators-dflash`: vllm-project/speculators' DFlash layout, which vLLM 0.32 converts to its
`DFlashDraftModel` (transformers_utils/configs/speculators/algos.py, `update_dflash`).

The Qwen3 layer config nests under `transformer_layer_config`; top-level `mask_token_id`, `draft_vocab_size`,
`target_hidden_size` and `aux_hidden_state_layer_ids` in HF ids (the converter writes them to
`eagle_aux_hidden_state_layer_ids` and to `dflash_config.target_layer_ids` as id - 1);
`sliding_window_non_causal: true` keeps the block non-causal (the converter's `causal = not that`), and
`speculators_config.proposal_methods[0].speculative_tokens` = block_size - 1 is what vLLM serves it with
(`build_vllm_speculative_config`). Keys and the learned-mask row are vllm_dflash.py's.
"""

from __future__ import annotations

from drafters.serving.layouts import vllm_dflash
from drafters.serving.layouts.rules import Problem, TargetFacts, field

ARCH = "DFlashSpeculator"
KINDS = vllm_dflash.KINDS
REQUIRED = (
    "speculators_model_type",
    "mask_token_id",
    "draft_vocab_size",
    "aux_hidden_state_layer_ids",
    "sliding_window_non_causal",
    "block_size",
    "speculators_config.algorithm",
    "speculators_config.proposal_methods",
    "speculators_config.verifier.name_or_path",
    *(f"transformer_layer_config.{f}" for f in vllm_dflash.LAYER_FIELDS),
)


def detects(cfg: dict) -> bool:
    return cfg.get("speculators_model_type") == "dflash"


def plan(meta: dict, native_keys: list[str], t: TargetFacts, provenance: dict) -> tuple[dict, dict[str, str]]:
    """config.json and {exported key: source} of a native DFlash drafter."""
    ids, dflash = vllm_dflash.dflash_fields(meta, t)
    provenance["capture_ids_hf"] = ids
    k = int(meta["config"]["block_size"])
    layer_cfg = {"architectures": [vllm_dflash.ARCH], **vllm_dflash.layer_config(meta, t)}
    config = {
        "architectures": [ARCH],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": vllm_dflash.vocab_of(meta, t),
        "target_hidden_size": t.hidden,
        "mask_token_id": dflash["mask_token_id"],
        "aux_hidden_state_layer_ids": ids,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,  # the anchor is the verified bonus token: K - 1 drafted positions
        "block_size": k,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": k - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": t.name_or_path, "architectures": list(t.architectures)},
        },
        "draftsmith": provenance,
    }
    return config, vllm_dflash.plan_keys(meta, native_keys)


def layer(cfg: dict) -> dict:
    return cfg.get("transformer_layer_config") or {}


def capture_ids_hf(cfg: dict) -> list[int] | None:
    ids = cfg.get("aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if ids else None


def expected_shapes(cfg: dict, t: TargetFacts) -> dict[str, tuple[int, ...]]:
    lay = layer(cfg)
    return vllm_dflash.vocab_shapes(vllm_dflash.shapes_of(lay, len(capture_ids_hf(cfg) or ())), cfg, lay, t)


def problems(cfg: dict, t: TargetFacts) -> list[Problem]:
    merged = {**cfg, "eagle_aux_hidden_state_layer_ids": capture_ids_hf(cfg)}
    out = vllm_dflash.dflash_problems(
        merged,
        layer(cfg),
        "transformer_layer_config.",
        cfg.get("mask_token_id"),
        cfg.get("sliding_window_non_causal", True) is True,
        t,
    )
    k, n = cfg.get("block_size"), field(cfg, "speculators_config.proposal_methods")
    spec = n[0].get("speculative_tokens") if isinstance(n, list) and n and isinstance(n[0], dict) else None
    if isinstance(k, int) and spec != k - 1:
        out.append(
            Problem(
                f"speculative_tokens is {spec}, the block holds {k} (anchor + {k - 1})",
                f"set speculators_config.proposal_methods[0].speculative_tokens to {k - 1}: vLLM runs that many + 1 "
                "block rows non-causally, another count changes every draft",
            )
        )
    return out
