"""The rules every engine layout shares (DESIGN §5): the target's facts, capture ids, the draft vocabulary,
and how a layout's problems are found and told.

Each engine's layout is one file beside this one (sglang_eagle3.py, speculators.py, medusa_vllm.py; the
decoder layer both EAGLE-3 layouts carry is eagle3_layer.py) and formats.py picks one by format name.
Everything here works on plain dicts and shapes, never on weights, so the full-size layouts are computed
(and tested) without a 600M-parameter drafter in memory.

Capture ids (EAGLE-3): draftsmith's ids are HF hidden-state ids. SGLang captures the *input* of decoder
layer i+1 for id i, i.e. the output of layer i: its id is the HF id minus one (draftsmith's 2 is SGLang's
1); vLLM captures the input of layer i for id i, which is the HF convention. No explicit ids serve both
engines, so when the ids are the engines' shared default (2, L//2, L-3) an `eagle3` directory leaves the
field out; otherwise it is written for one engine (recorded in `draftsmith.engine`). Measured in vLLM
0.32 on CPU: ids must ascend (engines concatenate captured states in layer order; the exporter permutes
fc's column blocks to match).

Draft vocabulary: no `d2t`/`t2d` when the draft vocabulary is the whole target vocabulary (vLLM then has
no such parameter and refuses the file).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

TARGET_HEAD = "<target lm_head>"  # source of a key copied from the target's LM head (not in the drafter)
DRAFT_HEAD = "<target lm_head rows of d2t>"  # a draft vocabulary's rows of the target's LM head (block drafters)
TARGET_EMBED = "<target embed_tokens>"  # source of embed_tokens.weight copied from the target (--with-embeddings)
ENGINES = ("sglang", "vllm")  # who reads an `eagle3` directory's explicit capture ids
DRAFT_VOCAB_KEYS = ("d2t", "t2d")
SHARED_EMBEDDING = "embed_tokens.weight"  # some published EAGLE-3 dirs carry a copy; engines use the target's
EMBEDDING_NOTE = (
    "speculators 0.9.0 leaves embed_tokens uninitialised in about half of the loads of a directory "
    "without embed_tokens.weight (vLLM shares the target's either way)"
)


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
    model_type: str | None = None  # the decoder-layer type `draft_layer: target` builds (Qwen3: QK-norm)

    @staticmethod
    def of(cfg: dict, name_or_path: str | None = None) -> TargetFacts:
        """From a config dict (`config.to_dict()` or a raw config.json)."""
        heads = cfg["num_attention_heads"]
        theta, scaling = rope_settings(cfg)
        return TargetFacts(
            name_or_path=name_or_path or cfg.get("_name_or_path") or None,
            architectures=tuple(cfg.get("architectures") or ()),
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            max_positions=cfg.get("max_position_embeddings", 0),
            rope_theta=theta,
            rope_scaling=scaling,
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            bos=cfg.get("bos_token_id"),
            eos=cfg.get("eos_token_id"),
            model_type=cfg.get("model_type"),
        )


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


# --- problems: what is wrong, with its fix ----------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One mismatch: what is wrong, how to fix it, and whether draftsmith's decoder can still load it."""

    what: str
    fix: str
    blocks_import: bool = True

    def __str__(self) -> str:
        return f"{self.what}\n    fix: {self.fix}"


def key_problems(
    shapes: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    where: str,
    optional: frozenset[str] = frozenset(),
) -> list[Problem]:
    """Missing, unexpected and wrong-shape keys, each named."""
    out = [
        Problem(
            f"{where}: key {k} is missing (expected shape {list(expected[k])})",
            "re-export the drafter; a file missing weights cannot be served",
        )
        for k in sorted(set(expected) - set(shapes))
    ]
    out += [
        Problem(
            f"{where}: unexpected key {k} {list(shapes[k])}",
            "remove it: the engine's model has no such parameter (re-export the drafter)",
        )
        for k in sorted(set(shapes) - set(expected) - optional)
    ]
    out += [
        Problem(
            f"{where}: key {k} has shape {list(shapes[k])}, the config implies {list(expected[k])}",
            "the weights and config.json disagree: re-export, or fix the sizes in config.json",
        )
        for k in sorted(set(shapes) & set(expected))
        if tuple(shapes[k]) != tuple(expected[k])
    ]
    return out


def field(cfg: dict, dotted: str):
    """A config field by dotted path (`eagle_config.use_aux_hidden_state`); None when absent."""
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def missing_required(required: tuple[str, ...], cfg: dict) -> list[str]:
    """The fields of `required` (dotted) a config lacks."""
    return [f for f in required if field(cfg, f) is None]


# --- capture ids (EAGLE-3) --------------------------------------------------------------------------


def engine_default_ids(layers: int) -> list[int]:
    """The capture ids SGLang and vLLM both use when a config names none, as HF hidden-state ids."""
    return [2, layers // 2, layers - 3]


def fc_column_order(ids: list[int]) -> list[int] | None:
    """Where each of fc's H-wide input blocks must come from so that the blocks follow ascending capture
    ids (engines concatenate captured states in layer order); None when the ids already ascend."""
    order = sorted(range(len(ids)), key=lambda j: ids[j])
    return None if order == list(range(len(ids))) else order


def ascending_fc(fc: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """fc.weight [H, n*H] with its input blocks reordered to ascending capture ids (the order engines fuse)."""
    order = fc_column_order(ids)
    if order is None:
        return fc
    blocks = fc.chunk(len(ids), dim=1)
    return torch.cat([blocks[j] for j in order], dim=1)


def capture_ids_hf(fmt: str, cfg: dict, layers: int) -> tuple[list[int], bool]:
    """The capture ids of an EAGLE-3 config as HF hidden-state ids, and whether the config names them.

    Absent ids mean each engine's default, (2, L//2, L-3) as HF ids in both SGLang and vLLM. An `eagle3`
    directory's ids are SGLang's unless draftsmith wrote it for vLLM (`draftsmith.engine`).
    """
    if fmt == "eagle3":
        ids = field(cfg, "eagle_config.eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            shift = 0 if eagle3_engine(cfg) == "vllm" else 1  # SGLang id i captures the output of layer i = HF i + 1
            return [int(i) + shift for i in ids], True
    else:
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            return [int(i) for i in ids], True
    return engine_default_ids(layers), False


def recorded_capture_ids(cfg: dict) -> list[int] | None:
    """The HF capture ids draftsmith's exporter recorded in its `draftsmith` block (None: a foreign directory,
    or an export that recorded none). The `eagle3` layout leaves the engines' shared default ids out of the
    engine-read fields, so this record is how a reader tells "trained on the default" from "nobody said"."""
    block = cfg.get("draftsmith")
    if not isinstance(block, dict) or block.get("exported_by") != "draftsmith":
        return None
    ids = block.get("capture_ids_hf")
    return [int(i) for i in ids] if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None


def unnamed_ids_warning(cfg: dict, ids: list[int], explicit: bool) -> str | None:
    """What to tell a user about capture ids a config does not name (`ids` = the engines' default it falls back
    to), or None when there is nothing to tell: the config names them, or our own export records that it left
    out exactly these default ids. A foreign directory that names none may have been trained on other layers,
    and an export whose record disagrees with the default is damaged: both are said, as the engines read the
    default either way."""
    if explicit:
        return None
    recorded = recorded_capture_ids(cfg)
    if recorded == ids:
        return None
    if recorded is not None:
        return (
            f"the config names no capture ids, so engines (and draftsmith) use the default HF ids {ids}, but its "
            f"draftsmith export block records {recorded}: re-export the drafter with draftsmith export"
        )
    return f"the config names no capture ids; using the engines' default HF ids {ids}"


def eagle3_engine(cfg: dict) -> str | None:
    """The engine an `eagle3` directory with explicit capture ids was written for (None: not recorded)."""
    return field(cfg, "draftsmith.engine")


def engine_ids(fmt: str, cfg: dict, ids: list[int]) -> list[int]:
    """HF capture ids as the directory's config writes them."""
    return [i - 1 for i in ids] if fmt == "eagle3" and eagle3_engine(cfg) != "vllm" else list(ids)


def capture_problems(fmt: str, cfg: dict, t: TargetFacts) -> list[Problem]:
    """Capture ids in range, ascending, and (`eagle3` layout) read alike by SGLang and vLLM."""
    ids, explicit = capture_ids_hf(fmt, cfg, t.layers)
    vllm_ids = fmt != "eagle3" or eagle3_engine(cfg) == "vllm"
    lo, hi, conv = (
        (0, t.layers - 1, "vLLM ids = HF hidden-state ids")
        if vllm_ids
        else (-1, t.layers - 2, "SGLang ids = HF hidden-state ids - 1")
    )
    shown = engine_ids(fmt, cfg, ids)
    out = []
    bad = [s for s, i in zip(shown, ids) if not 0 <= i < t.layers]
    if bad:
        out.append(
            Problem(
                f"capture ids {bad} out of range {lo}..{hi} for a {t.layers}-layer target ({conv})",
                "the ids must name layers of this target: was the drafter trained for a deeper model?",
            )
        )
    if explicit and ids != sorted(ids):
        out.append(
            Problem(
                f"capture ids {shown} are not ascending: engines concatenate the captured states in layer "
                f"order, so fc reads them permuted (lossless output, silently lower acceptance)",
                "re-export with draftsmith export (it writes ascending ids and permutes fc's columns to "
                "match); draftsmith's own decoder uses the listed order",
                blocks_import=False,
            )
        )
    if fmt == "eagle3" and explicit and eagle3_engine(cfg) is None and not bad:
        sgl = [i - 1 for i in ids]
        out.append(
            Problem(
                f"eagle_aux_hidden_state_layer_ids {sgl} are read by SGLang as HF hidden-state ids {ids} "
                f"but by vLLM as {sgl}: one of the two captures layers below those trained",
                "for vLLM export --format speculators (or --format eagle3 --engine vllm); keep this "
                "directory for SGLang only; with the default ids (2, L//2, L-3) drop the field and "
                "both engines read it right",
                blocks_import=False,
            )
        )
    return out


# --- the draft vocabulary (EAGLE-3) --------------------------------------------------------------------


def full_draft_vocab(draft_vocab_size: int | None, t: TargetFacts) -> bool:
    """The draft vocabulary is the whole target vocabulary: the layout then carries no d2t/t2d."""
    return draft_vocab_size == t.vocab


def draft_vocab_problems(
    cfg: dict, shapes: dict[str, tuple[int, ...]], t: TargetFacts
) -> tuple[list[Problem], dict[str, tuple[int, ...]]]:
    """d2t/t2d in a full-vocabulary file (vLLM refuses them), and the shapes left to check against the engine."""
    if not (full_draft_vocab(cfg.get("draft_vocab_size"), t) and set(DRAFT_VOCAB_KEYS) & set(shapes)):
        return [], shapes
    found = Problem(
        "d2t/t2d are in the file, but the draft vocabulary is the whole target vocabulary: vLLM "
        "refuses them (\"There is no module or parameter named 'draft_id_to_target_id'\")",
        "delete d2t and t2d from model.safetensors, or re-export with draftsmith export",
        blocks_import=False,
    )
    return [found], {k: v for k, v in shapes.items() if k not in DRAFT_VOCAB_KEYS}
