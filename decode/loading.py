"""Loading a target: any HF decoder-only LM and its tokenizer, with one clear error for each way it can fail.

A model directory without config.json, a hub id while offline, a truncated safetensors file, a model without the
standard `model.model.{embed_tokens,layers,norm,rotary_emb}` + `lm_head` layout, a draft model with another
tokenizer: each stops with a message that says what to do (decode.errors turns it into one `error:` line).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from decode.errors import UserError, one_line, read_json
from decode.precision import resolve_dtype

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def local_config(name_or_path: str | os.PathLike) -> dict | None:
    """A local model directory's config.json as a dict (None: a hub id, or no readable config)."""
    try:
        cfg = json.loads((Path(name_or_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


class LayoutError(ValueError):
    """The model does not have the standard `model.model.{embed_tokens,layers,norm,rotary_emb}` + `lm_head` layout."""


def check_layout(model: nn.Module) -> None:
    """Refuse a model the layer-by-layer runner cannot drive."""
    inner = getattr(model, "model", None)
    missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(inner, n)]
    if inner is None or missing or not hasattr(model, "lm_head"):
        what = "model.model" if inner is None else ", ".join(f"model.model.{n}" for n in missing) or "lm_head"
        raise LayoutError(
            f"{type(model).__name__} lacks the standard decoder-only layout ({what}); "
            "draftsmith needs model.model.{embed_tokens,layers,norm,rotary_emb} and lm_head"
        )


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """A local directory, or a hub id that must already be in the local cache when offline."""
    p = Path(name_or_path)
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} exists but has no config.json: point --target at a model directory")
        read_json(p / "config.json", "the model's config.json is damaged: copy or download the model again")
        return str(p)
    s = str(name_or_path)
    if s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise FileNotFoundError(f"model directory not found: {s}")
    return s


def load_model(
    name_or_path: str | os.PathLike,
    dtype: str = "float32",
    attn: str = "sdpa",
    device: str = "cpu",
    device_map: dict[str, str] | None = None,
    offload_folder: str | None = None,
) -> nn.Module:
    """Load an HF causal LM (trust_remote_code off) with a clear error when it cannot be found.

    With `device_map` (see decode.offload) accelerate places each module and attaches the hooks
    that stream offloaded layers; `device` is then ignored (the map says where everything goes).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a 47-tensor "Loading weights" bar per load is noise
    dtype = resolve_dtype(dtype, device if device_map is None else "cpu", local_config(name_or_path))
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not one of {sorted(DTYPES)} or 'auto'")
    path = resolve_model_path(name_or_path)
    placed = {} if device_map is None else dict(device_map=device_map, offload_folder=offload_folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], attn_implementation=attn, trust_remote_code=False, **placed
        )
    except SafetensorError as e:  # a truncated or corrupt weight file (an interrupted download or copy)
        raise UserError(
            f"{broken_file(path)}: not a readable safetensors file ({one_line(e)}); copy or download the model again"
        ) from None
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1: download it first or pass a local directory)" if offline else ""
        raise FileNotFoundError(f"cannot load model {str(name_or_path)!r}{hint}: {e}") from e
    if device_map is None:
        model = model.to(device)
    return model.eval().requires_grad_(False)


def broken_file(model_dir: str) -> str:
    """The first safetensors file of a local model directory whose header does not read (else the directory)."""
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt"):
                pass
        except SafetensorError:
            return str(f)
    return model_dir


def load_tokenizer(name_or_path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=False)


def check_same_tokenizer(target, draft, what: str) -> None:
    """Refuse a drafter whose vocabulary (token -> id) or special tokens differ from the target's."""
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is None or dt is None:
        if target.vocab_size != draft.vocab_size:
            raise ValueError(f"{what}: vocab size {draft.vocab_size} differs from the target's {target.vocab_size}")
        return
    if tt.get_vocab() != dt.get_vocab():
        a, b = tt.get_vocab(), dt.get_vocab()
        diff = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise ValueError(
            f"{what}: its tokenizer differs from the target's ({len(a)} vs {len(b)} tokens; "
            f"e.g. {diff}); a draft model must share the target's tokenizer"
        )
    for attr in ("bos_token_id", "eos_token_id"):
        if getattr(tt, attr) != getattr(dt, attr):
            raise ValueError(f"{what}: {attr} {getattr(dt, attr)} differs from the target's {getattr(tt, attr)}")
    if draft.vocab_size < len(tt.get_vocab()):
        raise ValueError(f"{what}: LM head covers {draft.vocab_size} tokens, the tokenizer has {len(tt.get_vocab())}")
