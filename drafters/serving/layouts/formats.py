"""The export formats by name: which drafter kinds each holds, which one a directory is in, and the calls
that go to the engine's layout file (plan, expected shapes, problems, the exporter's gate).

- `native`: draftsmith's own directory (drafters/serving/checkpoint.py), every drafter kind;
- `eagle3`: SGLang's LlamaForCausalLMEagle3 (sglang_eagle3.py);
- `speculators`: vllm-project/speculators' Eagle3Speculator (speculators.py);
- `medusa-vllm`: vLLM's MedusaModel (medusa_vllm.py);
- `vllm-dflash`: z-lab's DFlash layout, vLLM's DFlashDraftModel (vllm_dflash.py);
- `speculators-dflash`: speculators' DFlash layout, which vLLM converts to the same model (speculators_dflash.py);
- `vllm-dspark`: vLLM's Qwen3DSparkModel, DFlash's layout plus the Markov and confidence heads (vllm_dspark.py).
`plan` gives a layout's config and where each exported key comes from; `expected_shapes` is what an
engine builds from a config; `problems` compares a config + key shapes with the engine's expectations
and the target, each with its fix (rules.py holds what the layouts share).
"""

from __future__ import annotations

from drafters.serving.layouts import (
    medusa_vllm,
    sglang_eagle3,
    speculators,
    speculators_dflash,
    vllm_dflash,
    vllm_dspark,
)
from drafters.serving.layouts.rules import (
    DRAFT_HEAD,
    ENGINES,
    TARGET_EMBED,
    TARGET_HEAD,
    Problem,
    TargetFacts,
    draft_vocab_problems,
    key_problems,
    missing_required,
)

LAYOUTS = {  # detection order
    "eagle3": sglang_eagle3,
    "speculators": speculators,
    "medusa-vllm": medusa_vllm,
    "vllm-dflash": vllm_dflash,
    "speculators-dflash": speculators_dflash,
    "vllm-dspark": vllm_dspark,
}
NATIVE_KINDS = ("eagle1", "eagle3", "medusa", "layerskip", "dflash", "dspark")
FORMATS = {"native": NATIVE_KINDS, **{f: m.KINDS for f, m in LAYOUTS.items()}}
# The block-drafter layouts (capture ids ascending, fc permuted like EAGLE-3's).
BLOCK_LAYOUTS = {"vllm-dflash": vllm_dflash, "speculators-dflash": speculators_dflash, "vllm-dspark": vllm_dspark}
# Why a kind has no engine layout beside native, where that is not plain (said with the refusal).
NO_LAYOUT = {
    "dspark": "a DFlash layout would drop the Markov and confidence heads, changing every draft; vLLM's own DSpark "
    "layout is vllm-dspark"
}
# The EAGLE-3 layouts, and the key prefix of the decoder layer each carries.
LAYER_PREFIX = {"eagle3": sglang_eagle3.LAYER_PREFIX, "speculators": speculators.LAYER_PREFIX}


def detect_format(cfg: dict) -> str | None:
    """Which layout a drafter directory's config.json is in (None: none draftsmith knows)."""
    if "draftsmith_drafter" in cfg:
        return "native"
    return next((fmt for fmt, layout in LAYOUTS.items() if layout.detects(cfg)), None)


def check_fits(fmt: str, kind: str) -> None:
    """A clear error when a drafter kind has no such export format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; one of {sorted(FORMATS)}")
    if kind not in FORMATS[fmt]:
        fits = sorted(f for f, kinds in FORMATS.items() if kind in kinds)
        why = f" ({NO_LAYOUT[kind]})" if kind in NO_LAYOUT else ""
        raise ValueError(
            f"format {fmt!r} does not fit a {kind} drafter (it is for {'/'.join(FORMATS[fmt])} "
            f"drafters); a {kind} drafter exports as: {', '.join(fits)}{why}"
        )


def plan(
    fmt: str,
    meta: dict,
    native_keys: list[str],
    t: TargetFacts,
    speculative_tokens: int = 0,
    shared_head_once: bool = False,
    engine: str = "sglang",
    with_embeddings: bool = False,
) -> tuple[dict, dict[str, str]]:
    """config.json and {exported key: native key, TARGET_HEAD or TARGET_EMBED} of a native drafter (meta = its
    config.json). The config lists capture ids ascending: the exporter permutes fc by `fc_column_order`.

    speculative_tokens: the speculators proposal length (0 = the drafter's training-time-test depth);
    shared_head_once: Medusa with the target's head: write it once with vLLM's `original_lm_head`
    instead of one copy per head; engine: who reads an `eagle3` directory's explicit (non-default) capture
    ids, sglang (HF id - 1) or vllm (HF ids); with_embeddings: EAGLE-3 layouts also carry the target's
    embedding (EMBEDDING_NOTE; the size of the target's vocabulary x hidden).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} not one of {', '.join(ENGINES)}")
    kind = meta["draftsmith_drafter"]
    check_fits(fmt, kind)
    if fmt == "native":
        return dict(meta), {k: k for k in native_keys}
    provenance = {"exported_by": "draftsmith", "drafter": kind, "target": t.name_or_path}
    if fmt == "eagle3":
        return sglang_eagle3.plan(meta, native_keys, t, provenance, engine, with_embeddings)
    if fmt == "speculators":
        return speculators.plan(meta, native_keys, t, provenance, speculative_tokens, with_embeddings)
    if fmt in BLOCK_LAYOUTS:
        why = vllm_dflash.unfit(meta, speculative_tokens)
        if why:
            raise ValueError(f"cannot write a {fmt} export: {why}")
        return BLOCK_LAYOUTS[fmt].plan(meta, native_keys, t, provenance)
    return medusa_vllm.plan(meta, native_keys, t, provenance, shared_head_once)


def planned_shapes(
    sources: dict[str, str], native: dict[str, tuple[int, ...]], t: TargetFacts
) -> dict[str, tuple[int, ...]]:
    """Shapes of a planned export: each key's native source, the target's LM head / embedding [V, H], the
    embedding with a learned mask row [V + 1, H], or a DSpark head in vLLM's form (vllm_dspark.py)."""
    rows = {TARGET_HEAD: t.vocab, TARGET_EMBED: t.vocab, vllm_dflash.MASK_ROWS: t.vocab + 1}
    if "d2t" in native:  # a draft vocabulary's head rows (vllm_dflash.py)
        rows[DRAFT_HEAD] = native["d2t"][0]
    derived = {}
    if "markov.embed.weight" in native:
        vocab_in = t.vocab + 1 if "mask_embedding" in native else t.vocab
        r = native["markov.embed.weight"][1]
        heads = vllm_dspark.head_shapes(r, vocab_in, rows.get(DRAFT_HEAD, t.vocab), t.hidden)
        derived = {vllm_dspark.MARKOV_W1: heads[vllm_dspark.W1], vllm_dspark.MARKOV_W2: heads[vllm_dspark.W2]}
        derived[vllm_dspark.CONF_W] = heads[vllm_dspark.CONF]
    return {
        k: (rows[s], t.hidden) if s in rows else derived[s] if s in derived else tuple(native[s])
        for k, s in sources.items()
    }


def expected_shapes(fmt: str, cfg: dict, t: TargetFacts | None = None) -> dict[str, tuple[int, ...]]:
    """{key: shape} an engine's model for this config loads on target t (missing config fields read as 0)."""
    if fmt not in LAYOUTS:
        raise ValueError(f"no engine layout for format {fmt!r}")
    if fmt in BLOCK_LAYOUTS:  # the target's vocabulary tells a learned mask row and a draft vocabulary apart
        if t is None:
            raise ValueError(f"the {fmt} shapes depend on the target's vocabulary: pass its TargetFacts")
        return LAYOUTS[fmt].expected_shapes(cfg, t)
    return LAYOUTS[fmt].expected_shapes(cfg)


def problems(
    fmt: str, cfg: dict, shapes: dict[str, tuple[int, ...]], t: TargetFacts, optional: frozenset[str] = frozenset()
) -> list[Problem]:
    """Every problem of an engine-layout drafter (config + key shapes) on target t."""
    found = LAYOUTS[fmt].problems(cfg, t)
    if fmt in LAYER_PREFIX:
        vocab, shapes = draft_vocab_problems(cfg, shapes, t)
        found += vocab
    return found + key_problems(shapes, expected_shapes(fmt, cfg, t), "model.safetensors", optional)


def check_export(
    fmt: str, cfg: dict, shapes: dict[str, tuple[int, ...]], t: TargetFacts, optional: frozenset[str] = frozenset()
) -> None:
    """The exporter's gate: required fields present, exact key set and shapes, no mismatch with the target
    (`optional`: keys allowed besides the engine's, e.g. the embedding --with-embeddings adds)."""
    found = [
        Problem(f"config.json lacks {f}", "exporter bug: the engine needs this field")
        for f in missing_required(LAYOUTS[fmt].REQUIRED, cfg)
    ]
    found += problems(fmt, cfg, shapes, t, optional)
    if found:
        raise ValueError(f"refusing to write a {fmt} export:\n  " + "\n  ".join(map(str, found)))
