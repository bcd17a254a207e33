"""Serving-engine layouts of a trained drafter (DESIGN §5): configs, key sets, and the checks on them.

Three layouts besides the native one:
- `eagle3`: SGLang's `LlamaForCausalLMEagle3` (the layout EAGLE-3's own release uses): keys `midlayer.*`,
  `fc`, `norm`, `lm_head`, `d2t`, `t2d`; capture ids in `eagle_config.eagle_aux_hidden_state_layer_ids`
  in SGLang's convention. SGLang captures the *input* of decoder layer i+1 for id i, i.e. the output of
  layer i: its id is the HF hidden-state id minus one (draftsmith's capture id 2 is SGLang's 1). vLLM
  loads the same layout but reads that field as HF ids, so no explicit ids serve both engines: when the
  ids are the engines' shared default (2, L//2, L-3) the field is left out (both capture the right
  layers); otherwise the directory is written for one engine (`engine`, recorded in `draftsmith.engine`).
- `speculators`: vllm-project/speculators' `Eagle3Speculator`: the same tensors with the layer under
  `layers.0.`, its sizes in `transformer_layer_config`; capture ids top-level in vLLM's convention, which
  is the HF one (vLLM captures the input of layer i for id i).
- `medusa-vllm`: vLLM's `MedusaModel`: `blocks.{k}.layers.{l}.weight|bias`, `lm_heads.{k}.weight`.

Rules every EAGLE-3 layout follows (measured in vLLM 0.32 on CPU): capture ids ascending (engines
concatenate captured states in layer order; the exporter permutes fc's column blocks to match), and no
`d2t`/`t2d` when the draft vocabulary is the whole target vocabulary (vLLM then has no such parameter and
refuses the file).

Everything here works on plain dicts and shapes, never on weights, so the full-size layouts are
computed (and tested) without a 600M-parameter drafter in memory: `plan` gives the config and where
each exported key comes from; `expected_shapes` is what an engine builds from that config; `problems`
compares a config + key shapes with the engine's expectations and the target, each with its fix.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

EAGLE3_ARCH = "LlamaForCausalLMEagle3"
SPECULATORS_ARCH = "Eagle3Speculator"
MEDUSA_ARCH = "MedusaModel"
FORMATS = {"native": ("eagle1", "eagle3", "medusa", "layerskip"), "eagle3": ("eagle3",),
           "speculators": ("eagle3",), "medusa-vllm": ("medusa",)}
TARGET_HEAD = "<target lm_head>"  # source of a key copied from the target's LM head (not in the drafter)
TARGET_EMBED = "<target embed_tokens>"  # source of embed_tokens.weight copied from the target (--with-embeddings)
ENGINES = ("sglang", "vllm")  # who reads an `eagle3` directory's explicit capture ids
DRAFT_VOCAB_KEYS = ("d2t", "t2d")
LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")
LAYER_PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}
SHARED_EMBEDDING = "embed_tokens.weight"  # some published EAGLE-3 dirs carry a copy; engines use the target's
EMBEDDING_NOTE = ("speculators 0.9.0 leaves embed_tokens uninitialised in about half of the loads of a directory "
                  "without embed_tokens.weight (vLLM shares the target's either way)")


@dataclass(frozen=True)
class TargetFacts:
    """What a drafter layout depends on in the target's config.json."""

    name_or_path: str | None
    architectures: tuple[str, ...]
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    rope_theta: float
    rope_scaling: dict | None
    eps: float
    bos: int | None
    eos: int | list[int] | None

    @staticmethod
    def of(cfg: dict, name_or_path: str | None = None) -> TargetFacts:
        """From a config dict (`config.to_dict()` or a raw config.json)."""
        heads = cfg["num_attention_heads"]
        theta, scaling = rope_settings(cfg)
        return TargetFacts(
            name_or_path=name_or_path or cfg.get("_name_or_path") or None,
            architectures=tuple(cfg.get("architectures") or ()), hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"], heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"], max_positions=cfg.get("max_position_embeddings", 0), rope_theta=theta,
            rope_scaling=scaling, eps=float(cfg.get("rms_norm_eps", 1e-6)), bos=cfg.get("bos_token_id"),
            eos=cfg.get("eos_token_id"))


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope theta, scaling dict or None for plain rope) from old (`rope_theta`, `rope_scaling`) or new
    (`rope_parameters`) config keys; the scaling dict is keyed `rope_type` like transformers writes it."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in params:
        params["rope_type"] = params.pop("type")
    return theta, (params if params.get("rope_type", "default") != "default" else None)


def tokenizer_digest(tok) -> str | None:
    """Identity of a tokenizer's vocabulary and special ids (None without a tokenizer, or for the empty one
    transformers builds for a directory without tokenizer files)."""
    if tok is None or len(tok.get_vocab()) <= 1:
        return None
    blob = json.dumps({"vocab": sorted(tok.get_vocab().items()), "bos": tok.bos_token_id, "eos": tok.eos_token_id})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def detect_format(cfg: dict) -> str | None:
    """Which layout a drafter directory's config.json is in (None: none draftsmith knows)."""
    archs = cfg.get("architectures") or []
    if "draftsmith_drafter" in cfg:
        return "native"
    if EAGLE3_ARCH in archs:
        return "eagle3"
    if cfg.get("speculators_model_type") == "eagle3" or SPECULATORS_ARCH in archs:
        return "speculators"
    if cfg.get("model_type") == "medusa" or MEDUSA_ARCH in archs:
        return "medusa-vllm"
    return None


def check_fits(fmt: str, kind: str) -> None:
    """A clear error when a drafter kind has no such export format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; one of {sorted(FORMATS)}")
    if kind not in FORMATS[fmt]:
        fits = sorted(f for f, kinds in FORMATS.items() if kind in kinds)
        raise ValueError(f"format {fmt!r} does not fit a {kind} drafter (it is for {'/'.join(FORMATS[fmt])} "
                         f"drafters); a {kind} drafter exports as: {', '.join(fits)}")


# --- planning an export: config + key sources ----------------------------------------------------------

def layer_config(meta: dict, t: TargetFacts) -> dict:
    """The Llama decoder-layer config of an EAGLE-3 drafter on target t (the target's attention and rope)."""
    return {"model_type": "llama", "hidden_size": t.hidden,
            "intermediate_size": meta["config"].get("intermediate_size") or t.intermediate,
            "num_hidden_layers": 1, "num_attention_heads": t.heads, "num_key_value_heads": t.kv_heads,
            "head_dim": t.head_dim, "hidden_act": "silu", "max_position_embeddings": t.max_positions,
            "rms_norm_eps": t.eps, "rope_theta": t.rope_theta, "rope_scaling": t.rope_scaling,
            "vocab_size": t.vocab, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": t.bos, "eos_token_id": t.eos}


def engine_default_ids(layers: int) -> list[int]:
    """The capture ids SGLang and vLLM both use when a config names none, as HF hidden-state ids."""
    return [2, layers // 2, layers - 3]


def fc_column_order(ids: list[int]) -> list[int] | None:
    """Where each of fc's H-wide input blocks must come from so that the blocks follow ascending capture
    ids (engines concatenate captured states in layer order); None when the ids already ascend."""
    order = sorted(range(len(ids)), key=lambda j: ids[j])
    return None if order == list(range(len(ids))) else order


def plan(fmt: str, meta: dict, native_keys: list[str], t: TargetFacts, speculative_tokens: int = 0,
         shared_head_once: bool = False, engine: str = "sglang",
         with_embeddings: bool = False) -> tuple[dict, dict[str, str]]:
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
    provenance = {"exported_by": "draftsmith", "drafter": kind, "target": t.name_or_path}
    if fmt == "native":
        return dict(meta), {k: k for k in native_keys}
    if fmt in LAYER_PREFIX:
        ids = sorted(int(i) for i in meta["capture_ids"])
        prefix = LAYER_PREFIX[fmt]
        full_vocab = meta["draft_vocab_size"] == t.vocab  # vLLM has no d2t/t2d parameter then, and refuses them
        sources = {k.replace("midlayer.", prefix, 1): k for k in native_keys
                   if not (full_vocab and k in DRAFT_VOCAB_KEYS)}
        if with_embeddings:
            sources[SHARED_EMBEDDING] = TARGET_EMBED
        layer = layer_config(meta, t)
        provenance["capture_ids_hf"] = ids
        if fmt == "eagle3":
            eagle = {"use_aux_hidden_state": True}
            if ids == engine_default_ids(t.layers):
                provenance["note"] = ("no eagle_aux_hidden_state_layer_ids: the ids are SGLang's and vLLM's shared "
                                      "default, which both read right")
            else:  # SGLang reads id i as the output of layer i (HF id - 1), vLLM as HF id i
                provenance["engine"] = engine
                provenance["note"] = (f"eagle_aux_hidden_state_layer_ids are {engine}'s "
                                      f"({'HF ids - 1' if engine == 'sglang' else 'HF ids'}): this directory "
                                      f"captures the trained layers in {engine} only")
                eagle["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids] if engine == "sglang" else ids
            config = {"architectures": [EAGLE3_ARCH], **layer, "draft_vocab_size": meta["draft_vocab_size"],
                      "eagle_config": eagle, "draftsmith": provenance}
            return config, sources
        k = speculative_tokens or meta["config"].get("ttt_steps") or 3
        config = {"architectures": [SPECULATORS_ARCH], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer, "draft_vocab_size": meta["draft_vocab_size"],
                  "norm_before_residual": False, "target_hidden_size": None,
                  "eagle_aux_hidden_state_layer_ids": ids,
                  "speculators_config": {
                      "algorithm": "eagle3", "default_proposal_method": "greedy",
                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k),
                                            "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                      "verifier": {"name_or_path": t.name_or_path, "architectures": list(t.architectures)}},
                  "draftsmith": provenance}
        return config, sources
    # medusa-vllm: the ResBlocks as they are; vLLM always reads a vocabulary head per Medusa head
    c = meta["config"]
    heads, per_head = c["num_heads"], c.get("per_head_vocab", False)
    sources = {k: k for k in native_keys}
    once = shared_head_once and not per_head
    if not per_head:  # the target's frozen head: copies (or one, with original_lm_head)
        sources.update({f"lm_heads.{k}.weight": TARGET_HEAD for k in range(1 if once else heads)})
        provenance["note"] = ("lm_heads.0.weight is the target's LM head; original_lm_head shares it across heads"
                              if once else "every lm_heads.{k}.weight is a copy of the target's LM head")
    config = {"architectures": [MEDUSA_ARCH], "model_type": "medusa", "hidden_size": t.hidden,
              "vocab_size": t.vocab, "num_heads": heads, "num_hidden_layers": c.get("num_layers", 1),
              "medusa_fc_bias": True, "truncated_vocab_size": t.vocab, "max_paths": 64, "topk": 10,
              "draftsmith": provenance}
    if once:
        config["original_lm_head"] = True
    return config, sources


def planned_shapes(sources: dict[str, str], native: dict[str, tuple[int, ...]], t: TargetFacts) -> dict[str, tuple[int, ...]]:
    """Shapes of a planned export: each key's native source, or the target's LM head / embedding [V, H]."""
    return {k: (t.vocab, t.hidden) if s in (TARGET_HEAD, TARGET_EMBED) else tuple(native[s])
            for k, s in sources.items()}


# --- what an engine builds from a config ------------------------------------------------------------

def expected_shapes(fmt: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """{key: shape} an engine's model for this config loads (missing config fields read as 0)."""
    if fmt in LAYER_PREFIX:
        layer = cfg if fmt == "eagle3" else cfg.get("transformer_layer_config") or {}
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if fmt == "eagle3" \
            else cfg.get("eagle_aux_hidden_state_layer_ids")
        H, V = layer.get("hidden_size", 0), layer.get("vocab_size", 0)
        heads = layer.get("num_attention_heads", 0)
        d = layer.get("head_dim") or (H // heads if heads else 0)
        q, kv, inter = heads * d, (layer.get("num_key_value_heads") or heads) * d, layer.get("intermediate_size", 0)
        n = cfg.get("draft_vocab_size") or V
        p = LAYER_PREFIX[fmt]
        shapes = {"self_attn.q_proj.weight": (q, 2 * H), "self_attn.k_proj.weight": (kv, 2 * H),
                  "self_attn.v_proj.weight": (kv, 2 * H), "self_attn.o_proj.weight": (H, q),
                  "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H),
                  "mlp.down_proj.weight": (H, inter), "input_layernorm.weight": (H,), "hidden_norm.weight": (H,),
                  "post_attention_layernorm.weight": (H,)}
        out = {p + k: v for k, v in shapes.items()}
        out.update({"fc.weight": (H, len(ids or (0, 0, 0)) * H), "norm.weight": (H,), "lm_head.weight": (n, H)})
        if n != V:  # a full draft vocabulary has no mapping (vLLM refuses one)
            out.update({"d2t": (n,), "t2d": (V,)})
        return out
    if fmt == "medusa-vllm":
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
    raise ValueError(f"no engine layout for format {fmt!r}")


@dataclass(frozen=True)
class Problem:
    """One mismatch: what is wrong, how to fix it, and whether draftsmith's decoder can still load it."""

    what: str
    fix: str
    blocks_import: bool = True

    def __str__(self) -> str:
        return f"{self.what}\n    fix: {self.fix}"


def key_problems(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str,
                 optional: frozenset[str] = frozenset()) -> list[Problem]:
    """Missing, unexpected and wrong-shape keys, each named."""
    out = [Problem(f"{where}: key {k} is missing (expected shape {list(expected[k])})",
                   "re-export the drafter; a file missing weights cannot be served")
           for k in sorted(set(expected) - set(shapes))]
    out += [Problem(f"{where}: unexpected key {k} {list(shapes[k])}",
                    "remove it: the engine's model has no such parameter (re-export the drafter)")
            for k in sorted(set(shapes) - set(expected) - optional)]
    out += [Problem(f"{where}: key {k} has shape {list(shapes[k])}, the config implies {list(expected[k])}",
                    "the weights and config.json disagree: re-export, or fix the sizes in config.json")
            for k in sorted(set(shapes) & set(expected)) if tuple(shapes[k]) != tuple(expected[k])]
    return out


# --- checking a layout against its engine and the target --------------------------------------------

_LAYER_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                 "rope_theta", "vocab_size", "tie_word_embeddings")
# Config fields each exporter must write (dotted = nested); the engines read these to build the model.
REQUIRED = {
    "eagle3": ("architectures", *_LAYER_FIELDS, "draft_vocab_size", "eagle_config.use_aux_hidden_state"),
    "speculators": ("architectures", "speculators_model_type", "draft_vocab_size", "norm_before_residual",
                    "eagle_aux_hidden_state_layer_ids", "speculators_config.algorithm",
                    "speculators_config.default_proposal_method", "speculators_config.proposal_methods",
                    "speculators_config.verifier.name_or_path", "speculators_config.verifier.architectures",
                    *(f"transformer_layer_config.{f}" for f in _LAYER_FIELDS)),
    "medusa-vllm": ("architectures", "model_type", "hidden_size", "vocab_size", "num_heads", "num_hidden_layers",
                    "medusa_fc_bias", "truncated_vocab_size"),
}


def _get(cfg: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def missing_required(fmt: str, cfg: dict) -> list[str]:
    return [f for f in REQUIRED.get(fmt, ()) if _get(cfg, f) is None]


def capture_ids_hf(fmt: str, cfg: dict, layers: int) -> tuple[list[int], bool]:
    """The capture ids of an EAGLE-3 config as HF hidden-state ids, and whether the config names them.

    Absent ids mean each engine's default, (2, L//2, L-3) as HF ids in both SGLang and vLLM. An `eagle3`
    directory's ids are SGLang's unless draftsmith wrote it for vLLM (`draftsmith.engine`).
    """
    if fmt == "eagle3":
        ids = _get(cfg, "eagle_config.eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            shift = 0 if eagle3_engine(cfg) == "vllm" else 1  # SGLang id i captures the output of layer i = HF i + 1
            return [int(i) + shift for i in ids], True
    else:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            return [int(i) for i in ids], True
    return [2, layers // 2, layers - 3], False


def eagle3_engine(cfg: dict) -> str | None:
    """The engine an `eagle3` directory with explicit capture ids was written for (None: not recorded)."""
    return _get(cfg, "draftsmith.engine")


def engine_ids(fmt: str, cfg: dict, ids: list[int]) -> list[int]:
    """HF capture ids as the directory's config writes them."""
    return [i - 1 for i in ids] if fmt == "eagle3" and eagle3_engine(cfg) != "vllm" else list(ids)


def capture_problems(fmt: str, cfg: dict, t: TargetFacts) -> list[Problem]:
    """Capture ids in range, ascending, and (`eagle3` layout) read alike by SGLang and vLLM."""
    ids, explicit = capture_ids_hf(fmt, cfg, t.layers)
    vllm_ids = fmt != "eagle3" or eagle3_engine(cfg) == "vllm"
    lo, hi, conv = (0, t.layers - 1, "vLLM ids = HF hidden-state ids") if vllm_ids \
        else (-1, t.layers - 2, "SGLang ids = HF hidden-state ids - 1")
    shown = engine_ids(fmt, cfg, ids)
    out = []
    bad = [s for s, i in zip(shown, ids) if not 0 <= i < t.layers]
    if bad:
        out.append(Problem(f"capture ids {bad} out of range {lo}..{hi} for a {t.layers}-layer target ({conv})",
                           "the ids must name layers of this target: was the drafter trained for a deeper model?"))
    if explicit and ids != sorted(ids):
        out.append(Problem(f"capture ids {shown} are not ascending: engines concatenate the captured states in layer "
                           f"order, so fc reads them permuted (lossless output, silently lower acceptance)",
                           "re-export with draftsmith export (it writes ascending ids and permutes fc's columns to "
                           "match); draftsmith's own decoder uses the listed order", blocks_import=False))
    if fmt == "eagle3" and explicit and eagle3_engine(cfg) is None and not bad:
        sgl = [i - 1 for i in ids]
        out.append(Problem(f"eagle_aux_hidden_state_layer_ids {sgl} are read by SGLang as HF hidden-state ids {ids} "
                           f"but by vLLM as {sgl}: one of the two captures layers below those trained",
                           "for vLLM export --format speculators (or --format eagle3 --engine vllm); keep this "
                           "directory for SGLang only; with the default ids (2, L//2, L-3) drop the field and "
                           "both engines read it right", blocks_import=False))
    return out


def eagle3_problems(fmt: str, cfg: dict, t: TargetFacts) -> list[Problem]:
    """An EAGLE-3 config (SGLang or speculators layout) against the target and draftsmith's decoder."""
    out: list[Problem] = []

    def need(ok: bool, what: str, fix: str, blocks: bool = True) -> None:
        if not ok:
            out.append(Problem(what, fix, blocks))

    layer = cfg if fmt == "eagle3" else cfg.get("transformer_layer_config") or {}
    where = "" if fmt == "eagle3" else "transformer_layer_config."
    arch = EAGLE3_ARCH if fmt == "eagle3" else SPECULATORS_ARCH
    need(arch in (cfg.get("architectures") or []), f"architectures is {cfg.get('architectures')}, not [{arch!r}]",
         f'set "architectures": ["{arch}"] so the engine picks its EAGLE-3 model')
    H, V = layer.get("hidden_size"), layer.get("vocab_size")
    need(H == t.hidden, f"{where}hidden_size is {H}, the target's is {t.hidden}",
         "this drafter reads another model's hidden states: use the target it was trained for")
    need(V == t.vocab, f"{where}vocab_size is {V}, the target's is {t.vocab}",
         "d2t/t2d map into another vocabulary: use the target (and tokenizer) it was trained for")
    n = cfg.get("draft_vocab_size")
    need(isinstance(n, int) and 1 <= n <= t.vocab, f"draft_vocab_size is {n}, not in 1..{t.vocab}",
         "set draft_vocab_size to the rows of lm_head.weight")
    need(layer.get("num_hidden_layers") == 1, f"{where}num_hidden_layers is {layer.get('num_hidden_layers')}",
         "draftsmith decodes one-layer EAGLE-3 drafters (set 1 if the weights have one midlayer)")
    heads = layer.get("num_attention_heads")
    head_dim = layer.get("head_dim") or (H // heads if H and heads else None)
    need(head_dim == t.head_dim, f"{where}head_dim is {head_dim}, the target's is {t.head_dim}",
         f"set head_dim to {t.head_dim} if the weights were trained with it; draftsmith's decoder runs the "
         "draft layer on the target's rotary embedding, so other head dims cannot be evaluated here")
    for field, want in (("num_attention_heads", t.heads), ("num_key_value_heads", t.kv_heads)):
        got = layer.get(field) if field == "num_attention_heads" else layer.get(field) or heads
        need(got == want, f"{where}{field} is {got}, the target's is {want}",
             f"set {field} to {want} if that is what the weights hold; draftsmith builds the draft layer with "
             "the target's attention shapes")
    theta, scaling = rope_settings(layer)
    need(theta == t.rope_theta, f"{where}rope_theta is {theta:g}, the target's is {t.rope_theta:g}",
         f"set rope_theta to {t.rope_theta:g}: the drafter must rotate positions as the target does")
    need(scaling == t.rope_scaling, f"{where}rope_scaling is {scaling}, the target's is {t.rope_scaling}",
         f"set rope_scaling to {json.dumps(t.rope_scaling)}")
    need(layer.get("max_position_embeddings") == t.max_positions,
         f"{where}max_position_embeddings is {layer.get('max_position_embeddings')}, the target's is {t.max_positions}",
         f"set max_position_embeddings to {t.max_positions} (engines cap the draft's context at this value)",
         blocks=False)
    need(not layer.get("tie_word_embeddings", False), f"{where}tie_word_embeddings is true",
         "set it to false: with tied embeddings SGLang uses the embedding as the draft LM head, not lm_head.weight")
    need(layer.get("hidden_act", "silu") == "silu", f"{where}hidden_act is {layer.get('hidden_act')}",
         "EAGLE-3's draft layer is a SwiGLU (silu) Llama layer")
    need(cfg.get("target_hidden_size") in (None, t.hidden), f"target_hidden_size is {cfg.get('target_hidden_size')}",
         "draftsmith supports drafters as wide as the target (target_hidden_size null)")
    out += capture_problems(fmt, cfg, t)
    if fmt == "speculators":
        need(cfg.get("norm_before_residual") is False, f"norm_before_residual is {cfg.get('norm_before_residual')}",
             "draftsmith's draft layer keeps the un-normed state as the residual: norm_before_residual false "
             "(vLLM assumes true when the field is absent)")
        need(_get(cfg, "speculators_config.algorithm") == "eagle3", "speculators_config.algorithm is not eagle3",
             'set speculators_config.algorithm to "eagle3"')
    return out


def medusa_problems(cfg: dict, t: TargetFacts) -> list[Problem]:
    out = []
    if not (isinstance(cfg.get("num_heads"), int) and cfg["num_heads"] >= 1):
        out.append(Problem(f"num_heads is {cfg.get('num_heads')}", "set num_heads to the number of Medusa heads"))
    if cfg.get("hidden_size") != t.hidden:
        out.append(Problem(f"hidden_size is {cfg.get('hidden_size')}, the target's is {t.hidden}",
                           "these heads read another model's hidden states: use the target they were trained for"))
    if cfg.get("vocab_size") != t.vocab:
        out.append(Problem(f"vocab_size is {cfg.get('vocab_size')}, the target's is {t.vocab}",
                           "use the target (and tokenizer) the heads were trained for"))
    if cfg.get("truncated_vocab_size", t.vocab) != cfg.get("vocab_size"):
        out.append(Problem("truncated_vocab_size differs from vocab_size",
                           "draftsmith writes full-vocabulary Medusa heads (no token_map)"))
    return out


def problems(fmt: str, cfg: dict, shapes: dict[str, tuple[int, ...]], t: TargetFacts,
             optional: frozenset[str] = frozenset()) -> list[Problem]:
    """Every problem of an engine-layout drafter (config + key shapes) on target t."""
    found = eagle3_problems(fmt, cfg, t) if fmt in LAYER_PREFIX else medusa_problems(cfg, t)
    if fmt in LAYER_PREFIX and cfg.get("draft_vocab_size") == t.vocab and set(DRAFT_VOCAB_KEYS) & set(shapes):
        found.append(Problem("d2t/t2d are in the file, but the draft vocabulary is the whole target vocabulary: vLLM "
                             "refuses them (\"There is no module or parameter named 'draft_id_to_target_id'\")",
                             "delete d2t and t2d from model.safetensors, or re-export with draftsmith export",
                             blocks_import=False))
        shapes = {k: v for k, v in shapes.items() if k not in DRAFT_VOCAB_KEYS}
    return found + key_problems(shapes, expected_shapes(fmt, cfg), "model.safetensors", optional)


def check_export(fmt: str, cfg: dict, shapes: dict[str, tuple[int, ...]], t: TargetFacts,
                 optional: frozenset[str] = frozenset()) -> None:
    """The exporter's gate: required fields present, exact key set and shapes, no mismatch with the target
    (`optional`: keys allowed besides the engine's, e.g. the embedding --with-embeddings adds)."""
    missing = missing_required(fmt, cfg)
    found = [Problem(f"config.json lacks {f}", "exporter bug: the engine needs this field") for f in missing]
    found += problems(fmt, cfg, shapes, t, optional)
    if found:
        raise ValueError(f"refusing to write a {fmt} export:\n  " + "\n  ".join(map(str, found)))
