"""Identities for fingerprints: which target (config + weights), which tokenizer, which data — and the
directories keyed by them under the data home ($DRAFTSMITH_DATA).

A feature cache or a regeneration directory records these; reusing it with a different target,
tokenizer or data is an error (never a silent reuse), so every digest must be cheap and stable
across processes and machines.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

# Config keys that change with the saving library or how the model was loaded, not with the model.
VOLATILE_CONFIG_KEYS = {
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "attn_implementation",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "use_cache",
    "architectures",
    "output_hidden_states",
    "_commit_hash",
}


def digest(obj: Any) -> str:
    """sha256 (16 hex chars) of a JSON-serialisable object with sorted keys."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_digest(config) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    return digest(d)


@torch.no_grad()
def weights_digest(model: torch.nn.Module, samples: int = 4096) -> str:
    """Hash of every parameter's name, shape, dtype and up to `samples` evenly spaced values.

    Reading a strided sample instead of every byte keeps this at milliseconds for a 14B model while
    still telling apart any two checkpoints that differ in more than a handful of weights.
    """
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(flat[::step][:samples].to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_digest(tok) -> str | None:
    if tok is None:
        return None
    vocab = sorted(tok.get_vocab().items())
    return digest(
        {
            "vocab": vocab,
            "template": getattr(tok, "chat_template", None),
            "special": sorted(map(str, tok.all_special_tokens)),
            "bos": tok.bos_token_id,
            "eos": tok.eos_token_id,
            "prefix": tok("", add_special_tokens=True)["input_ids"],
        }
    )


def target_identity(target) -> dict[str, Any]:
    """What identifies a frozen target for caching: its config, its weights and its tokenizer."""
    return {
        "config": config_digest(target.config),
        "weights": weights_digest(target.model),
        "tokenizer": tokenizer_digest(target.tokenizer),
        "dtype": str(target.dtype).removeprefix("torch."),
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
    }


def data_home() -> Path:
    """Where recipes keep the data they produce: $DRAFTSMITH_DATA, default ~/.cache/draftsmith/data.

    Never the working directory, so one recipe run from two folders shares its data.
    """
    return Path(os.environ.get("DRAFTSMITH_DATA") or Path.home() / ".cache" / "draftsmith" / "data").expanduser()


def keyed_dir(kind: str, target, identity: dict[str, Any]) -> Path:
    """DATA_HOME/kind/<target name>-<digest of identity>: one directory per target and settings, so two
    targets (or two settings) never share a path and the same ones always find their earlier work."""
    name = Path(str(getattr(target, "name_or_path", "") or target.config.model_type).rstrip("/")).name
    return data_home() / kind / f"{name}-{digest(identity)[:12]}"
