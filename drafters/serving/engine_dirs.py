"""Import: drafter directories in serving-engine layouts -> draftsmith modules on a target (DESIGN §5).

- EAGLE-3 in SGLang's layout (`LlamaForCausalLMEagle3`, the layout of EAGLE-3's own releases) or the
  speculators layout (`Eagle3Speculator`) -> drafters.trainable.eagle3.Eagle3, so published EAGLE-3 drafters can be
  evaluated with `--drafter DIR`;
- Medusa in vLLM's layout (`MedusaModel`) -> drafters.trainable.medusa.Medusa;
- DFlash in z-lab's / vLLM's layout (`DFlashDraftModel`) or the speculators one -> drafters.trainable.dflash.DFlash
  (QK-norm layers: the only kind vLLM builds), a learned mask read back from its extra embedding row.
Weights are read from safetensors only (a pickled pytorch_model.bin is refused with a fix). Every
problem that would change what the drafter computes here — another hidden size, vocabulary, attention
shape, rope, capture ids out of range, wrong or missing tensors — is an error naming it; problems that
only matter to an engine (max_position_embeddings) are printed as warnings.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import Tensor

from decode.errors import load_safetensors, read_json
from decode.target import Target
from drafters.serving.checkpoint import in_target_dtype, load_drafter, read_meta
from drafters.serving.layouts import vllm_dspark
from drafters.serving.layouts.formats import BLOCK_LAYOUTS, LAYER_PREFIX, LAYOUTS, detect_format, problems
from drafters.serving.layouts.rules import SHARED_EMBEDDING, TargetFacts, capture_ids_hf, unnamed_ids_warning
from drafters.serving.layouts.vllm_dflash import EMBED


def read_config(path: Path) -> dict | None:
    p = path / "config.json"
    return read_json(p, "the drafter's config.json is damaged: download or export it again") if p.is_file() else None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory (one file or an indexed set); refuses pickles."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        raw = read_json(index, "download or export the drafter again")
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object; download or export the drafter again")
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    if pickles:
        raise ValueError(
            f"{path} holds only {pickles} (pickles): draftsmith never unpickles a checkpoint. Convert "
            'it once, where you trust the file: python -c "import torch; from safetensors.torch import '
            f"save_file; save_file(torch.load('{pickles[0]}', weights_only=True), 'model.safetensors')\""
        )
    raise FileNotFoundError(f"{path}: no model.safetensors")


def read_tensors(path: Path) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for f in weight_files(path):
        out.update(
            load_safetensors(
                f, "the drafter's weights are damaged (an interrupted download?): download or export them again"
            )
        )
    return out


def target_facts(target: Target) -> TargetFacts:
    """The target's config facts, its vocabulary being the LM head's rows."""
    return TargetFacts.of(
        {**target.config.to_dict(), "vocab_size": target.vocab_size}, getattr(target, "name_or_path", None)
    )


def refuse_problems(path: Path, fmt: str, cfg: dict, tensors: dict[str, Tensor], target: Target) -> None:
    """Raise on problems that change what the drafter computes here; warn about engine-only ones."""
    optional = frozenset({SHARED_EMBEDDING} if fmt in LAYER_PREFIX else ())  # ignored: engines share the target's
    found = problems(fmt, cfg, {k: tuple(v.shape) for k, v in tensors.items()}, target_facts(target), optional)
    blocking = [p for p in found if p.blocks_import]
    if blocking:
        raise ValueError(
            f"{path}: this {fmt} drafter does not fit the target:\n  "
            + "\n  ".join(map(str, blocking))
            + "\n(`draftsmith doctor DIR --target MODEL` lists every problem)"
        )
    for p in found:
        print(f"[{path}] warning: {p.what} ({p.fix})", file=sys.stderr)


def draft_vocab(d2t: Tensor, t2d: Tensor, vocab: int, path: Path) -> None:
    """d2t/t2d must describe the same set of target ids, each in range and distinct."""
    ids = torch.arange(d2t.numel()) + d2t.long()
    ok = (
        ids.min() >= 0
        and ids.max() < vocab
        and ids.unique().numel() == ids.numel()
        and int(t2d.bool().sum()) == ids.numel()
        and bool(t2d.bool()[ids.clamp(0, vocab - 1)].all())
    )
    if not ok:
        raise ValueError(
            f"{path}: d2t and t2d disagree (d2t must map draft ids to distinct target ids in 0..{vocab - 1}, "
            "t2d mark exactly those): the draft vocabulary tensors are corrupt"
        )


def load_eagle3(path: Path, target: Target):
    """An EAGLE-3 directory (SGLang or speculators layout) as an Eagle3 module on `target`."""
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config

    cfg = read_config(path)
    fmt = detect_format(cfg or {})
    if fmt not in LAYER_PREFIX:
        raise ValueError(f"{path} is not an EAGLE-3 directory (architectures {(cfg or {}).get('architectures')})")
    tensors = read_tensors(path)
    refuse_problems(path, fmt, cfg, tensors, target)
    layer = cfg if fmt == "eagle3" else cfg["transformer_layer_config"]
    prefix = LAYER_PREFIX[fmt]
    state = {k.replace(prefix, "midlayer.", 1): v for k, v in tensors.items() if k != SHARED_EMBEDDING}
    if "d2t" not in state and cfg.get("draft_vocab_size") == target.vocab_size:  # full vocabulary: no mapping
        state.update(
            d2t=torch.zeros(target.vocab_size, dtype=torch.long), t2d=torch.ones(target.vocab_size, dtype=torch.bool)
        )
    draft_vocab(state["d2t"], state["t2d"], target.vocab_size, path)
    ids, explicit = capture_ids_hf(fmt, cfg, target.num_layers)
    unnamed = unnamed_ids_warning(cfg, ids, explicit)  # silent for our own exports of the default ids
    if unnamed:
        print(f"[{path}] warning: {unnamed}", file=sys.stderr)
    module = Eagle3(
        target,
        Eagle3Config(
            capture_ids=tuple(ids),
            draft_vocab_size=state["d2t"].numel(),
            intermediate_size=layer["intermediate_size"],
            fc_norm=bool(cfg.get("fc_norm", False)),  # EAGLE-3.1, top-level in both layouts (as vLLM reads them)
            norm_output=bool(cfg.get("norm_output", False)),
            # a Qwen3 (QK-norm) layer passed problems() only on a Qwen3 target, whose own layer type it is
            draft_layer="llama" if LAYOUTS[fmt].layer_type(cfg) == "llama" else "target",
        ),
    )
    module.load_state_dict(state)  # strict: problems() already matched every key and shape
    eps = float(layer.get("rms_norm_eps", module.norm.eps))
    for norm in (
        module.norm,
        module.midlayer.input_layernorm,
        module.midlayer.hidden_norm,
        module.midlayer.post_attention_layernorm,
        *(module.fc_norm or ()),
        *(m for name, m in module.midlayer.self_attn.named_children() if name in ("q_norm", "k_norm")),
    ):
        norm.eps = eps  # the drafter's own epsilon (the module defaults to the target's)
    return module.eval()


def load_medusa(path: Path, target: Target):
    """A vLLM-layout Medusa directory as a Medusa module on `target` (per-head matrices that all equal the
    target's LM head become the shared head; blocks without bias get zero biases, as vLLM computes)."""
    from drafters.trainable.medusa import Medusa, MedusaConfig

    cfg = read_config(path)
    tensors = read_tensors(path)
    refuse_problems(path, "medusa-vllm", cfg, tensors, target)
    K, n = cfg["num_heads"], cfg["num_hidden_layers"]
    heads = [tensors.get(f"lm_heads.{k}.weight", tensors["lm_heads.0.weight"]) for k in range(K)]
    shared = all(torch.equal(h.to(target.lm_head.weight.dtype), target.lm_head.weight.cpu()) for h in heads)
    module = Medusa(target, MedusaConfig(num_heads=K, num_layers=n, per_head_vocab=not shared))
    state = {k: v for k, v in tensors.items() if k.startswith("blocks.")}
    for k in range(K):
        for j in range(n):
            state.setdefault(f"blocks.{k}.layers.{j}.bias", torch.zeros(target.hidden_size))
        if not shared:
            state[f"lm_heads.{k}.weight"] = heads[k]
    module.load_state_dict(state)
    return module.eval()


def load_dflash(path: Path, target: Target):
    """A DFlash or DSpark directory (vLLM's DFlashDraftModel / Qwen3DSparkModel, or the speculators DFlash layout)
    as a DFlash / DSpark module on `target`."""
    from drafters.trainable.dflash import DFlash, DFlashConfig
    from drafters.trainable.dspark import DSpark, DSparkConfig

    cfg = read_config(path) or {}
    fmt = detect_format(cfg)
    tensors = read_tensors(path)
    refuse_problems(path, fmt, cfg, tensors, target)
    layout = BLOCK_LAYOUTS[fmt]
    dspark = fmt == "vllm-dspark"
    heads = (
        {k: tensors.pop(k) for k in (vllm_dspark.W1, vllm_dspark.W2, vllm_dspark.CONF, vllm_dspark.CONF_BIAS)}
        if dspark
        else {}
    )
    layer = layout.layer(cfg)
    mask = int(cfg["mask_token_id"] if fmt == "speculators-dflash" else cfg["dflash_config"]["mask_token_id"])
    state = {k: v for k, v in tensors.items() if k not in (EMBED, "lm_head.weight")}
    n = len(tensors["d2t"]) if "d2t" in tensors else 0  # a draft vocabulary: its head rows + d2t (vllm_dflash.py)
    if n:
        V, ids = target.vocab_size, torch.arange(n) + tensors["d2t"].long()
        state["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids.clamp(0, V - 1), True)
        draft_vocab(tensors["d2t"], state["t2d"], V, path)  # in range and distinct
        rows = tensors["lm_head.weight"]
        if not torch.equal(rows, target.lm_head.weight.detach().cpu()[ids].to(rows.dtype)):
            raise ValueError(
                f"{path}: lm_head.weight is not the target's LM head at the d2t ids: draftsmith's DFlash scores with "
                "the target's own head rows; export the drafter again (or use the target it was trained for)"
            )
    learned = EMBED in tensors  # the extra row after the target's vocabulary (vllm_dflash.py)
    if learned:
        embed, V = tensors[EMBED], target.vocab_size
        own = target.embed_tokens.weight.detach().cpu().to(embed.dtype)
        if mask != V or not torch.equal(embed[:V], own):
            raise ValueError(
                f"{path}: embed_tokens.weight is not the target's embedding plus one mask row at id {V} (mask_token_id "
                f"{mask}): vLLM would embed the tokens otherwise than draftsmith; export the drafter again"
            )
        state["mask_embedding"] = embed[V]
    config = dict(
        capture_ids=tuple(layout.capture_ids_hf(cfg)),  # ascending, as fc's column blocks are
        num_layers=int(layer["num_hidden_layers"]),
        block_size=int(cfg["block_size"]),
        mask_token_id=-1 if learned else mask,
        intermediate_size=int(layer["intermediate_size"]),
        qk_norm=True,
        draft_vocab_size=n,
    )
    if dspark:
        module = DSpark(target, DSparkConfig(**config, markov_rank=int(cfg["markov_rank"])))
        head = target.lm_head.weight.detach().cpu()
        state |= dspark_state(heads, head[ids] if n else head, target.vocab_size, path)
    else:
        module = DFlash(target, DFlashConfig(**config))
    module.load_state_dict(state)  # strict: problems() already matched every key and shape
    return module.eval()


def dspark_state(heads: dict[str, Tensor], head_rows: Tensor, vocab: int, path: Path) -> dict[str, Tensor]:
    """vLLM's DSpark heads (vllm_dspark.py) in ours: E = markov_w1's first V rows; W [D, r] solves
    head rows @ W = markov_w2 (the rows have rank D, so an export of ours gives W back up to rounding);
    the confidence head's first D columns and bias. Refused when no W reproduces markov_w2 and the confidence
    weight's Markov columns: a head of that form is not one draftsmith's DSpark computes."""
    rows = head_rows.double()  # [N, D]: the target's head rows the drafter scores
    w2, conf = heads[vllm_dspark.W2].double(), heads[vllm_dspark.CONF].double()  # [N, r], [1, D + r]
    proj = torch.linalg.lstsq(rows, w2).solution  # [D, r]
    D = rows.shape[1]
    off = max(
        float((rows @ proj - w2).abs().max() / w2.abs().max().clamp(min=1e-12)),
        float((conf[:, :D] @ proj - conf[:, D:]).abs().max() / conf[:, D:].abs().max().clamp(min=1e-12)),
    )
    if off > 0.05:  # bf16 rounding of an export of ours stays near 1e-2
        raise ValueError(
            f"{path}: markov_w2 is not the target's head rows times one [D, r] map (relative misfit {off:.2g}): "
            "draftsmith's DSpark adds its Markov term before the head and cannot hold this drafter"
        )
    dtype = heads[vllm_dspark.W1].dtype
    return {
        "markov.embed.weight": heads[vllm_dspark.W1][:vocab],  # a learned mask's extra row is never read
        "markov.proj.weight": proj.to(dtype),
        "conf_head.weight": heads[vllm_dspark.CONF][:, :D],
        "conf_head.bias": heads[vllm_dspark.CONF_BIAS],
    }


def engine_module(path: Path, target: Target):
    """The module of an EAGLE-3 (SGLang / speculators), vLLM Medusa or DFlash directory; None if it is neither."""
    fmt = detect_format(read_config(path) or {})
    if fmt in LAYER_PREFIX:
        return load_eagle3(path, target)
    if fmt == "medusa-vllm":
        return load_medusa(path, target)
    if fmt in BLOCK_LAYOUTS:
        return load_dflash(path, target)
    return None


def load_as_drafter(target: Target, path: Path):
    """registry.DIR_LOADERS entry: an engine-layout directory -> its decode-time drafter (None if not one)."""
    module = engine_module(path, target)
    return None if module is None else in_target_dtype(module, target).drafter(name=str(path))


def load_module(path: Path, target: Target):
    """The trainable module (float32) of a drafter directory: a native checkpoint, or an EAGLE-3 / Medusa
    engine layout. Raises naming what the directory is not."""
    if read_meta(path) is not None:
        return load_drafter(path, target).float()
    module = engine_module(path, target)
    if module is None:
        raise ValueError(
            f"{path} is not a drafter directory (no native config.json with 'draftsmith_drafter', "
            "nor an EAGLE-3 or Medusa engine layout)"
        )
    return module.float()
