"""The batch contract (documented in train/features.py): per-sequence items collated into one padded batch.

A leaf module: feature extraction (train/features.py) and the training loaders (train/dataset.py)
both build batches with `collate`, so neither has to import the other for it.
"""

from __future__ import annotations

from typing import Any

import torch


def collate(items: list[dict[str, Any]], pad_id: int = 0) -> dict[str, Any]:
    """Per-sequence (or packed) items -> the batch contract of train/features.py, right-padded."""
    b, t = len(items), max(it["input_ids"].numel() for it in items)
    batch: dict[str, Any] = {
        "input_ids": torch.full((b, t), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros(b, t, dtype=torch.long),
        "position_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
    }
    for r, it in enumerate(items):
        n = it["input_ids"].numel()
        seg = it.get("segments", torch.ones(n, dtype=torch.long))
        batch["input_ids"][r, :n] = it["input_ids"]
        batch["attention_mask"][r, :n] = seg
        batch["loss_mask"][r, :n] = it["loss_mask"]
        starts = torch.ones(n, dtype=torch.bool)
        starts[1:] = seg[1:] != seg[:-1]
        idx = torch.arange(n)
        batch["position_ids"][r, :n] = idx - torch.cummax(torch.where(starts, idx, 0), 0).values
    if "hidden" in items[0]:
        batch["hidden"] = {}
        for h, x in items[0]["hidden"].items():
            buf = x.new_zeros(b, t, x.shape[-1])
            for r, it in enumerate(items):
                buf[r, : it["input_ids"].numel()] = it["hidden"][h]
            batch["hidden"][h] = buf
    for key, dtype in (("argmax", torch.long), ("logz", torch.float32)):
        if all(key in it for it in items):  # a cache extended by newer code may have it in some shards only
            batch[key] = torch.zeros(b, t, dtype=dtype)
            for r, it in enumerate(items):
                batch[key][r, : it["input_ids"].numel()] = it[key]
    for key in ("topk_ids", "topk_probs"):
        if key in items[0]:
            k = items[0][key].shape[-1]
            buf = items[0][key].new_zeros(b, t, k)
            for r, it in enumerate(items):
                buf[r, : it["input_ids"].numel()] = it[key]
            batch[key] = buf
    return batch
