"""Loading for training: per-sequence datasets, packing, seeded loaders.

Items are per-sequence dicts — input_ids [T] long, loss_mask [T] bool, and (offline) hidden {id: [T, D]},
topk_ids/topk_probs [T, k]. `collate` (train/batch.py) turns a list of them into the batch contract
documented in train/features.py (right padding with zeros). Packing concatenates whole sequences into rows of at
most `pack_length` tokens; the row's attention_mask numbers its sequences 1, 2, ... so attention and
positions stay per sequence, and loss_mask[0] = False of every sequence keeps predictions from
crossing a boundary.

`training_data(recipe, target, split)` is what the training loop calls: the cached features
(offline, fingerprint checked) or the token sequences plus an `OnlineFeatures` step function (online).
Either way `featurize(batch)` after moving the batch to the device yields the same dict.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable
from typing import Any

import datasets
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from decode.target import Target
from train.batch import collate
from train.cache import FeatureCache
from train.cache_key import feature_cache_dir, fingerprint
from train.config import Recipe
from train.data.pipeline import Dist, PreparedData, prepare_data
from train.features import OnlineFeatures


class TokenDataset(Dataset):
    """Token sequences ({input_ids, loss_mask} rows of a `datasets.Dataset`) as tensors."""

    def __init__(self, rows: datasets.Dataset) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        r = self.rows[int(i)]
        return {
            "input_ids": torch.tensor(r["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(r["loss_mask"], dtype=torch.bool),
        }

    def lengths(self) -> list[int]:
        return [len(x) for x in self.rows["input_ids"]]


class CachedFeatures(Dataset):
    """One split of a feature cache: sequences [0, n_train) are train, the rest eval."""

    def __init__(self, cache: FeatureCache, split: str, limit: int = 0) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        n_train = cache.index["n_train"]
        self.cache = cache
        self.start, self.stop = (0, n_train) if split == "train" else (n_train, cache.index["num_sequences"])
        if limit:  # the first `limit` sequences of the split (already in a seeded random order)
            self.stop = min(self.stop, self.start + limit)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.cache.sequence(self.start + int(i))

    def lengths(self) -> list[int]:
        return self.cache.lengths()[self.start : self.stop]


def pack_groups(lengths: list[int], pack_length: int, seed: int) -> list[list[int]]:
    """Greedy packing in a seeded order: consecutive sequences fill a row until the next would not fit."""
    if max(lengths, default=0) > pack_length:
        raise ValueError(
            f"a sequence of {max(lengths)} tokens does not fit pack_length {pack_length}; "
            "set pack_length >= data.max_length"
        )
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    groups, cur, used = [], [], 0
    for i in order:
        if cur and used + lengths[i] > pack_length:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        groups.append(cur)
    return groups


class Packed(Dataset):
    """Rows of several whole sequences (see pack_groups); item `segments` [T] numbers them 1, 2, ..."""

    def __init__(self, base: Dataset, pack_length: int, seed: int) -> None:
        self.base, self.groups = base, pack_groups(base.lengths(), pack_length, seed)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int) -> dict[str, Any]:
        items = [self.base[j] for j in self.groups[i]]
        keys = [k for k in items[0] if k != "hidden" and all(k in it for it in items)]  # argmax: not in older shards
        out: dict[str, Any] = {k: torch.cat([it[k] for it in items]) for k in keys}
        if "hidden" in items[0]:
            out["hidden"] = {h: torch.cat([it["hidden"][h] for it in items]) for h in items[0]["hidden"]}
        out["segments"] = torch.cat([torch.full((it["input_ids"].numel(),), k + 1) for k, it in enumerate(items)])
        return out


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of one epoch: a pure function of (seed, epoch), distinct for every pair."""
    return int.from_bytes(hashlib.sha256(f"draftsmith-epoch:{seed}:{epoch}".encode()).digest()[:7], "little")


class EpochShuffle(Sampler[int]):
    """Indices 0..n-1 in an order that depends only on (seed, epoch), never on how often it was drawn.

    torch's RandomSampler with a generator draws a fresh seed from that generator each epoch, so epoch e's
    order depends on the e iterations before it: a run resumed inside epoch e has not made them and sees
    another order (the epoch-boundary resume bug). Here `set_epoch(e)` picks the order outright, on every
    rank alike. No `generator` attribute, on purpose: accelerate would otherwise broadcast and reuse one.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        gen = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        return iter(torch.randperm(self.n, generator=gen).tolist())


def make_loader(
    ds: Dataset,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    drop_last: bool = False,
    num_workers: int = 0,
    pad_id: int = 0,
) -> DataLoader:
    """A DataLoader whose epoch-e order is a pure function of (seed, e) (call `set_epoch(e)` on the loader
    accelerate returns, or on its sampler). The loader's own generator only seeds workers: without it each
    iteration would draw that seed from the global torch RNG, shifting the stream dropout and noise use."""
    sampler = EpochShuffle(len(ds), seed) if shuffle else None
    return DataLoader(
        ds,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=functools.partial(collate, pad_id=pad_id),
    )


def check_limit(limit: int, available: int) -> None:
    """train.max_sequences asks for at most what the data has (else the run would silently train on less)."""
    if limit > available:
        raise ValueError(
            f"train.max_sequences={limit} but the data has only {available} train sequences; "
            f"set it to at most {available}, or 0 for all of them"
        )


def training_data(
    recipe: Recipe,
    target: Target,
    split: str = "train",
    dist: Dist | None = None,
    pack_length: int = 0,
    data: PreparedData | None = None,
    cache: FeatureCache | None = None,
) -> tuple[Dataset, Callable[[dict[str, Any]], dict[str, Any]]]:
    """(dataset of per-sequence items, featurize) for the recipe's features.mode.

    offline: `cache`, or the cache found where build_cache would put it, checked against the fingerprint
    recomputed from this recipe and target (missing or mismatched: an error that says how to rebuild);
    featurize is the identity. The train split keeps only its first recipe.train.max_sequences sequences when set.
    online: the token sequences; featurize runs the frozen target (OnlineFeatures) on each batch.
    `data` (prepare_data's result) saves preparing it again. Call it with the target as loaded (before
    any peft wrapping): the fingerprint hashes its weights.
    """
    dist = dist or Dist()
    fc = recipe.features
    limit = recipe.train.max_sequences if split == "train" else 0
    if fc.mode == "offline":
        if fc.cache_dir and cache is None:
            FeatureCache.open(fc.cache_dir)  # a clear "no cache here" before any data work
        data = data or prepare_data(recipe, target, dist, log=lambda s: None)
        if cache is None:
            fp = fingerprint(recipe, target, data)
            cache = FeatureCache.open(feature_cache_dir(recipe, target, fp), fp)
        check_limit(limit, cache.index["n_train"])
        ds: Dataset = CachedFeatures(cache, split, limit)
        featurize: Callable[[dict[str, Any]], dict[str, Any]] = lambda batch: batch  # noqa: E731
    else:
        data = data or prepare_data(recipe, target, dist, log=lambda s: None)
        rows = data.train if split == "train" else data.eval
        check_limit(limit, len(rows))
        ds = TokenDataset(rows.select(range(limit)) if limit else rows)
        featurize = OnlineFeatures(target, fc.hidden_ids, fc.topk)
    return (Packed(ds, pack_length, recipe.seed) if pack_length else ds), featurize
