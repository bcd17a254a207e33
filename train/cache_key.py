"""Which feature cache a recipe's features belong in: everything a cached feature depends on (the fingerprint a
cache is keyed by and checked against), and the directory it lives in under the data home.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from decode.target import Target
from train.config import Recipe
from train.data.identity import keyed_dir, target_identity
from train.data.pipeline import PreparedData


def data_digest(*parts: datasets.Dataset) -> str:
    """sha256 of every sequence's ids and loss mask, in order (what the cache's rows were computed from)."""
    h = hashlib.sha256()
    for ds in parts:
        for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
            h.update(np.asarray(ids, dtype=np.int32).tobytes())
            h.update(np.asarray(mask, dtype=np.bool_).tobytes())
            h.update(b"|")
        h.update(b"#")
    return h.hexdigest()[:16]


def fingerprint(recipe: Recipe, target: Target, data: PreparedData) -> dict[str, Any]:
    """Everything a cached feature depends on; training recomputes it and refuses a cache that differs."""
    fc = recipe.features
    return {
        "target": target_identity(target),
        "hidden_ids": sorted(set(fc.hidden_ids)),
        "dtype": fc.dtype,
        "topk": fc.topk,
        "max_length": recipe.data.max_length,
        "data": data_digest(data.train, data.eval),
        "n_train": len(data.train),
        "n_eval": len(data.eval),
    }


def feature_cache_dir(recipe: Recipe, target: Target, fp: dict[str, Any]) -> Path:
    """features.cache_dir when set, else DATA_HOME/features/<target>-<digest of the fingerprint>."""
    return Path(recipe.features.cache_dir) if recipe.features.cache_dir else keyed_dir("features", target, fp)
