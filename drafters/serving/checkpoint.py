"""Native drafter checkpoints (DESIGN §5): a directory with config.json + model.safetensors (+ adapter/).

config.json: {"draftsmith_drafter": kind, "format_version", "config": the drafter's config dataclass,
"target": {"name_or_path", "fingerprint", "tokenizer" (vocabulary digest, for `draftsmith doctor`)},
"capture_ids" (HF hidden-state ids), "draft_vocab_size", "recipe"}.
model.safetensors: the module's state dict, i.e. only what the drafter trained (and EAGLE-3's
d2t/t2d): the target's embedding and LM head are never in it (LayerSkip mode full's trained copy of the
target's first layers is: `early.<i>.<the layer's own keys>`). LayerSkip-LoRA keeps its adapter in
`adapter/` as a standard peft adapter directory. Loading reads safetensors only (never unpickles) and
refuses a target whose config fingerprint differs from the one the drafter was trained on.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from decode.errors import TYPE_NAMES, load_safetensors, read_json
from decode.protocol import Drafter
from decode.target import Target
from drafters.serving.layouts.rules import tokenizer_digest

FORMAT_VERSION = 1
ADAPTER_DIR = "adapter"
FINGERPRINT_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)


def drafter_kinds() -> dict[str, tuple[type, type]]:
    """kind -> (module class, config dataclass)."""
    from drafters.trainable.dflash import DFlash, DFlashConfig
    from drafters.trainable.dspark import DSpark, DSparkConfig
    from drafters.trainable.eagle import Eagle1, Eagle1Config
    from drafters.trainable.eagle3 import Eagle3, Eagle3Config
    from drafters.trainable.layerskip import LayerSkip, LayerSkipConfig
    from drafters.trainable.medusa import Medusa, MedusaConfig

    return {
        "eagle1": (Eagle1, Eagle1Config),
        "eagle3": (Eagle3, Eagle3Config),
        "medusa": (Medusa, MedusaConfig),
        "layerskip": (LayerSkip, LayerSkipConfig),
        "dflash": (DFlash, DFlashConfig),
        "dspark": (DSpark, DSparkConfig),
    }


def config_fingerprint(config: dict, vocab_size: int | None = None) -> dict:
    """The target facts a drafter's weights depend on, from a config dict: sizes, vocabulary, depth, rope base."""
    fp = {k: config.get(k) for k in FINGERPRINT_KEYS}
    fp["head_dim"] = fp["head_dim"] or config["hidden_size"] // config["num_attention_heads"]
    fp["vocab_size"] = vocab_size or config.get("vocab_size")
    rope = config.get("rope_parameters") or {}
    fp["rope_theta"] = float(rope.get("rope_theta", config.get("rope_theta", 0.0)) or 0.0)
    return fp


def target_fingerprint(target: Target) -> dict:
    """config_fingerprint of a loaded target (its vocabulary = the LM head's rows)."""
    return config_fingerprint(target.config.to_dict(), target.vocab_size)


def fingerprint_mismatch(saved: dict, target: Target | dict) -> list[str]:
    """What differs between a checkpoint's fingerprint and a target (loaded, or a fingerprint dict)."""
    now = target if isinstance(target, dict) else target_fingerprint(target)
    return [
        f"{k}: drafter trained for {saved[k]!r}, target has {now.get(k)!r}" for k in saved if saved[k] != now.get(k)
    ]


def config_from_dict(cls: type, d: dict):
    """A config dataclass from json (lists back to tuples); unknown keys are an error naming them."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown} (valid: {sorted(names)})")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    for f in fields(cls):
        if f.name in kw and not fits(kw[f.name], f.default):
            kind = TYPE_NAMES.get(type(f.default), f"a {type(f.default).__name__}")
            raise ValueError(
                f"{cls.__name__}: {f.name} must be {kind} (like the default {f.default!r}), got {kw[f.name]!r}"
            )
    return cls(**kw)


def fits(value, default) -> bool:
    """A json value of the default's type (an int where a float goes; anything for a None/factory default)."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return type(value) is int
    if isinstance(default, float):
        return type(value) in (int, float)
    if isinstance(default, (str, tuple)):
        return isinstance(value, type(default))
    return True


def native_meta(module: nn.Module, recipe: dict | None = None, target_id: str | None = None) -> dict:
    """config.json of a native checkpoint of `module` (no tensors read: works on the meta device too)."""
    kinds = drafter_kinds()
    if getattr(module, "kind", None) not in kinds:
        raise TypeError(
            f"{type(module).__name__} is not a draftsmith drafter module ({sorted(kinds)}); "
            "unwrap a DDP/FSDP-wrapped module first (accelerator.unwrap_model)"
        )
    target = module.target
    cfg = module.config
    return {
        "draftsmith_drafter": module.kind,
        "format_version": FORMAT_VERSION,
        "config": asdict(cfg),
        "target": {
            "name_or_path": target_id or getattr(target, "name_or_path", None),
            "fingerprint": target_fingerprint(target),
            "tokenizer": tokenizer_digest(target.tokenizer),
        },
        "capture_ids": list(getattr(cfg, "capture_ids", ())) or None,
        "draft_vocab_size": getattr(cfg, "draft_vocab_size", None),
        "recipe": recipe,
    }


def save_drafter(
    module: nn.Module,
    out_dir: str | os.PathLike,
    recipe: dict | None = None,
    target_id: str | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a native checkpoint atomically: build it in a temp dir next to out_dir, then rename into place.

    `state` replaces module.state_dict() when the module's own tensors are not the full weights (a
    sharded FSDP / ZeRO-3 module: pass the state dict accelerate gathered)."""
    meta = native_meta(module, recipe, target_id)
    full = state  # the gathered weights (LoRA's adapter included) or None: the module's own are whole
    state = module.state_dict() if state is None else state
    state = {k: v.detach().contiguous().cpu() for k, v in state.items() if not k.startswith("lora.")}

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if hasattr(module, "lora"):
            module.save_adapter(tmp / ADAPTER_DIR, full)

    return write_atomically(out_dir, write)


def write_atomically(out_dir: str | os.PathLike, write) -> Path:
    """Build a directory with `write(tmp_dir)` in a temp dir next to out_dir, then rename it into place.

    A failure leaves the old out_dir (if any) untouched and no temp dir behind.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_meta(ckpt_dir: str | os.PathLike) -> dict | None:
    """config.json of a native checkpoint, or None when the directory is not one."""
    p = Path(ckpt_dir) / "config.json"
    if not p.is_file():
        return None
    meta = read_json(p, "the checkpoint's config.json is damaged: re-export the drafter (or retrain it)")
    return meta if isinstance(meta, dict) and "draftsmith_drafter" in meta else None


def new_drafter(kind: str, target: Target, config: dict | object | None = None, **kwargs) -> nn.Module:
    """A fresh drafter module of `kind` (eagle1 | eagle3 | medusa | layerskip) with a config dataclass or dict.

    kwargs go to the constructor (EAGLE-3: token_counts=[V] for the draft vocabulary).
    """
    kinds = drafter_kinds()
    if kind not in kinds:
        raise ValueError(f"drafter kind {kind!r} not one of {sorted(kinds)}")
    cls, cfg_cls = kinds[kind]
    if isinstance(config, dict):
        config = config_from_dict(cfg_cls, config)
    elif config is not None and not isinstance(config, cfg_cls):
        raise TypeError(f"a {kind} drafter needs a {cfg_cls.__name__}, got {type(config).__name__}")
    return cls(target, config, **kwargs)


def skeleton_target(config) -> Target:
    """A target built on the meta device from its config (a PretrainedConfig): every shape, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return Target(model.eval().requires_grad_(False))


def native_shapes(meta: dict, target: Target) -> dict[str, tuple[int, ...]]:
    """{key: shape} of model.safetensors of a native checkpoint (meta = its config.json) on `target`.

    Builds the drafter module for real, so pass a skeleton_target to keep it free for 14B-sized targets.
    """
    module = new_drafter(meta["draftsmith_drafter"], target, meta["config"])
    return {k: tuple(v.shape) for k, v in module.state_dict().items() if not k.startswith("lora.")}


def load_drafter(ckpt_dir: str | os.PathLike, target: Target) -> nn.Module:
    """The trained module from a native checkpoint, on `target` (refused when its fingerprint differs)."""
    path = Path(ckpt_dir)
    meta = read_meta(path)
    if meta is None:
        raise ValueError(f"{path} is not a native draftsmith checkpoint (no config.json with 'draftsmith_drafter')")
    kind = meta["draftsmith_drafter"]
    if not isinstance(meta.get("config"), dict) or not isinstance((meta.get("target") or {}).get("fingerprint"), dict):
        raise ValueError(
            f"{path}/config.json lacks its 'config' or 'target.fingerprint' section: re-export the "
            "drafter (or retrain it)"
        )
    if kind not in drafter_kinds():
        raise ValueError(f"{path}: drafter kind {kind!r} unknown to this version ({sorted(drafter_kinds())})")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path}: checkpoint format {meta['format_version']} is newer than this version's {FORMAT_VERSION}"
        )
    check_target(meta, target, path)
    try:
        module = new_drafter(kind, target, meta["config"])
    except ValueError as e:  # a config section that is not this version's: name the file
        raise ValueError(f"{path}/config.json: {e}; re-export the drafter (or retrain it)") from None
    load_weights(module, path)
    return module.eval()


def check_target(meta: dict, target: Target, path: Path) -> None:
    problems = fingerprint_mismatch(meta["target"]["fingerprint"], target)
    if problems:
        raise ValueError(
            f"{path} was trained for another target ({meta['target'].get('name_or_path')}):\n  "
            + "\n  ".join(problems)
            + "\nload it with the target it was trained on"
        )


def load_weights(module: nn.Module, ckpt_dir: str | os.PathLike) -> None:
    """Load a native checkpoint's weights into an existing module of the same kind and config (e.g. to resume).

    Every key must match in name and shape: a tampered or foreign file is refused, naming the keys.
    """
    path = Path(ckpt_dir)
    meta = read_meta(path)
    if meta is None or meta["draftsmith_drafter"] != module.kind:
        raise ValueError(f"{path} is not a native {module.kind} checkpoint")
    check_target(meta, module.target, path)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{path}: model.safetensors is missing")
    state = load_safetensors(
        weights, "the checkpoint is damaged (an interrupted copy?): copy or export it again", str(module.target.device)
    )
    expected = {k: v for k, v in module.state_dict().items() if not k.startswith("lora.")}
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{weights}: keys do not match a {module.kind} drafter of this config "
            f"(missing {missing[:5]}, unexpected {extra[:5]}){switch_hint(missing + extra, module.config)}"
        )
    bad = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if state[k].shape != v.shape]
    if bad:
        raise ValueError(f"{weights}: tensor shapes differ from the config's: {bad[:5]}")
    kinds = [
        f"{k} {state[k].dtype}" for k, v in expected.items() if state[k].is_floating_point() != v.is_floating_point()
    ]
    if kinds:  # load_state_dict would cast silently; an integer weight (or a float index tensor) is a foreign file
        raise ValueError(
            f"{weights}: tensors of the wrong kind of dtype (integer vs floating point): {kinds[:5]}; "
            "the file is not this drafter's: export it again"
        )
    module.load_state_dict(state, strict=False)  # strict on everything but the LoRA adapter, checked above
    if hasattr(module, "lora"):
        module.load_adapter(path / ADAPTER_DIR)


def switch_hint(keys: list[str], config) -> str:
    """The config switch that adds the mismatched keys (EAGLE-3.1's fc_norm), so the error names what disagrees."""
    if any(k.startswith(("markov.", "conf_head.")) for k in keys):  # a DFlash checkpoint labelled dspark, say
        return (
            ": a DSpark checkpoint holds its Markov and confidence heads (markov.*, conf_head.*) and this file's "
            "weights do not match them; load a DSpark export, or set draftsmith_drafter to dflash for a DFlash one"
        )
    if not any(k.startswith("fc_norm.") for k in keys):
        return ""
    said = str(getattr(config, "fc_norm", False)).lower()
    return f": config.json says fc_norm={said} and the weights say otherwise; re-export the drafter (or retrain it)"


def in_target_dtype(module: nn.Module, target: Target) -> nn.Module:
    """The module cast to the target's floating dtype, for decoding: a bf16 target drafts in bf16 too.

    A module is built in float32 and a bf16 file is upcast into it on load; left so, every draft step
    of a bf16 run paid float32 matmuls (on the chat target a 16k-row draft head over 8 rows: 6.2 ms vs
    1.1 ms in bf16). The target verifies every draft, so the drafter's dtype changes which tokens are
    proposed, never what is emitted. A float32 target keeps a float32 drafter (bit-exact comparisons).
    """
    return module.to(target.dtype) if target.dtype.is_floating_point else module


# attribute on a target's model naming the LayerSkip-LoRA checkpoint whose adapters it carries, and its module
LORA_OWNER = "_draftsmith_lora_owner"


def load_as_drafter(target: Target, path: Path) -> Drafter | None:
    """registry.DIR_LOADERS entry: a native checkpoint directory -> its decode-time drafter (None if not native).

    A LayerSkip-LoRA checkpoint injects its adapters into the target's own modules, so one target carries one;
    the same directory asked for again (a benchmark's chain, tree and auto rows) gets a new drafter on the
    module already loaded (each drafter keeps its own KV cache; the adapters are only read)."""
    if read_meta(path) is None:
        return None
    owner = getattr(target.model, LORA_OWNER, None)
    if owner is not None and owner[0] == path.resolve():
        return owner[1].drafter(name=str(path))
    module = in_target_dtype(load_drafter(path, target), target)
    if getattr(module, "adapters", None) is not None:
        setattr(target.model, LORA_OWNER, (path.resolve(), module))
    return module.drafter(name=str(path))
