"""Format `vllm-dspark`: vLLM 0.32's Qwen3 DSpark (`Qwen3DSparkModel`, model_executor/models/qwen3_dspark.py).

The backbone is vllm_dflash.py's DFlash layout (same Qwen3 fields, `dflash_config`, keys, learned-mask row and draft
vocabulary); DSpark adds two heads, written in vLLM's parametrisation of the same functions:

- Markov head. Ours adds W E[x_prev] to the head state, so its logits gain head @ W E[x_prev]; vLLM adds
  `markov_w2 @ markov_w1[x_prev]` to the logits. The two are one map with `markov_w1` = E [V, r] and
  `markov_w2` = head rows @ W [N, r] (N: the draft vocabulary's rows, or the target's V). With a learned mask the
  input vocabulary is V + 1 (vllm_dflash.py): `markov_w1` gets a zero row there (no drafted token is ever V).
- Confidence head. Ours reads z = norm(h) + W E[x_prev] through a [1, D] linear; vLLM reads [norm(h); E[x_prev]]
  (`confidence_head_with_markov`) through a [1, D + r] linear, so its weight is [c; c W] and the bias ours.

vLLM's DSpark speculator samples from the anchor by default (N query rows, the anchor predicting the first token);
ours is DFlash's fill-in block (the anchor is the verified token, masks sit at the drafted positions), which vLLM
runs with `sample_from_anchor: false` and num_speculative_tokens = block_size - 1
(v1/worker/gpu/spec_decode/dspark/speculator.py).

Not on a CPU: that speculator exists only in vLLM's model runner V2, which needs Triton ("Model Runner V2 requires
Triton.", vllm/config/vllm.py; the CPU platform overrides only V1's kernels, platforms/cpu.py), and V1 refuses the
method ("Model Runner V1 does not support: dspark speculative decoding", config/vllm.py
_get_v1_model_runner_unsupported_features). engine-check therefore loads the export instead (engine_heads.py).
An export reads back into draftsmith's decoder (engine_dirs.load_dflash solves W from markov_w2).
"""

from __future__ import annotations

import torch

from drafters.serving.layouts import vllm_dflash
from drafters.serving.layouts.rules import Problem, TargetFacts

ARCH = "Qwen3DSparkModel"
KINDS = ("dspark",)
MARKOV_W1 = "<markov.embed.weight, a zero row for a learned mask>"
MARKOV_W2 = "<the draft head rows x markov.proj.weight>"
CONF_W = "<conf_head.weight, conf_head.weight x markov.proj.weight>"
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
CONF, CONF_BIAS = "confidence_head.proj.weight", "confidence_head.proj.bias"
REQUIRED = (
    *vllm_dflash.REQUIRED,
    "markov_rank",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "sample_from_anchor",
)


def detects(cfg: dict) -> bool:
    return ARCH in (cfg.get("architectures") or [])


def rank_of(meta: dict, t: TargetFacts) -> int:
    """The Markov rank r as the module builds it (capped at the target's hidden size)."""
    return min(int(meta["config"]["markov_rank"]), t.hidden)


def plan(meta: dict, native_keys: list[str], t: TargetFacts, provenance: dict) -> tuple[dict, dict[str, str]]:
    """config.json and {exported key: source} of a native DSpark drafter: DFlash's, plus the two heads."""
    dflash_keys = [k for k in native_keys if not k.startswith(("markov.", "conf_head."))]
    config, sources = vllm_dflash.plan(meta, dflash_keys, t, provenance)
    config["architectures"] = [ARCH]
    provenance["note"] += "; vLLM runs DSpark in its GPU model runner (V2) only"  # config["draftsmith"] is it
    config.update(
        markov_rank=rank_of(meta, t),
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        sample_from_anchor=False,  # the fill-in block: K - 1 drafted positions after the verified anchor
        dspark_bonus_anchor=False,
    )
    sources.update({W1: MARKOV_W1, W2: MARKOV_W2, CONF: CONF_W, CONF_BIAS: "conf_head.bias"})
    return config, sources


capture_ids_hf = vllm_dflash.capture_ids_hf  # the backbone's fields are DFlash's
layer = vllm_dflash.layer


def head_shapes(r: int, vocab_in: int, draft_rows: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The heads' shapes: markov_w1 [input vocabulary, r], markov_w2 [draft rows, r], the confidence [1, D + r]."""
    return {W1: (vocab_in, r), W2: (draft_rows, r), CONF: (1, hidden + r), CONF_BIAS: (1,)}


def expected_shapes(cfg: dict, t: TargetFacts) -> dict[str, tuple[int, ...]]:
    out = vllm_dflash.expected_shapes(cfg, t)
    V, H = cfg.get("vocab_size", 0), cfg.get("hidden_size", 0)
    n = cfg.get("draft_vocab_size") or V
    return {**out, **head_shapes(int(cfg.get("markov_rank") or 0), V, min(n, t.vocab), H)}


def problems(cfg: dict, t: TargetFacts) -> list[Problem]:
    out = vllm_dflash.problems(cfg, t)
    r = cfg.get("markov_rank")
    if not (isinstance(r, int) and 1 <= r <= t.hidden):
        out.append(Problem(f"markov_rank is {r}", f"set it to the Markov head's rank (1..{t.hidden})"))
    if cfg.get("sample_from_anchor") is not False:
        out.append(
            Problem(
                "sample_from_anchor is not false: vLLM would read the block as anchor-first (N rows, the anchor "
                "predicting the first token)",
                "draftsmith's DSpark drafts a fill-in block: set sample_from_anchor to false",
            )
        )
    if cfg.get("confidence_head_with_markov") is not True and cfg.get("enable_confidence_head"):
        out.append(
            Problem(
                "confidence_head_with_markov is not true",
                "draftsmith's confidence head reads the Markov term: set it to true (the weight is [1, D + r])",
            )
        )
    return out


def heads(state: dict[str, torch.Tensor], head_rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """DSpark's Markov and confidence heads in vLLM's form (py), products in float32:
    markov_w1 = E (a zero row for a learned mask), markov_w2 = head rows @ W [N, r], confidence [c, c @ W]."""
    if head_rows is None:
        raise ValueError("exporter bug: the vllm-dspark heads need the target's head rows")
    proj = state["markov.proj.weight"].float()  # W [D, r]
    w1 = state["markov.embed.weight"]
    if "mask_embedding" in state:  # the input vocabulary has the mask's extra row (vllm_dflash.py)
        w1 = torch.cat([w1, w1.new_zeros(1, w1.shape[1])])
    c = state["conf_head.weight"].float()  # [1, D]
    return {MARKOV_W1: w1, MARKOV_W2: head_rows.float() @ proj, CONF_W: torch.cat([c, c @ proj], dim=1)}
