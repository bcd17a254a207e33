"""The on-disk feature cache: sharded safetensors + index.json, fingerprinted, resumable, mergeable.

Layout of `cache_dir`:
  shard_00000.safetensors   sequences [seq_start, seq_end), tokens concatenated (no padding):
      input_ids [N] int32, loss_mask [N] bool, offsets [n + 1] int64 (sequence j = rows offsets[j]:offsets[j+1]),
      hidden.{id} [N, D] storage dtype, argmax [N] int32 (the target's next token) and logz [N] float32 (the
      logsumexp of the head on hidden[L] as stored; each absent in caches built before it), and with top-k: topk_ids [N, k] int32,
      topk_probs [N, k] storage dtype.
      The safetensors metadata holds one key, "draftsmith": JSON {fingerprint hash, shard, seq_start, seq_end,
      tokens} (one key, because safetensors writes several in random order and shards must be byte-stable).
  index.json                written last, by rank 0, from the shards' metadata: the full fingerprint,
                            the split sizes (sequences [0, n_train) train, the rest eval), shard list, sizes.
A shard is written to a hidden temporary name and renamed, so a crash never leaves a readable half-shard.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from train.data.identity import digest
from train.killpoint import kill_point

INDEX = "index.json"
STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CacheError(ValueError):
    """A feature cache that cannot be used: missing, unreadable, or built from something else."""


def shard_name(s: int) -> str:
    return f"shard_{s:05d}.safetensors"


def bytes_per_token(hidden_size: int, n_hidden: int, dtype: str, topk: int) -> int:
    """Storage per token of this layout (what the projection in scripts/bench_features.py uses)."""
    el = torch.finfo(STORAGE_DTYPES[dtype]).bits // 8
    return 4 + 1 + 4 + 4 + n_hidden * hidden_size * el + topk * (4 + el)  # ids, mask, argmax, logz, hidden, top-k


def write_shard(path: Path, seqs: list[dict[str, Tensor]], meta: dict[str, Any], dtype: str) -> int:
    """Concatenate per-sequence features (each {input_ids [T], loss_mask [T], hidden.{i} [T, D], ...}) and
    save atomically; returns the number of tokens."""
    lens = [s["input_ids"].numel() for s in seqs]
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lens).cumsum(0)
    st = STORAGE_DTYPES[dtype]
    tensors = {"offsets": offsets}
    for key in seqs[0]:
        cat = torch.cat([s[key] for s in seqs])
        if key in ("input_ids", "topk_ids", "argmax"):
            cat = cat.to(torch.int32)
        elif key == "loss_mask":
            cat = cat.to(torch.bool)
        elif key == "logz":  # a 16-bit logz would move every probability exp(l - logz) by up to ~4%
            cat = cat.to(torch.float32)
        else:
            cat = cat.to(st)
        tensors[key] = cat.contiguous()
    meta = {**meta, "tokens": int(offsets[-1])}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"draftsmith": json.dumps(meta, sort_keys=True)})
    kill_point("features.write", path.name)  # test hook: a kill with the shard written but not yet renamed
    os.replace(tmp, path)
    return int(offsets[-1])


def shard_meta(path: Path) -> dict[str, Any]:
    """A shard's metadata (reads only the header); a missing or unreadable file is a CacheError naming it."""
    if not path.exists():
        raise CacheError(
            f"feature shard {path} listed in {INDEX} is missing; delete {path.parent / INDEX} and rerun "
            "`python -m train RECIPE.yaml` (or `python -m train.features`) to extract the missing shards"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {})["draftsmith"])
    except Exception as e:  # noqa: BLE001 - safetensors raises several kinds for a damaged file
        raise CacheError(
            f"feature shard {path} is unreadable ({type(e).__name__}: {e}); delete it and rerun "
            "`python -m train RECIPE.yaml` (or `python -m train.features`) to rebuild it"
        ) from e


def check_existing(cache_dir: Path, fingerprint: dict[str, Any]) -> bool:
    """True when a complete cache with this fingerprint is already there; raises when something else is.

    Finished shards of an interrupted run (same fingerprint) are fine: extraction skips them.
    """
    want = digest(fingerprint)
    index = cache_dir / INDEX
    if index.exists():
        old = read_index(cache_dir)
        if old["fingerprint_hash"] != want:
            raise mismatch(cache_dir, old["fingerprint"], fingerprint)
        for sh in old["shards"]:
            shard_meta(cache_dir / sh["file"])
        return True
    for p in sorted(cache_dir.glob("shard_*.safetensors")):
        if shard_meta(p)["fingerprint"] != want:
            raise CacheError(
                f"{p} was extracted with different settings than this recipe asks for; delete "
                f"{cache_dir} (or set features.cache_dir elsewhere) and rerun"
            )
    return False


def mismatch(cache_dir: Path, old: dict[str, Any], new: dict[str, Any]) -> CacheError:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    detail = "; ".join(f"{k}: cache {old.get(k)!r} vs now {new.get(k)!r}" for k in keys)
    return CacheError(
        f"feature cache {cache_dir} does not match this recipe/target ({detail[:600]}). Rebuild it: "
        f"delete {cache_dir} and rerun `python -m train RECIPE.yaml` (or point features.cache_dir "
        "elsewhere, or leave it unset: the default directory is keyed by the fingerprint)"
    )


def write_index(cache_dir: Path, fingerprint: dict[str, Any], n_shards: int, extra: dict[str, Any]) -> dict:
    """Merge the shards' metadata into index.json (rank 0, after every rank finished)."""
    shards = []
    for s in range(n_shards):
        p = cache_dir / shard_name(s)
        if not p.exists():
            raise CacheError(f"{p} is missing after extraction: a rank failed; rerun to finish the cache")
        m = shard_meta(p)
        shards.append(
            {
                "file": p.name,
                "seq_start": m["seq_start"],
                "seq_end": m["seq_end"],
                "tokens": m["tokens"],
                "bytes": p.stat().st_size,
            }
        )
    tokens, size = sum(s["tokens"] for s in shards), sum(s["bytes"] for s in shards)
    index = {
        "version": 1,
        "fingerprint_hash": digest(fingerprint),
        "fingerprint": fingerprint,
        **extra,
        "shards": shards,
        "tokens": tokens,
        "bytes": size,
        "bytes_per_token": size / max(tokens, 1),
    }
    tmp = cache_dir / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, cache_dir / INDEX)
    return index


def read_index(cache_dir: Path) -> dict[str, Any]:
    p = Path(cache_dir) / INDEX
    if not p.exists():
        raise CacheError(
            f"no feature cache at {cache_dir} ({INDEX} missing): `python -m train RECIPE.yaml` builds "
            "it before training (`python -m train.features RECIPE.yaml` builds only it)"
        )
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CacheError(f"{p} is unreadable ({e}); delete {cache_dir} and rerun python -m train RECIPE.yaml") from e


@dataclass
class FeatureCache:
    """Random access to the sequences of a finished cache (shards opened lazily, memory-mapped)."""

    cache_dir: Path
    index: dict[str, Any]

    @classmethod
    def open(cls, cache_dir: str | Path, fingerprint: dict[str, Any] | None = None) -> FeatureCache:
        """Open and check: the fingerprint must equal `fingerprint` (when given) and every shard must read."""
        cache_dir = Path(cache_dir)
        index = read_index(cache_dir)
        if fingerprint is not None and index["fingerprint_hash"] != digest(fingerprint):
            raise mismatch(cache_dir, index["fingerprint"], fingerprint)
        for sh in index["shards"]:
            if shard_meta(cache_dir / sh["file"])["fingerprint"] != index["fingerprint_hash"]:
                raise CacheError(
                    f"{cache_dir / sh['file']} belongs to another extraction than {INDEX}; rebuild "
                    f"the cache (delete {cache_dir} and rerun python -m train RECIPE.yaml)"
                )
        return cls(cache_dir, index)

    def __post_init__(self) -> None:
        self._starts = [sh["seq_start"] for sh in self.index["shards"]]
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, Tensor] = {}

    def __len__(self) -> int:
        return self.index["num_sequences"]

    def __getstate__(self) -> dict:  # DataLoader workers reopen shards themselves
        return {"cache_dir": self.cache_dir, "index": self.index}

    def __setstate__(self, state: dict) -> None:
        self.cache_dir, self.index = state["cache_dir"], state["index"]
        self.__post_init__()

    def _shard(self, s: int):
        if s not in self._handles:
            f = safe_open(str(self.cache_dir / self.index["shards"][s]["file"]), framework="pt")
            self._handles[s], self._offsets[s] = f, f.get_tensor("offsets")
        return self._handles[s], self._offsets[s]

    def lengths(self) -> list[int]:
        """Token count of every sequence, from the shards' offsets (no feature is read)."""
        out: list[int] = []
        for s in range(len(self.index["shards"])):
            off = self._shard(s)[1]
            out += (off[1:] - off[:-1]).tolist()
        return out

    def sequence(self, i: int) -> dict[str, Any]:
        """Sequence i: input_ids [T] long, loss_mask [T] bool, hidden {id: [T, D] float32}, argmax [T] long and
        logz [T] float32 (when the cache has them), topk_* [T, k]."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range 0..{len(self) - 1}")
        s = bisect.bisect_right(self._starts, i) - 1
        f, off = self._shard(s)
        j = i - self._starts[s]
        a, b = int(off[j]), int(off[j + 1])
        out: dict[str, Any] = {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
            "hidden": {h: f.get_slice(f"hidden.{h}")[a:b].float() for h in self.index["hidden_ids"]},
        }
        if "argmax" in f.keys():
            out["argmax"] = f.get_slice("argmax")[a:b].long()
        if "logz" in f.keys():
            out["logz"] = f.get_slice("logz")[a:b].float()
        if self.index["topk"]:
            out["topk_ids"] = f.get_slice("topk_ids")[a:b].long()
            out["topk_probs"] = f.get_slice("topk_probs")[a:b].float()
        return out
